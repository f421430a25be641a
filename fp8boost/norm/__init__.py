"""Normalization layers of HF models, fused in eager mode (``install_fused_rms_norms``).

A layer between ``loss/`` and ``fp8/``: it imports neither (only ``_state``), and the plugins
and benches above install it on a model.
"""
from .rms_norm import FusedForward, FusedNormReport, install_fused_rms_norms, llama_rms_norm

__all__ = ["FusedForward", "FusedNormReport", "install_fused_rms_norms", "llama_rms_norm"]
