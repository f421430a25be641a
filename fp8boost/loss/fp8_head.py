"""The fused lm_head + loss with its logits and input-gradient GEMMs in FP8 (rowwise or blockwise).

A causal LM's head is its largest GEMM: at a 128256-word vocabulary and hidden 4096 it holds more
FLOPs than four Llama-3-8B decoder layers' attention projections, and FP8 layer conversion keeps
it in BF16 (its logits feed the loss directly). :class:`Fp8Head` runs two of its three GEMMs in
FP8 inside :func:`~fp8boost.loss.chunked_linear_cross_entropy`, chunk by chunk:

    logits[c, V]  = h[c, H]  . W[V, H]^T     h: one scale per token (row) / 1x128 tile
                                             W: one scale per vocabulary row / 128x128 block
    dL/dh[c, H]   = g[c, V]  . W^T[H, V]^T   g: one scale per token / tile along V
                                             W^T: one scale per hidden unit / the blocks again

The weight gradient ``g^T . h`` stays a BF16 GEMM that adds into the weight gradient chunk by
chunk (``addmm``). In FP8 its reduced axis is the chunk's tokens, so each chunk's product would
come back as a separate BF16 matrix the size of the weight, to be added in a second pass: at 8
chunks that extra traffic (8 x 3 x weight bytes) costs more than FP8 saves on that GEMM.

The logit gradient ``g = softmax - onehot`` has most of its entries near ``1 / V`` of the
largest: at one scale per token (rowwise), E4M3's range (2^17.8 from its largest to its
smallest subnormal) flushes many of them to zero at a 128k vocabulary, E5M2's (2^32) keeps
them, so the rowwise head casts ``g`` to E5M2. Blockwise scales each 128 vocabulary entries of a
token on their own, so its recipe's E4M3 keeps them.

The weight's two FP8 operands are made once per call (one read of W), each token chunk's ``h``
once per chunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fp8boost.fp8.backends import get_backend
from fp8boost.fp8.config import Fp8Config
from fp8boost.fp8.granular import GranularFp8, fast_accum, granular_mm, quantize_with

__all__ = ["HEAD_RECIPES", "Fp8Head", "head_config"]

#: Recipes the FP8 head takes: one scale per row (torchao's rowwise) or DeepSeek-V3's tiles and
#: blocks. Tensorwise is not offered: one scale for a whole chunk of logit gradients leaves most
#: tokens' small probabilities below FP8's range.
HEAD_RECIPES = ("rowwise", "blockwise")


def head_config(recipe: str) -> Fp8Config:
    """The FP8 config of the head's GEMMs for a recipe name (``HEAD_RECIPES``).

    Example:
        >>> from fp8boost.loss.fp8_head import head_config
        >>> head_config("rowwise").recipe, head_config("rowwise").grad_dtype
        ('rowwise', torch.float8_e5m2)
    """
    if recipe not in HEAD_RECIPES:
        raise ValueError(f"the FP8 lm_head takes recipe {' or '.join(HEAD_RECIPES)}, got "
                         f"{recipe!r}")
    if recipe == "rowwise":  # E4M3 operands forward, E5M2 logit gradient (module docstring)
        return Fp8Config.from_recipe(recipe, fp8_format="hybrid")
    return Fp8Config.from_recipe(recipe)


@dataclass
class Fp8Head:
    """The head weight's FP8 operands for one call, and the two FP8 GEMMs of each chunk.

    Example:
        >>> import torch
        >>> from fp8boost.loss.fp8_head import Fp8Head, head_config
        >>> w = torch.randn(64, 32)
        >>> head = Fp8Head.prepare(w, head_config("rowwise"), want_dgrad=True, backend="emulated")
        >>> head.logits(torch.randn(8, 32), None).shape
        torch.Size([8, 64])
    """

    config: Fp8Config
    backend: object
    w_rows: GranularFp8
    """``W[V, H]`` scaled along H: the logits GEMM's operand."""
    w_cols: Optional[GranularFp8]
    """``W^T[H, V]`` scaled along V: the input-gradient GEMM's operand (None: not needed)."""

    @classmethod
    def prepare(cls, weight: torch.Tensor, config: Fp8Config, *, want_dgrad: bool,
                backend: object = None) -> "Fp8Head":
        """Cast ``weight`` once: its rows for the logits and, with ``want_dgrad``, its columns
        for ``dL/dh``. ``backend`` None: ``config.backend`` resolved on the weight's device."""
        if backend is None:
            backend = get_backend(config.backend, weight.device)
        rows, cols = quantize_with(weight.detach(), config.fwd_dtype, config, weight=True,
                                   rows=True, cols=want_dgrad, backend=backend)
        return cls(config, backend, rows, cols)

    def logits(self, h: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``h . W^T (+ bias)`` in ``h``'s dtype, from FP8 operands (FP32 accumulation)."""
        hq, _ = quantize_with(h, self.config.fwd_dtype, self.config, weight=False, rows=True,
                              cols=False, backend=self.backend)
        return granular_mm(hq, self.w_rows, self.backend, bias=bias, out_dtype=h.dtype,
                           use_fast_accum=fast_accum(self.config, "fprop"))

    def input_grad(self, g: torch.Tensor) -> torch.Tensor:
        """``g . W`` (``dL/dh`` of the chunk) in ``g``'s dtype, from FP8 operands."""
        if self.w_cols is None:
            raise RuntimeError("Fp8Head.prepare(want_dgrad=False) made no W^T operand")
        gq, _ = quantize_with(g, self.config.grad_dtype, self.config, weight=False, rows=True,
                              cols=False, backend=self.backend)
        return granular_mm(gq, self.w_cols, self.backend, out_dtype=g.dtype,
                           use_fast_accum=fast_accum(self.config, "dgrad"))
