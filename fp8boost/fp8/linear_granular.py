"""Fp8Linear under the rowwise and blockwise recipes: its forward is :func:`granular_linear`.

What the tensorwise path of :class:`~fp8boost.fp8.linear.Fp8Linear` has and these recipes do
not use, by design:

* no amax history buffers (current scaling per row/tile/block) and no tensor-wide amax:
  every scale comes from the elements of its own row, tile or block. Under tensor
  parallelism (``set_amax_groups``), rowwise reduces only where a row spans shards: the
  per-row amaxes of the input and weight of a row-parallel layer (K split) and of the output
  gradient and ``W^T`` of a column-parallel one (N split) are all-reduced (MAX, one float per
  row), so every FP8 byte is the one one process would cast (:class:`RowGroups`). Blockwise
  needs no reduction: tiles and blocks stay within a shard, exactly one process's when the
  split dim of each shard is a multiple of ``block_size`` (otherwise the tile or block at a
  shard edge is scaled from the shard's part of it);
* shared input casts as tensorwise has them (``share_input_casts``, eager): layers reading one
  tensor (q/k/v, gate/up) share its row/tile operand and the ``x^T`` operand kept for wgrad,
  made once (:func:`shared_input_operands`); under ``torch.compile`` CSE merges the casts;
* FP8 weights made elsewhere, blockwise only: a block-scaled FP8 weight carrier of the
  layer's format is used as is (FSDP2's block-scaled FP8 all-gather makes them:
  ``parallel/fsdp/block_gather.py``), and so is a blockwise ``set_prequantized_weight``
  operand while the weight is unchanged (ZeRO's: ``parallel/zero/direct_blocks.py``); rowwise
  refuses a prequantized weight, and any other FP8 carrier (weight or input) is dequantized and
  re-quantized, warned once;
* the weight cast is not cached across micro-batches (``cache_weight_cast``), except for a
  frozen weight (LoRA's base layer): its two FP8 operands (fprop's and dgrad's) are made once
  and reused until the weight is written, loaded or :func:`invalidate_weight_caches` runs.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8boost import _state

from . import shared_cast
from .config import Fp8Config
from .granular.function import (RowGroups, carrier_mismatch, granular_linear, input_operands,
                                needs_input_t, weight_operands)
from .granular.gemm import prepare as prepare_granular
from .granular.quantize import GranularFp8
from .prequantized import Fp8WeightTensor, PrequantizedWeight, dequantize_weight, transpose_fp8
from .recompute import compiling

__all__ = ["RowGroups", "granular_forward", "prepare_granular", "prequantized_block_operands",
           "row_groups", "shared_input_operands", "weight_operands"]


class _Dequantize(torch.autograd.Function):
    """An FP8 carrier's value as a plain tensor; its gradient passes through unchanged (a
    plain tensor of the carrier's dtype, as the tensorwise path returns for it)."""

    @staticmethod
    def forward(ctx, t):
        return dequantize_weight(t)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _plain(t: torch.Tensor, role: str, config: Fp8Config) -> torch.Tensor:
    if not isinstance(t, Fp8WeightTensor):
        return t
    if role == "weight" and carrier_mismatch(t, config) is None:
        return t  # block-scaled FP8 of this layer's format: the GEMM operand as is
    recipe = config.recipe
    why = (carrier_mismatch(t, config) if t.block else
           f"an FP8 {role} carries one scale per tensor; the {recipe} recipe re-quantizes it "
           "per row/tile (send it in high precision to skip the double rounding)")
    _state.warn_once(("fp8-linear-granular-carrier", role),
                     f"fp8boost: Fp8Linear dequantizes an FP8 {role}: {why}")
    return _Dequantize.apply(t)


def prequantized_block_operands(pre: PrequantizedWeight) -> tuple[GranularFp8, GranularFp8]:
    """A blockwise prequantized weight (ZeRO's block-scaled FP8 all-gather) as the two GEMM
    operands ``weight_q`` takes: the blocks, and their transpose (made once per operand)."""
    if pre.data_t is None:
        pre.data_t = transpose_fp8(pre.data)
    return (GranularFp8(pre.data, pre.inv_scale, "block", pre.block),
            GranularFp8(pre.data_t, pre.inv_scale.t().contiguous(), "block", pre.block))


def row_groups(groups: dict[str, object], recipe: str) -> Optional[RowGroups]:
    """What ``Fp8Linear.set_amax_groups``'s ``{role: group}`` means for a granular recipe.

    The roles name the operands tensor parallelism splits (the tensorwise meaning): ``input``
    and ``weight`` for a row-parallel layer, ``grad`` and ``weight`` for a column-parallel
    one. Rowwise turns them into the operands whose rows span shards: ``input`` -> ``x``,
    ``grad`` -> ``dy``, and ``weight`` -> ``w`` when K is split (``input`` given) or ``wt``
    when N is split (``grad`` given). Blockwise: None (shard-local tiles and blocks).
    """
    if recipe != "rowwise" or not groups:
        return None
    w = groups.get("weight")
    if w is not None and groups.get("input") is None and groups.get("grad") is None:
        raise ValueError("set_amax_groups: under the rowwise recipe the 'weight' role alone "
                         "does not say which dim is split; pass 'input' with it for a "
                         "row-parallel layer (K split) or 'grad' for a column-parallel one "
                         "(N split)")
    return RowGroups(x=groups.get("input"), dy=groups.get("grad"),
                     w=w if groups.get("input") is not None else None,
                     wt=w if groups.get("grad") is not None else None)


def shared_input_operands(src: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor,
                          config: Fp8Config, backend, groups: Optional[RowGroups] = None
                          ) -> Optional[tuple[GranularFp8, Optional[GranularFp8]]]:
    """The input operands of ``x2d`` (a view of ``src``), cast once for every eager layer that
    reads ``src`` unchanged with the same settings (:mod:`.shared_cast`); None where layers do
    not share: ``share_input_casts`` off, under ``torch.compile`` (CSE merges the casts
    there), or ``src`` an FP8 carrier.

    Exact: the operands are :func:`input_operands`'s, the bytes each layer would cast. The
    ``x^T`` operand is made when this layer's wgrad needs it; a cast without it (a frozen
    layer's) does not serve a layer that does.
    """
    if not config.share_input_casts or compiling() or isinstance(src, Fp8WeightTensor):
        return None
    cols = needs_input_t(config, weight.requires_grad, torch.is_grad_enabled())
    key = ("granular", config.recipe, config.fwd_dtype, config.block_size, config.margin,
           config.power_of_2_scale, getattr(backend, "name", backend),
           (groups or RowGroups()).x, tuple(x2d.shape), x2d.stride(), x2d.dtype)
    return shared_cast.cast_once(
        src, key, cols, lambda: input_operands(x2d, config, cols=cols, backend=backend,
                                               groups=groups), has_transpose=cols)


def granular_forward(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     config: Fp8Config, backend, weight_q=None,
                     groups: Optional[RowGroups] = None,
                     share_src: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``Fp8Linear``'s forward under a rowwise/blockwise ``config``: ``[M, K] -> [M, N]``.

    Args:
        x2d: the input, leading dims flattened.
        weight: the layer's weight (an FP8 carrier is dequantized, warned once).
        bias: in the input's dtype, or None.
        config: the layer's ``Fp8Config`` (``recipe`` in ``GRANULAR_RECIPES``).
        backend: the layer's resolved ``Fp8Backend``.
        weight_q: the frozen weight's kept operands (:func:`weight_operands`), or None.
        groups: the rowwise tensor-parallel reductions (:func:`row_groups`), or None.
        share_src: the layer's input as the caller got it (``x2d`` is a view of it): layers
            reading the same tensor share its cast (:func:`shared_input_operands`). None: no
            sharing.
    """
    x_q = None
    if share_src is not None:
        x_q = shared_input_operands(share_src, x2d, weight, config, backend, groups)
    x2d = _plain(x2d, "input", config)
    weight = _plain(weight, "weight", config)
    return granular_linear(x2d, weight, bias, config, backend, weight_q, groups, x_q)
