"""fp8boost: FP8 training for PyTorch (Booster + plugins, Triton FP8 kernels, FP8 collectives).

Importing fp8boost does nothing but define names: no device probes, no environment reads.
"""
__version__ = "0.1.0"
