"""Rowwise FP8 operands of the grouped expert GEMMs, in plain torch ops.

Every operand is K-major (its last dim is the GEMM's reduced dim), with FP32 *inverse*
scales (``data.float() * inv_scale ~= original``), as in ``fp8boost.fp8.granular``:

==================  ==========================  ======================  ====================
operand             tensor                      one scale per           ``inv_scale``
==================  ==========================  ======================  ====================
tokens (x, dy)      ``[rows, K]``               row (token)             ``[rows]``
expert weights      ``[E, N, K]``               expert row (e, n)       ``[E, N]``
token-axis (wgrad)  ``[C, rows]`` (transposed)  (expert, column)        ``[E, C]``
==================  ==========================  ======================  ====================

The token-axis operands (``dy^T`` and ``x^T`` of the weight gradient, reduced over the tokens
of each expert) take one scale per column *per expert group*: the amax runs over that group's
rows only (a ``scatter_reduce`` over the routing's row-to-expert map), so one expert's
outliers never coarsen another's scale. Padding and tail rows are zero and belong to no group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..granular.quantize import quantize_rows
from ..scaling import cast_to_fp8, scale_from_amax


@dataclass(frozen=True)
class ScaleOptions:
    """How the expert operands are scaled (from the run's ``Fp8Config``).

    Attributes:
        fwd_dtype: FP8 dtype of activations and weights (e4m3).
        grad_dtype: FP8 dtype of gradients (e4m3: the grouped kernel takes no e5m2).
        margin: scales divided by ``2**margin``.
        power_of_2: scales rounded down to powers of two.
    """

    fwd_dtype: torch.dtype = torch.float8_e4m3fn
    grad_dtype: torch.dtype = torch.float8_e4m3fn
    margin: int = 0
    power_of_2: bool = False


def quantize_tokens(x: torch.Tensor, dtype: torch.dtype, opts: ScaleOptions):
    """One scale per row of ``x [rows, K]``: returns ``(data [rows, K], inv_scale [rows])``.

    Example:
        >>> data, inv = quantize_tokens(torch.randn(32, 64), torch.float8_e4m3fn, ScaleOptions())
        >>> tuple(data.shape), tuple(inv.shape)
        ((32, 64), (32,))
    """
    q = quantize_rows(x, dtype, margin=opts.margin, power_of_2=opts.power_of_2)
    return q.data, q.inv_scale.reshape(-1)


def quantize_experts(w: torch.Tensor, opts: ScaleOptions, *, transpose: bool = False):
    """One scale per expert row of ``w [E, N, K]`` (amax over K).

    With ``transpose``, the operand is ``w^T [E, K, N]`` reduced over N (the input-gradient
    GEMM's weight), one scale per (expert, k).

    Returns:
        ``(data [E, N, K] or [E, K, N] contiguous FP8, inv_scale [E, N] or [E, K])``.

    Example:
        >>> data, inv = quantize_experts(torch.randn(4, 32, 16), ScaleOptions(), transpose=True)
        >>> tuple(data.shape), tuple(inv.shape)
        ((4, 16, 32), (4, 16))
    """
    w = w.detach()
    if transpose:
        w = w.transpose(-2, -1)
    e, n, k = w.shape
    q = quantize_rows(w.reshape(e * n, k), opts.fwd_dtype, margin=opts.margin,
                      power_of_2=opts.power_of_2)
    return q.data.view(e, n, k), q.inv_scale.view(e, n)


def quantize_groups_t(x: torch.Tensor, group: torch.Tensor, num_experts: int,
                      dtype: torch.dtype, opts: ScaleOptions):
    """``x [rows, C]`` scaled per (expert group, column), emitted transposed.

    Args:
        x: the tokens-by-features tensor (``x`` or ``dy`` of a grouped GEMM).
        group: ``[rows]`` expert of each row (``num_experts`` for rows of no group).
        num_experts: E.
        dtype: FP8 dtype.
        opts: scaling options.

    Returns:
        ``(data [C, rows] FP8 row-major, inv_scale [E, C])``.

    Example:
        >>> x = torch.randn(32, 8)
        >>> g = torch.tensor([0] * 16 + [1] * 16)
        >>> data, inv = quantize_groups_t(x, g, 2, torch.float8_e4m3fn, ScaleOptions())
        >>> tuple(data.shape), tuple(inv.shape)
        ((8, 32), (2, 8))
    """
    rows, c = x.shape
    xd = x.detach()
    amax = torch.zeros(num_experts + 1, c, dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, group.view(-1, 1).expand(rows, c), xd.abs().float(), "amax")
    scale = scale_from_amax(amax, dtype, opts.margin, opts.power_of_2)
    data = cast_to_fp8(xd, scale[group], dtype)
    return data.t().contiguous(), scale[:num_experts].reciprocal().contiguous()
