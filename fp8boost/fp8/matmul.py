"""The three FP8 GEMMs of a tensorwise/delayed linear layer, as one stateless autograd function.

All three run in "NT" form (both operands K-major: row-major with the reduced dim last), as
Hopper FP8 tensor cores require:

    fprop  y[M,N]  = x[M,K]  . W[N,K]^T    mm(xq,      wq)       x e4m3 [M,K],  W e4m3 [N,K]
    dgrad  dx[M,K] = dy[M,N] . W[N,K]      mm(dyq,     wq_t)     dy e5m2 [M,N], W^T e4m3 [K,N]
    wgrad  dW[N,K] = dy^T    . x           mm(dyq_t,   xq_t)     dy^T e5m2 [N,M], x^T e4m3 [K,M]

So each cast emits the row-major copy and, when backward needs it, the transposed copy in one
pass. Backward saves ``xq_t`` (1 byte/element), never the high-precision input. Bias stays in
high precision.

The function holds no state. Its operands come from an :class:`Fp8Operands` (the layer's
:class:`~fp8boost.fp8.operands.OperandSource`): where the FP8 bytes come from (a cast, a cached
cast, FP8 bytes made by FSDP, ZeRO or the sequence-parallel gather) and how each is scaled (the
recipe's :class:`~fp8boost.fp8.casts.TensorwiseCasts`) are the source's business.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from .prequantized import fp8_weight_transpose
from .recompute import compiling as _compiling
from .scaling import Fp8Tensor, cast_result


class Fp8Operands(Protocol):
    """Where :class:`Fp8Matmul` gets its FP8 operands (``OperandSource`` implements it)."""

    casts: Any
    """The recipe's casts (``config``, ``backend``, ``quantize``): ``fp8/casts.py``."""

    def input_operand(self, x2d: torch.Tensor, with_transpose: bool) -> Fp8Tensor:
        """The input in FP8 (with its transpose for wgrad when asked)."""

    def is_direct(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is FP8 bytes to use as they are (no cast; transpose in backward)."""

    def weight_operand(self, weight: torch.Tensor, with_transpose: bool,
                       recompute: bool = False) -> Fp8Tensor:
        """The weight in FP8; ``recompute``: backward may re-cast the transpose itself."""

    def weight_transpose(self, weight: torch.Tensor, w_amax: torch.Tensor) -> Fp8Tensor:
        """Backward: the K-major ``W^T`` operand, cast with the forward's amax (same bytes)."""


class Fp8Matmul(torch.autograd.Function):
    """``y = x2d @ weight.T + bias`` with fprop, dgrad and wgrad in FP8:
    ``Fp8Matmul.apply(x2d [M, K], weight [N, K], bias or None, operands, grad)``; ``grad``
    (default True): the caller's ``torch.is_grad_enabled()``.

    Example:
        >>> import torch
        >>> from fp8boost.fp8 import Fp8Config, Fp8Linear
        >>> from fp8boost.fp8.matmul import Fp8Matmul
        >>> layer = Fp8Linear(64, 32, bias=False, config=Fp8Config(backend="emulated"))
        >>> Fp8Matmul.apply(torch.randn(8, 64), layer.weight, None, layer.operands).shape
        torch.Size([8, 32])
    """

    @staticmethod
    def forward(ctx, x2d, weight, bias, ops: Fp8Operands, grad: bool = True):
        casts = ops.casts
        backend, cfg = casts.backend, casts.config
        # Grad mode is off inside forward; needs_input_grad says what backward will need when
        # the caller's grad mode was on (``grad``), but is set under torch.no_grad() as well,
        # where no backward comes: no transposed operand is made then.
        need_dgrad = grad and ctx.needs_input_grad[0]
        need_wgrad = grad and ctx.needs_input_grad[1]
        xq = ops.input_operand(x2d, with_transpose=need_wgrad)
        # A prequantized weight's transpose is made in backward from the bytes (re-)gathered
        # then: saving it would pin what FSDP's reshard-after-forward frees.
        direct = ops.is_direct(weight)
        want_t = need_dgrad and not direct
        recompute = want_t and cfg.recompute_weight_cast
        wq = ops.weight_operand(weight, want_t and not recompute, recompute=recompute)
        y = backend.mm(xq.data, wq.data, xq.inv_scale, wq.inv_scale, bias=bias,
                       out_dtype=x2d.dtype, use_fast_accum=cfg.fast_accum_fprop)
        ctx.ops = ops
        ctx.need_wgrad, ctx.need_dgrad = need_wgrad, need_dgrad
        ctx.direct = direct
        # dgrad's W^T is re-cast in backward from the weight with the forward's amax (same
        # bytes, no N*K FP8 bytes held). Decided by the recipe alone, never by the cache's state:
        # activation checkpointing requires the same saved tensors in forward and recomputation.
        # Backward takes a still-valid cached transpose (same bytes).
        ctx.recast = recompute and wq.amax is not None
        w_amax = wq.amax
        if ctx.recast and _compiling():
            # dynamo refuses to save a tensor that aliases another output of the traced forward
            w_amax = w_amax.clone()
        ctx.has_bias = bias is not None
        ctx.x_dtype, ctx.w_dtype = x2d.dtype, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        w_saved = (weight if direct or ctx.recast else wq.data_t) if need_dgrad else None
        ctx.save_for_backward(xq.data_t if need_wgrad else None, xq.inv_scale,
                              w_saved, w_amax if ctx.recast else wq.inv_scale)
        return y

    @staticmethod
    def backward(ctx, dy):
        xq_t, x_inv, wq_t, w_inv = ctx.saved_tensors
        ops = ctx.ops
        if ctx.direct and ctx.need_dgrad:  # the Fp8WeightTensor itself was saved
            wq_t, w_inv = fp8_weight_transpose(wq_t), wq_t.inv_scale
        elif ctx.recast:  # the weight and its amax (in w_inv's slot) were saved
            if _compiling() and dy.numel():
                # AOTAutograd's partitioner moves work that needs no gradient into the forward
                # and saves its result: it would cast W^T there and keep it (the very copy the
                # re-cast avoids). One element of dy, made an exact 0, ties the re-cast to
                # backward; amax + 0 is the same amax, so the same scale and bytes.
                d0 = dy.reshape(-1)[:1].float().nan_to_num(0.0, 0.0, 0.0)
                w_inv = w_inv + (d0 * 0.0).reshape(())
            wq = ops.weight_transpose(wq_t, w_inv)
            wq_t, w_inv = wq.data, wq.inv_scale
        casts = ops.casts
        backend, cfg = casts.backend, casts.config
        dy = dy.contiguous()
        dyq = casts.quantize("grad", dy, cfg.grad_dtype, with_transpose=ctx.need_wgrad)
        dx = dw = db = None
        if ctx.need_dgrad:
            dx = backend.mm(dyq.data, wq_t, dyq.inv_scale, w_inv, out_dtype=ctx.x_dtype,
                            use_fast_accum=cfg.fast_accum_dgrad)
        if ctx.need_wgrad:
            dw = backend.mm(dyq.data_t, xq_t, dyq.inv_scale, x_inv, out_dtype=ctx.w_dtype,
                            use_fast_accum=cfg.fast_accum_wgrad)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = cast_result(dy.float().sum(0), ctx.b_dtype)  # no no-op .to: see cast_result
        return dx, dw, db, None, None

