"""Fp8Linear under the rowwise and blockwise recipes: its forward is :func:`granular_linear`.

What the tensorwise path of :class:`~fp8boost.fp8.linear.Fp8Linear` has and these recipes do
not use, by design:

* no amax history buffers (current scaling per row/tile/block) and no amax reduction: every
  scale comes from the elements of its own row, tile or block. Under tensor parallelism each
  rank scales its shard's rows/tiles from their own elements (``set_amax_groups`` stores
  nothing for these recipes): where a row of an operand spans shards (the input and weight of
  a row-parallel layer, the output gradient and ``W^T`` of a column-parallel one) the scale is
  the shard's, finer than one process's, so parity with one process holds within FP8
  tolerance rather than bit for bit; blockwise tiles and blocks of shards that are multiples
  of ``block_size`` are exactly one process's;
* no shared input casts (``share_input_casts``: under ``torch.compile`` CSE merges them);
* no prequantized weight (``set_prequantized_weight`` refuses these recipes, FSDP2's and ZeRO's
  FP8 all-gathers leave their weights in high precision): an FP8 carrier that reaches the
  layer anyway (weight or input) is dequantized and re-quantized, warned once;
* the weight cast is not cached across micro-batches (``cache_weight_cast``), except for a
  frozen weight (LoRA's base layer): its two FP8 operands (fprop's and dgrad's) are made once
  and reused until the weight is written, loaded or :func:`invalidate_weight_caches` runs.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8boost import _state

from .config import Fp8Config
from .granular.function import granular_linear, weight_operands
from .granular.gemm import prepare as prepare_granular
from .prequantized import Fp8WeightTensor, dequantize_weight

__all__ = ["granular_forward", "prepare_granular", "weight_operands"]


class _Dequantize(torch.autograd.Function):
    """An FP8 carrier's value as a plain tensor; its gradient passes through unchanged (a
    plain tensor of the carrier's dtype, as the tensorwise path returns for it)."""

    @staticmethod
    def forward(ctx, t):
        return dequantize_weight(t)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _plain(t: torch.Tensor, role: str, recipe: str) -> torch.Tensor:
    if not isinstance(t, Fp8WeightTensor):
        return t
    why = (f"an FP8 {role} carries one scale per tensor; the {recipe} recipe re-quantizes it "
           "per row/tile (send it in high precision to skip the double rounding)")
    _state.warn_once(("fp8-linear-granular-carrier", role),
                     f"fp8boost: Fp8Linear dequantizes an FP8 {role}: {why}")
    return _Dequantize.apply(t)


def granular_forward(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     config: Fp8Config, backend, weight_q=None) -> torch.Tensor:
    """``Fp8Linear``'s forward under a rowwise/blockwise ``config``: ``[M, K] -> [M, N]``.

    Args:
        x2d: the input, leading dims flattened.
        weight: the layer's weight (an FP8 carrier is dequantized, warned once).
        bias: in the input's dtype, or None.
        config: the layer's ``Fp8Config`` (``recipe`` in ``GRANULAR_RECIPES``).
        backend: the layer's resolved ``Fp8Backend``.
        weight_q: the frozen weight's kept operands (:func:`weight_operands`), or None.
    """
    x2d = _plain(x2d, "input", config.recipe)
    weight = _plain(weight, "weight", config.recipe)
    return granular_linear(x2d, weight, bias, config, backend, weight_q)
