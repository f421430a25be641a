"""The FP8 GEMM operand of the rowwise and blockwise recipes: :class:`GranularFp8`.

Its own module (torch only) so that the Triton kernels that build it
(``fp8boost.fp8.kernels.granular_cast``) and the reference quantizers that dispatch to them
(:mod:`.quantize`) both import it without importing each other. Scale layouts: see
:mod:`.quantize`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("row", "tile", "block")


@dataclass
class GranularFp8:
    """One FP8 GEMM operand ``data[R, C]`` (reduced over C) with per-row/tile/block scales.

    Attributes:
        data: FP8 tensor, row-major ``[R, C]``.
        inv_scale: FP32 inverse scales, shaped as in the module docstring for ``kind``.
        kind: ``"row"``, ``"tile"`` or ``"block"``.
        block: tile length / block side (``kind`` tile or block; 0 for row).
    """

    data: torch.Tensor
    inv_scale: torch.Tensor
    kind: str
    block: int = 0

    def expanded_inv_scale(self) -> torch.Tensor:
        """The inverse scale of every element, ``[R, C]`` FP32 (broadcastable for ``row``)."""
        if self.kind == "row":
            return self.inv_scale
        r, c = self.data.shape
        s = self.inv_scale.repeat_interleave(self.block, dim=1)[:, :c]
        if self.kind == "block":
            s = s.repeat_interleave(self.block, dim=0)[:r]
        return s

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data.float() * inv_scale`` per element, in FP32, returned as ``dtype``."""
        return (self.data.float() * self.expanded_inv_scale()).to(dtype)

    def t(self) -> "GranularFp8":
        """The transposed operand (``block`` kind only: the same blocks, transposed)."""
        if self.kind != "block":
            raise ValueError(f"only weight blocks transpose into an operand (kind={self.kind!r});"
                             " quantize along the other dim instead (quantize_operands)")
        return GranularFp8(self.data.t().contiguous(), self.inv_scale.t().contiguous(),
                           "block", self.block)
