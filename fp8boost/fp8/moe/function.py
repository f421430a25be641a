"""The three grouped FP8 GEMMs of one expert projection, as one autograd function.

For expert ``e`` and its rows ``x_e`` (``W [E, N, K]``, the HF layout):

    fprop  y_e  = x_e . W_e^T      x: a scale per token row     W: per expert row (e, n)
    dgrad  dx_e = dy_e . W_e       dy: per token row            W^T: per (e, k)
    wgrad  dW_e = dy_e^T . x_e     dy^T, x^T: per (e, column) over expert e's tokens

Forward saves ``x^T`` in FP8 (1 byte/element) when the weight needs a gradient, and the
Parameter itself (kept anyway), re-quantized along N in backward. With
``GroupedOptions.wgrad_fp8=False`` the weight gradient runs in the inputs' precision instead
(``dW_e = dy_e^T . x_e`` by ``torch._grouped_mm``; ``x`` saved as it is). Rows of no expert (padding,
tail) come out as zeros. Outputs and gradients come back in the dtypes of their inputs.

Under ``torch.compile`` dynamo traces this function's forward and backward into the graph
(the :class:`Routing` and :class:`GroupedOptions` it takes are frozen dataclasses: the
routing's tensors become graph inputs, the options constants). Nothing here reads a tensor on
the host, so nothing breaks the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scaling import cast_result
from .gemm import emulated_mm, emulated_mm_wgrad, scaled_mm, scaled_mm_wgrad
from .quantize import (ScaleOptions, quantize_experts, quantize_groups_t, quantize_tokens,
                       quantize_tokens_and_groups_t)
from .routing import Routing


@dataclass(frozen=True)
class GroupedOptions:
    """Per-call options of :func:`grouped_linear`.

    Attributes:
        scales: how operands are scaled.
        backend: ``emulated`` or ``scaled_grouped_mm``.
        fast_accum_fprop: fast accumulation in fprop (``scaled_grouped_mm`` only).
        fast_accum_dgrad: in dgrad.
        fast_accum_wgrad: in wgrad.
        wgrad_fp8: the weight gradient in FP8 (else in the inputs' dtype, BF16 in training).
    """

    scales: ScaleOptions = ScaleOptions()
    backend: str = "emulated"
    fast_accum_fprop: bool = True
    fast_accum_dgrad: bool = False
    fast_accum_wgrad: bool = False
    wgrad_fp8: bool = True


def _mm(a, a_inv, b, b_inv, r: Routing, opts: GroupedOptions, fast: bool, dtype):
    if opts.backend == "scaled_grouped_mm":
        out = scaled_mm(a, a_inv, b, b_inv, r.offsets, fast)
    else:
        out = emulated_mm(a, a_inv, b, b_inv, r.offsets, r.group, r.local)
    # Rows of no expert: zero (the kernel leaves the tail unwritten).
    return cast_result(torch.where((r.group < r.num_experts).unsqueeze(1), out, 0), dtype)


def _mm_wgrad(a, a_inv, b, b_inv, r: Routing, opts: GroupedOptions, dtype):
    if opts.backend == "scaled_grouped_mm":
        out = scaled_mm_wgrad(a, a_inv, b, b_inv, r.offsets, opts.fast_accum_wgrad)
    else:
        out = emulated_mm_wgrad(a, a_inv, b, b_inv, r.offsets, r.group, r.local)
    return cast_result(out, dtype)


def _mm_wgrad_hp(dy, x, r: Routing, opts: GroupedOptions, dtype):
    """``dW_e = dy_e^T . x_e`` in the inputs' precision: BF16 ``torch._grouped_mm`` on the GPU
    backend, the emulated op (FP32, unit scales) elsewhere. Rows of no expert hold zeros in
    ``x`` (the routing's buffers), so the padding inside a group adds nothing."""
    if opts.backend == "scaled_grouped_mm":
        out = torch._grouped_mm(dy.t(), x, offs=r.offsets)
        sizes = torch.diff(r.offsets, prepend=r.offsets.new_zeros(1))
        out = torch.where((sizes > 0).view(-1, 1, 1), out, 0)  # an expert with no rows: zero
    else:
        e = r.num_experts
        ones_a = dy.new_ones(e, dy.shape[1], dtype=torch.float32)
        ones_b = x.new_ones(e, x.shape[1], dtype=torch.float32)
        out = emulated_mm_wgrad(dy.t().float(), ones_a, x.t().float(), ones_b, r.offsets,
                                r.group, r.local)
    return cast_result(out, dtype)


class GroupedFp8Linear(torch.autograd.Function):
    """``apply(x, weight, routing, opts, save_x)``: see :func:`grouped_linear`."""

    @staticmethod
    def forward(ctx, x, weight, routing: Routing, opts: GroupedOptions, save_x: bool):
        s = opts.scales
        saved = (None, None)
        if save_x and opts.wgrad_fp8:  # x and x^T from one call (one pair of passes, fused)
            (xq, x_inv), saved = quantize_tokens_and_groups_t(
                x, routing.group, routing.num_experts, s.fwd_dtype, s, backend=opts.backend,
                offsets=routing.offsets)
        else:
            xq, x_inv = quantize_tokens(x, s.fwd_dtype, s, backend=opts.backend)
            if save_x:  # the high-precision weight gradient reads x as it is
                saved = (x.detach(), None)
        wq, w_inv = quantize_experts(weight, s, backend=opts.backend)
        y = _mm(xq, x_inv, wq, w_inv, routing, opts, opts.fast_accum_fprop, x.dtype)
        ctx.save_for_backward(weight, *saved)
        ctx.routing, ctx.opts, ctx.x_dtype = routing, opts, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        weight, xt, xt_inv = ctx.saved_tensors
        r, opts = ctx.routing, ctx.opts
        s = opts.scales
        dy = dy.contiguous()
        dx = dw = None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if need_dw and not opts.wgrad_fp8:
            dw = _mm_wgrad_hp(dy, xt, r, opts, weight.dtype)  # xt: x itself here
            need_dw = False
        if need_dx and need_dw:  # dy and dy^T from one call (one pair of passes, fused path)
            (dyq, dy_inv), (dyt, dyt_inv) = quantize_tokens_and_groups_t(
                dy, r.group, r.num_experts, s.grad_dtype, s, backend=opts.backend,
                offsets=r.offsets)
        elif need_dx:
            dyq, dy_inv = quantize_tokens(dy, s.grad_dtype, s, backend=opts.backend)
        elif need_dw:
            dyt, dyt_inv = quantize_groups_t(dy, r.group, r.num_experts, s.grad_dtype, s,
                                             backend=opts.backend, offsets=r.offsets)
        if need_dx:
            wtq, wt_inv = quantize_experts(weight, s, transpose=True, backend=opts.backend)
            dx = _mm(dyq, dy_inv, wtq, wt_inv, r, opts, opts.fast_accum_dgrad, ctx.x_dtype)
            # Freed before the weight-gradient GEMM: W^T alone is E*K*N bytes (0.9 GiB for a
            # Mixtral-8x7B gate_up), which would otherwise sit on top of that GEMM's peak.
            del dyq, dy_inv, wtq, wt_inv
        if need_dw:
            dw = _mm_wgrad(dyt, dyt_inv, xt, xt_inv, r, opts, weight.dtype)
        return dx, dw, None, None, None


def grouped_mm_hp(x: torch.Tensor, weight: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``y[r] = x[r] . weight[e(r)]^T`` in the inputs' precision (``torch._grouped_mm``, with
    torch's autograd): the BF16 experts an :class:`~fp8boost.fp8.moe.experts.Fp8Experts` runs
    where FP8 measured slower. Rows of no expert come out as zeros. On CPU the product runs in
    FP32 (torch's CPU kernel takes FP32 only) and comes back in ``x``'s dtype."""
    a, b = x, weight.transpose(-2, -1)
    if x.device.type == "cpu":
        a, b = a.float(), b.float()
    out = torch._grouped_mm(a, b, offs=routing.offsets)
    return torch.where((routing.group < routing.num_experts).unsqueeze(1), out, 0).to(x.dtype)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, routing: Routing,
                   opts: GroupedOptions) -> torch.Tensor:
    """``y[r] = x[r] . weight[e(r)]^T`` for every row ``r`` of expert ``e(r)``, in FP8.

    Args:
        x: ``[routing.rows, K]`` rows laid out by :func:`fp8boost.fp8.moe.routing.route`.
        weight: ``[E, N, K]`` expert weights (HF's ``gate_up_proj`` / ``down_proj``).
        routing: the layer's row layout.
        opts: scales and backend.

    Returns:
        ``[routing.rows, N]`` in ``x``'s dtype; rows of no expert are zero.

    Example:
        >>> from fp8boost.fp8.moe.routing import route
        >>> r = route(torch.tensor([[0, 1], [1, 0]]), 2)
        >>> x = torch.zeros(r.rows, 16).index_copy(0, r.pos, torch.randn(4, 16))
        >>> grouped_linear(x, torch.randn(2, 32, 16), r, GroupedOptions()).shape
        torch.Size([48, 32])
    """
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped_linear expects x [rows, K] and weight [E, N, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] != routing.rows or weight.shape[0] != routing.num_experts:
        raise ValueError(f"x has {x.shape[0]} rows and weight {weight.shape[0]} experts, the "
                         f"routing {routing.rows} and {routing.num_experts}: route the same "
                         "top_k_index with the weight's expert count")
    save_x = torch.is_grad_enabled() and weight.requires_grad
    return GroupedFp8Linear.apply(x, weight, routing, opts, save_x)
