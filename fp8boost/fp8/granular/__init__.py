"""Rowwise and blockwise (DeepSeek-V3) FP8 recipes: quantizers, GEMMs, the linear function.

``quantize``: reference quantizers (plain torch) returning :class:`GranularFp8` operands;
``gemm``: :func:`granular_mm` on the emulated / cuBLAS paths; ``function``:
:func:`granular_linear`, the autograd function Fp8Linear runs for these recipes.
"""
from .function import (GranularLinearFunction, RowGroups, fast_accum, granular_linear,
                       input_operands, quantize_with, weight_operands)
from .gemm import (blockwise_gemm_unavailable, blockwise_scaled_mm, emulated_mm, granular_mm,
                   rowwise_scaled_mm)
from .quantize import (GranularFp8, quantize_blocks, quantize_cols_t, quantize_operands,
                       quantize_rows, quantize_tiles, quantize_tiles_t)

__all__ = ["GranularFp8", "GranularLinearFunction", "RowGroups", "blockwise_gemm_unavailable",
           "blockwise_scaled_mm", "rowwise_scaled_mm",
           "emulated_mm", "fast_accum", "granular_linear", "granular_mm", "input_operands",
           "quantize_blocks",
           "quantize_cols_t", "quantize_operands", "quantize_rows", "quantize_tiles",
           "quantize_tiles_t", "quantize_with", "weight_operands"]
