"""FP8 checkpoints that inference engines load (vLLM, SGLang, transformers, compressed-tensors).

``booster.save_model(model, path, fp8_export="per_tensor" | "block" | "compressed_tensors")``
writes them from any plugin; :func:`load_dequantized` reads them back for tests. Layouts:
``layouts``; the casts: ``quantize``; calibration: ``calibrate``; conversion: ``writer``.
Nothing is imported until used.
"""
from __future__ import annotations

__all__ = ["LAYOUTS", "load_dequantized", "make_spec", "save_fp8_model"]


def __getattr__(name):
    if name in ("LAYOUTS", "make_spec"):
        # lazy (PEP 562): importing fp8boost.export imports nothing until a name is used
        from . import layouts
        return getattr(layouts, name)
    if name == "save_fp8_model":
        # lazy (PEP 562): importing fp8boost.export imports nothing until a name is used
        from .save import save_fp8_model
        return save_fp8_model
    if name == "load_dequantized":
        # lazy (PEP 562): importing fp8boost.export imports nothing until a name is used
        from .loader import load_dequantized
        return load_dequantized
    raise AttributeError(name)
