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
outliers never coarsen another's scale. Padding and tail rows belong to no group: they join no
amax and their bytes are zero whatever they hold (a padding row sits inside its expert's
``offsets`` range, so the grouped wgrad GEMM would otherwise sum it in).

Dispatch: with ``backend="scaled_grouped_mm"`` (the grouped GEMM's GPU backend), CUDA calls
take the Triton kernels of :mod:`fp8boost.fp8.kernels.moe_cast` (the same bytes and scales, in
one or two reads of each tensor instead of the half-dozen passes, and the FP32 copy, of these
torch ops), as the custom ops of :mod:`~fp8boost.fp8.kernels.moe_cast_ops`, in eager mode and
under ``torch.compile`` alike (inductor lowers the group amax's ``scatter_reduce`` to an
atomic ATen kernel slower than the expert GEMMs; see that module). CPU tensors, the
``emulated`` backend and ``backend=None`` keep the torch ops, as do inputs the kernels refuse
(``moe_cast.supports``; logged once with the reason).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ... import _state
from ..granular.quantize import quantize_rows
from ..kernels.tuning import interpreting
from ..scaling import cast_to_fp8, scale_from_amax

# Grouped GEMM backends whose CUDA casts take the Triton kernels (kernels.moe_cast_ops).
FUSED_BACKENDS = ("scaled_grouped_mm",)
_LOG = logging.getLogger("fp8boost.fp8.moe")


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


def _import_kernels():
    try:
        # lazy: the kernels import triton, which is optional
        from ..kernels import moe_cast_ops
    except Exception as e:  # noqa: BLE001 (no/broken Triton: any import error means "no")
        _state.log_once(_LOG, "moe-cast-import", f"FP8 expert casts: Triton kernels unavailable "
                        f"({type(e).__name__}: {e}); using the torch ops")
        return None
    return moe_cast_ops


def fused_kernels(x: torch.Tensor, backend: Optional[str], what: str, dtype: torch.dtype,
                  opts: ScaleOptions, group: Optional[torch.Tensor] = None):
    """The ``moe_cast_ops`` module when this cast should take it, else None (torch ops).

    Taken on CUDA (or under Triton's interpreter) under :data:`FUSED_BACKENDS`, for plain
    tensors, once Triton imported (checked once per process) and when ``moe_cast.supports``
    takes the inputs (a refusal is logged once per ``what``, with the reason); in eager mode
    and under ``torch.compile`` (the casts are custom ops: one opaque call in the graph).
    """
    if backend not in FUSED_BACKENDS or type(x) not in (torch.Tensor, torch.nn.Parameter):
        return None
    # Under Triton's CPU interpreter (TRITON_INTERPRET=1, a debugging mode) CPU tensors take
    # the kernels too, so that the CPU tests exercise this dispatch end to end.
    if not (x.is_cuda or interpreting()):
        return None
    kernels = _state.probe("moe-triton-cast", _import_kernels)
    if kernels is None:
        return None
    kw = dict(margin=opts.margin, power_of_2=opts.power_of_2)
    if not kernels.supports(x, dtype, group=group, **kw):
        _state.log_once(_LOG, f"moe-cast-unsupported-{what}", f"fp8boost: FP8 expert cast "
                        f"'{what}' uses the torch ops: the Triton kernels do not take "
                        f"{kernels.why_unsupported(x, dtype, **kw)}", level=logging.INFO)
        return None
    return kernels


def fused_path_problem(device: torch.device, backend: str = FUSED_BACKENDS[0]) -> Optional[str]:
    """Why eager casts of a token tensor on ``device`` would *not* take the Triton kernels.

    None when they do: the question :func:`fused_kernels` answers for every call, asked with a
    representative operand (a ``[128, 256]`` bfloat16 token tensor, e4m3, default scaling) so
    that benches and tests can say which path they measure before they time it.

    Example:
        >>> fused_path_problem(torch.device("cpu"))
        'cpu tensors take the torch ops (the kernels run on CUDA)'
    """
    device = torch.device(device)
    if backend not in FUSED_BACKENDS:
        return f"backend {backend!r} keeps the torch ops (fused under {FUSED_BACKENDS})"
    if device.type != "cuda" and not interpreting():
        return f"{device.type} tensors take the torch ops (the kernels run on CUDA)"
    x = torch.empty(128, 256, dtype=torch.bfloat16, device=device)
    if fused_kernels(x, backend, "probe", torch.float8_e4m3fn, ScaleOptions()) is not None:
        return None
    if _state.probe("moe-triton-cast", _import_kernels) is None:
        return "the Triton kernels failed to import (see the log)"
    return "the kernels refuse this operand (see the log)"


def quantize_tokens(x: torch.Tensor, dtype: torch.dtype, opts: ScaleOptions, *,
                    backend: Optional[str] = None):
    """One scale per row of ``x [rows, K]``: returns ``(data [rows, K], inv_scale [rows])``.

    ``backend``: the grouped GEMM backend (see the module docstring's dispatch).

    Example:
        >>> data, inv = quantize_tokens(torch.randn(32, 64), torch.float8_e4m3fn, ScaleOptions())
        >>> tuple(data.shape), tuple(inv.shape)
        ((32, 64), (32,))
    """
    kernels = fused_kernels(x, backend, "tokens", dtype, opts)
    if kernels is not None and x.dim() == 2:
        return kernels.quantize_rows(x.detach(), dtype, margin=opts.margin,
                                     power_of_2=opts.power_of_2)
    q = quantize_rows(x, dtype, margin=opts.margin, power_of_2=opts.power_of_2)
    return q.data, q.inv_scale.reshape(-1)


def quantize_experts(w: torch.Tensor, opts: ScaleOptions, *, transpose: bool = False,
                     backend: Optional[str] = None):
    """One scale per expert row of ``w [E, N, K]`` (amax over K).

    With ``transpose``, the operand is ``w^T [E, K, N]`` reduced over N (the input-gradient
    GEMM's weight), one scale per (expert, k). ``backend``: see the module docstring.

    Returns:
        ``(data [E, N, K] or [E, K, N] contiguous FP8, inv_scale [E, N] or [E, K])``.

    Example:
        >>> data, inv = quantize_experts(torch.randn(4, 32, 16), ScaleOptions(), transpose=True)
        >>> tuple(data.shape), tuple(inv.shape)
        ((4, 16, 32), (4, 16))
    """
    w = w.detach()
    kernels = fused_kernels(w, backend, "experts", opts.fwd_dtype, opts)
    if kernels is not None and w.dim() == 3:
        rq, cq = kernels.quantize_experts(w, opts.fwd_dtype, rows=not transpose, cols=transpose,
                                          margin=opts.margin, power_of_2=opts.power_of_2)
        return cq if transpose else rq
    if transpose:
        w = w.transpose(-2, -1)
    e, n, k = w.shape
    q = quantize_rows(w.reshape(e * n, k), opts.fwd_dtype, margin=opts.margin,
                      power_of_2=opts.power_of_2)
    return q.data.view(e, n, k), q.inv_scale.view(e, n)


def quantize_groups_t(x: torch.Tensor, group: torch.Tensor, num_experts: int,
                      dtype: torch.dtype, opts: ScaleOptions, *, backend: Optional[str] = None,
                      offsets: Optional[torch.Tensor] = None):
    """``x [rows, C]`` scaled per (expert group, column), emitted transposed.

    Args:
        x: the tokens-by-features tensor (``x`` or ``dy`` of a grouped GEMM).
        group: ``[rows]`` expert of each row (``num_experts`` for rows of no group, which get
            zero bytes and join no amax).
        num_experts: E.
        dtype: FP8 dtype.
        opts: scaling options.
        backend: the grouped GEMM backend (see the module docstring's dispatch).
        offsets: the routing's ``[E]`` end offsets, when ``group`` comes from one (rows sorted
            by expert): the fused path then loops down each expert's rows
            (:mod:`fp8boost.fp8.kernels.moe_seg_cast`). The same results either way.

    Returns:
        ``(data [C, rows] FP8 row-major, inv_scale [E, C])``.

    Example:
        >>> x = torch.randn(32, 8)
        >>> g = torch.tensor([0] * 16 + [1] * 16)
        >>> data, inv = quantize_groups_t(x, g, 2, torch.float8_e4m3fn, ScaleOptions())
        >>> tuple(data.shape), tuple(inv.shape)
        ((8, 32), (2, 8))
    """
    kernels = fused_kernels(x, backend, "groups_t", dtype, opts, group)
    if kernels is not None and num_experts >= 1:
        _, (data_t, inv_t) = kernels.quantize_groups_t(
            x, group, num_experts, dtype, margin=opts.margin, power_of_2=opts.power_of_2,
            offsets=offsets)
        return data_t, inv_t
    rows, c = x.shape
    # Rows of no group: zero before the amax and the cast (their group's scale is dropped).
    xd = x.detach().masked_fill((group >= num_experts).view(-1, 1), 0)
    amax = torch.zeros(num_experts + 1, c, dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, group.view(-1, 1).expand(rows, c), xd.abs().float(), "amax")
    scale = scale_from_amax(amax, dtype, opts.margin, opts.power_of_2)
    data = cast_to_fp8(xd, scale[group], dtype)
    return data.t().contiguous(), scale[:num_experts].reciprocal().contiguous()


def quantize_tokens_and_groups_t(x: torch.Tensor, group: torch.Tensor, num_experts: int,
                                 dtype: torch.dtype, opts: ScaleOptions, *,
                                 backend: Optional[str] = None,
                                 offsets: Optional[torch.Tensor] = None):
    """:func:`quantize_tokens` and :func:`quantize_groups_t` of the same ``x``, in one call.

    The same results as the two calls; on the fused path both operands come from one pair of
    passes over ``x`` (two reads instead of three): ``x`` in fprop + its saved ``x^T``, ``dy``
    in dgrad + wgrad. ``offsets``: as in :func:`quantize_groups_t`.

    Returns:
        ``((data [rows, K], inv_scale [rows]), (data_t [K, rows], inv_scale_t [E, K]))``.

    Example:
        >>> x, g = torch.randn(32, 8), torch.tensor([0] * 16 + [1] * 16)
        >>> (d, i), (dt, it) = quantize_tokens_and_groups_t(x, g, 2, torch.float8_e4m3fn,
        ...                                                 ScaleOptions())
        >>> tuple(d.shape), tuple(dt.shape), tuple(it.shape)
        ((32, 8), (8, 32), (2, 8))
    """
    kernels = fused_kernels(x, backend, "tokens+groups_t", dtype, opts, group)
    if kernels is not None and num_experts >= 1:
        return kernels.quantize_groups_t(x, group, num_experts, dtype, rows=True,
                                         margin=opts.margin, power_of_2=opts.power_of_2,
                                         offsets=offsets)
    return (quantize_tokens(x, dtype, opts),
            quantize_groups_t(x, group, num_experts, dtype, opts))
