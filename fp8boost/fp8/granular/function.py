"""The three GEMMs of a linear layer under the rowwise and blockwise recipes.

    fprop  y[M,N]  = x[M,K]  . W[N,K]^T     x: rows/tiles over K     W: rows over K / blocks
    dgrad  dx[M,K] = dy[M,N] . W^T[K,N]^T   dy: rows/tiles over N    W^T: rows over N / blocks^T
    wgrad  dW[N,K] = dy^T[N,M] . x^T[K,M]^T dy^T: rows/tiles over M  x^T: rows/tiles over M

Forward saves FP8 copies only: ``x^T`` quantized along the token axis (when wgrad is needed)
and, with ``recompute_weight_cast=False``, W's dgrad operand; with it True (the default),
the Parameter (kept anyway) is re-quantized in backward, giving the same bytes. The one
exception is ``wgrad_high_precision`` (torchao's ``rowwise_with_gw_hp``): wgrad is the
high-precision product ``dy^T . x`` of the unquantized tensors, so ``x`` itself is saved, as
torchao does. Bias and its gradient stay in high precision; gradients come back in the dtypes
of the inputs they belong to.

Under ``torch.compile`` everything here is plain torch ops around one scaled-mm call per GEMM,
so inductor fuses the quantizers into their producers.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..config import GRANULAR_RECIPES, Fp8Config
from ..prequantized import Fp8WeightTensor
from .gemm import cast_result, granular_mm
from .quantize import GranularFp8, quantize_operands


class RowGroups(NamedTuple):
    """Tensor parallelism under the rowwise recipe: the process group over which each
    operand's rows span shards (None: the rows are whole on this rank).

    Its per-row amaxes are all-reduced there, so each row is scaled as one process scales it.
    A row-parallel layer (K split) sets ``x`` and ``w``; a column-parallel one (N split) sets
    ``dy`` and ``wt``. The wgrad operands are reduced over the token axis, never split by tp.
    """

    x: object = None
    """The input's rows (fprop operand ``x[M, K]``)."""
    w: object = None
    """The weight's rows (fprop operand ``W[N, K]``)."""
    dy: object = None
    """The output gradient's rows (dgrad operand ``dy[M, N]``)."""
    wt: object = None
    """The weight's columns (dgrad operand ``W^T[K, N]``)."""


def quantize_with(x: torch.Tensor, dtype: torch.dtype, cfg: Fp8Config, *, weight: bool,
                  rows: bool, cols: bool, backend=None, rows_group=None, cols_group=None):
    """``x``'s FP8 operands (rows and/or columns) under ``cfg``'s recipe, block, margin and
    scale rounding: the one place a config becomes quantizer arguments (Fp8Linear's granular
    function and the FP8 lm_head both call it).

    Example:
        >>> q, _ = quantize_with(torch.randn(4, 32), torch.float8_e4m3fn,
        ...                      Fp8Config(recipe="rowwise"), weight=False, rows=True, cols=False)
        >>> q.kind
        'row'
    """
    # backend triton/cublas: eager CUDA casts take the Triton kernels (the same bytes).
    return quantize_operands(x, dtype, cfg.recipe, weight=weight, rows=rows, cols=cols,
                             block=cfg.block_size, margin=cfg.margin,
                             power_of_2=cfg.power_of_2_scale, backend=backend,
                             rows_group=rows_group, cols_group=cols_group)


def fast_accum(cfg: Fp8Config, which: str) -> bool:
    """Whether GEMM ``which`` (``fprop``/``dgrad``/``wgrad``) uses fast accumulation."""
    # Blockwise is the promoted-accumulation recipe: never fast accumulation.
    return cfg.recipe == "rowwise" and getattr(cfg, f"fast_accum_{which}")


def _save(q: Optional[GranularFp8]) -> tuple:
    """An operand as two saved tensors (None, None when absent); its kind/block go on ctx."""
    return (None, None) if q is None else (q.data, q.inv_scale)


def _layout(q: Optional[GranularFp8]) -> tuple:
    return (None, 0) if q is None else (q.kind, q.block)


def carrier_operand(weight: Fp8WeightTensor) -> GranularFp8:
    """A block-scaled FP8 weight (e.g. FSDP2's block-scaled all-gather) as the fprop operand:
    its bytes and block scales, no cast (``W^T`` for dgrad is ``.t()`` of it)."""
    n, k = weight.fp8_data.shape
    b = weight.block
    inv = weight.inv_scale[:-(-n // b), :-(-k // b)]
    return GranularFp8(weight.fp8_data.contiguous(), inv.contiguous(), "block", b)


def carrier_mismatch(weight: Fp8WeightTensor, cfg: Fp8Config) -> Optional[str]:
    """Why an FP8 weight carrier cannot be ``cfg``'s weight operand as is (None: it can)."""
    if cfg.recipe != "blockwise" or not weight.block:
        return (f"an FP8 weight with {'block' if weight.block else 'one'} scale(s) is not the "
                f"{cfg.recipe} recipe's weight operand")
    if weight.block != cfg.block_size or weight.fp8_data.dtype != cfg.fwd_dtype:
        return (f"its {weight.block}x{weight.block} {weight.fp8_data.dtype} blocks are not the "
                f"layer's {cfg.block_size}x{cfg.block_size} {cfg.fwd_dtype}")
    return None


def weight_operands(weight: torch.Tensor, cfg: Fp8Config,
                    groups: Optional[RowGroups] = None) -> tuple[GranularFp8, GranularFp8]:
    """Both FP8 operands of ``weight`` (fprop's and dgrad's), as the GEMMs would make them.

    For a caller that keeps them while the weight is unchanged (Fp8Linear's frozen weights):
    passed back as ``granular_linear(..., weight_q=...)`` (with the same ``groups``) they give
    the same bytes as a cast.
    """
    g = groups or RowGroups()
    return quantize_with(weight.detach(), cfg.fwd_dtype, cfg, weight=True, rows=True, cols=True,
                         rows_group=g.w, cols_group=g.wt)


def needs_input_t(cfg: Fp8Config, weight_needs_grad: bool, grad: bool) -> bool:
    """Whether the forward makes the input's ``x^T`` operand: a weight gradient will be
    computed (grad mode on, the weight requires grad) and in FP8 (not ``wgrad_high_precision``).
    The one rule for the function and for a caller that casts the input for it
    (``linear_granular.shared_input_operands``)."""
    return grad and weight_needs_grad and not cfg.wgrad_high_precision


def input_operands(x2d: torch.Tensor, cfg: Fp8Config, *, cols: bool, backend=None,
                   groups: Optional[RowGroups] = None) -> tuple[GranularFp8, Optional[GranularFp8]]:
    """The input's FP8 operands as the forward makes them: ``x`` for fprop and, with ``cols``
    (wgrad in FP8 needed), ``x^T`` for wgrad. For a caller that shares them between layers
    reading one tensor (``granular_linear(..., x_q=...)``: the same bytes as a cast)."""
    return quantize_with(x2d, cfg.fwd_dtype, cfg, weight=False, rows=True, cols=cols,
                         backend=backend, rows_group=(groups or RowGroups()).x)


class GranularLinearFunction(torch.autograd.Function):
    """``apply(x2d, weight, bias, config, backend, weight_q, groups, x_q, grad)``: see
    :func:`granular_linear` (``grad``: the caller's ``torch.is_grad_enabled()``)."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, cfg: Fp8Config, backend, weight_q=None,
                groups: Optional[RowGroups] = None, x_q=None, grad: bool = True):
        g = groups or RowGroups()
        # needs_input_grad is set under torch.no_grad() too, where no backward comes: then no
        # x^T / W^T operand is made.
        need_dgrad = grad and ctx.needs_input_grad[0]
        need_wgrad = grad and ctx.needs_input_grad[1]
        hp_wgrad = need_wgrad and cfg.wgrad_high_precision
        fp8_wgrad = needs_input_t(cfg, ctx.needs_input_grad[1], grad)
        if x_q is not None and (x_q[1] is not None or not fp8_wgrad):  # made by input_operands
            xq, xq_t = x_q[0], x_q[1] if fp8_wgrad else None
        else:
            xq, xq_t = input_operands(x2d, cfg, cols=fp8_wgrad, backend=backend, groups=g)
        keep_wt = need_dgrad and not cfg.recompute_weight_cast
        if weight_q is not None:  # made by weight_operands: the same bytes
            wq, wq_t = weight_q[0], weight_q[1] if keep_wt else None
        elif isinstance(weight, Fp8WeightTensor):  # already blockwise FP8: no cast
            wq = carrier_operand(weight)
            wq_t = wq.t() if keep_wt else None
        else:
            wq, wq_t = quantize_with(weight, cfg.fwd_dtype, cfg, weight=True, rows=True,
                                     cols=keep_wt, backend=backend, rows_group=g.w,
                                     cols_group=g.wt)
        y = granular_mm(xq, wq, backend, bias=bias, out_dtype=x2d.dtype,
                        use_fast_accum=fast_accum(cfg, "fprop"))
        ctx.cfg, ctx.backend, ctx.groups = cfg, backend, g
        ctx.need_dgrad, ctx.need_wgrad, ctx.hp_wgrad = need_dgrad, need_wgrad, hp_wgrad
        ctx.recast = need_dgrad and cfg.recompute_weight_cast
        # A given dgrad operand is used in backward instead of a re-cast (same bytes); what is
        # saved does not depend on it (activation checkpointing compares the saved tensors).
        ctx.weight_t = weight_q[1] if weight_q is not None and ctx.recast else None
        ctx.kinds = (*_layout(xq_t), *_layout(wq_t))
        ctx.x_dtype, ctx.w_dtype = x2d.dtype, weight.dtype
        ctx.has_bias = bias is not None
        ctx.b_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(
            *_save(xq_t), *_save(wq_t),
            x2d if hp_wgrad else None,
            weight if ctx.recast else None)
        return y

    @staticmethod
    def backward(ctx, dy):
        xt_data, xt_inv, wt_data, wt_inv, x_hp, w_param = ctx.saved_tensors
        cfg, backend, g = ctx.cfg, ctx.backend, ctx.groups
        x_kind, x_block, w_kind, w_block = ctx.kinds
        dy = dy.contiguous()
        dyq, dyq_t = quantize_with(dy, cfg.grad_dtype, cfg, weight=False, rows=ctx.need_dgrad,
                                   cols=ctx.need_wgrad and not ctx.hp_wgrad, backend=backend,
                                   rows_group=g.dy)
        dx = dw = db = None
        if ctx.need_dgrad:
            if ctx.weight_t is not None:
                wq_t = ctx.weight_t
            elif ctx.recast and isinstance(w_param, Fp8WeightTensor):  # its own bytes again
                wq_t = carrier_operand(w_param).t()
            elif ctx.recast:  # same bytes as a forward copy: same weight, same deterministic cast
                _, wq_t = quantize_with(w_param, cfg.fwd_dtype, cfg, weight=True, rows=False,
                                        cols=True, backend=backend, cols_group=g.wt)
            else:
                wq_t = GranularFp8(wt_data, wt_inv, w_kind, w_block)
            dx = granular_mm(dyq, wq_t, backend, out_dtype=ctx.x_dtype,
                             use_fast_accum=fast_accum(cfg, "dgrad"))
        if ctx.need_wgrad and ctx.hp_wgrad:
            # torchao's rowwise_with_gw_hp: the unquantized product, in the input's dtype
            # (BF16 in training: a BF16 GEMM with FP32 accumulation).
            dw = cast_result(torch.mm(dy.t(), x_hp.to(dy.dtype)), ctx.w_dtype)
        elif ctx.need_wgrad:
            xq_t = GranularFp8(xt_data, xt_inv, x_kind, x_block)
            dw = granular_mm(dyq_t, xq_t, backend, out_dtype=ctx.w_dtype,
                             use_fast_accum=fast_accum(cfg, "wgrad"))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = cast_result(dy.float().sum(0), ctx.b_dtype)  # no no-op .to: see cast_result
        return dx, dw, db, None, None, None, None, None, None


def granular_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    config: Fp8Config, backend,
                    weight_q: Optional[tuple[GranularFp8, GranularFp8]] = None,
                    groups: Optional[RowGroups] = None,
                    x_q: Optional[tuple[GranularFp8, Optional[GranularFp8]]] = None
                    ) -> torch.Tensor:
    """``x2d @ weight.T + bias`` with FP8 GEMMs under the rowwise or blockwise recipe.

    A pure function of its inputs (no state, no caches; a caller may pass the weight's
    operands it keeps): Fp8Linear calls it from its forward when ``config.recipe`` is
    ``rowwise`` or ``blockwise``.

    Args:
        x2d: input ``[M, K]`` (flatten leading dims first).
        weight: ``[N, K]``; may be frozen (``requires_grad=False``: no wgrad, no x^T cast).
            A block-scaled :class:`~fp8boost.fp8.prequantized.Fp8WeightTensor` of the
            blockwise recipe's format is used as is (its bytes and scales, no cast).
        bias: ``[N]`` or None; added and differentiated in high precision.
        config: an :class:`~fp8boost.fp8.config.Fp8Config` with a granular recipe
            (``fp8_format``, ``power_of_2_scale``, ``margin``, ``block_size``,
            ``wgrad_high_precision``, ``recompute_weight_cast``, ``fast_accum_*``).
        backend: an ``Fp8Backend`` (``get_backend(config.backend, device)``) or its name.
        weight_q: ``weight_operands(weight, config)`` made earlier and kept by the caller
            (valid only while ``weight`` is unchanged): skips the weight's casts.
        groups: under tensor parallelism with the rowwise recipe, the process groups over
            which operands' rows span shards (:class:`RowGroups`); None: no operand does.
        x_q: ``input_operands(x2d, config, ...)`` made earlier (with the same ``backend`` and
            ``groups``) by a caller that shares them between layers reading one tensor: skips
            the input's casts (made here anyway if it lacks the ``x^T`` that wgrad needs).

    Returns:
        ``[M, N]`` in ``x2d.dtype``; gradients come back in the dtypes of x2d, weight, bias.

    Example:
        >>> import torch
        >>> from fp8boost.fp8 import Fp8Config
        >>> cfg = Fp8Config.from_recipe("blockwise", backend="emulated")
        >>> x = torch.randn(8, 256, requires_grad=True)
        >>> w = torch.randn(128, 256, requires_grad=True)
        >>> granular_linear(x, w, None, cfg, "emulated").sum().backward()
        >>> x.grad.shape, w.grad.shape
        (torch.Size([8, 256]), torch.Size([128, 256]))
    """
    if not isinstance(config, Fp8Config):
        raise TypeError(f"config must be an Fp8Config, got {type(config).__name__}")
    if config.recipe not in GRANULAR_RECIPES:
        raise ValueError(f"granular_linear runs the recipes {GRANULAR_RECIPES}, got "
                         f"{config.recipe!r}; tensorwise/delayed run in Fp8Matmul")
    if x2d.dim() != 2 or weight.dim() != 2 or x2d.shape[1] != weight.shape[1]:
        raise ValueError(f"granular_linear needs x2d [M, K] and weight [N, K], got "
                         f"{tuple(x2d.shape)} and {tuple(weight.shape)}; flatten leading dims "
                         "of x with x.reshape(-1, x.shape[-1])")
    if isinstance(weight, Fp8WeightTensor) and carrier_mismatch(weight, config):
        raise ValueError(f"granular_linear: {carrier_mismatch(weight, config)}; dequantize it "
                         "first (weight.dequantize())")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if groups is not None and any(g is not None for g in groups) and config.recipe != "rowwise":
        raise ValueError(f"granular_linear: RowGroups apply to the rowwise recipe only, got "
                         f"{config.recipe!r} (its tiles and blocks are scaled within a shard)")
    return GranularLinearFunction.apply(x2d, weight, bias, config, backend, weight_q, groups,
                                        x_q, torch.is_grad_enabled())
