"""Triton casts of the grouped expert GEMMs' operands: the contract of
:mod:`fp8boost.fp8.moe.quantize`, bit for bit, in fewer reads of each tensor.

Numerics are those of :mod:`fp8boost.fp8.kernels.granular_cast` (integer maxima over the bit
patterns of ``|x|``, :func:`~fp8boost.fp8.kernels.cast.tl_scale_from_amax`, a saturating
round-to-nearest-even cast, ``inv_scale`` the IEEE reciprocal of the scale), so NaN/Inf poison
exactly the scales the torch reference poisons.

==================================  =====  =====================================================
operand                             reads  how
==================================  =====  =====================================================
tokens ``[rows, K]``, per row       1      ``granular_cast``'s rowwise rows kernel: one program
                                           per row block, sweeping K twice (the second sweep
                                           re-reads the block from L2)
experts ``[E, N, K]``, per (e, n)   1      the same kernel on the ``[E*N, K]`` view
experts ``W^T [E, K, N]``, (e, k)   2      alone: :mod:`.moe_weight_cast` (column maxima, then
                                           a tiled transposed cast); with the rows operand:
                                           :mod:`.moe_seg_cast`, one program per (expert,
                                           column block) looping down the expert's N rows
groups ``x^T [C, rows]``, (e, c)    2      with the routing's ``offsets``: :mod:`.moe_seg_cast`;
                                           without: the tiled two passes below
``+ rows`` operand of the same x    2      both operands from the same two passes
==================================  =====  =====================================================

The tiled kernels (groups without offsets, any row order): each takes a row-block x
column-block tile; a tile's rows may belong to several experts (or none), so each tile loops
over the experts its rows hold (``min .. max`` of their groups): once or twice for sorted rows,
more for unsorted ones (still correct). Atomics on integer bit patterns are order-independent,
so the result is deterministic. Rows of no group (``group == E``: padding and tail rows) join
no amax and get zero bytes, whatever they hold. Every expert's ``inv_scale`` is written, an
expert with no rows getting 1 (amax 0), as in the reference.

A float32 input re-reads its tile in transposed order for the transposed bytes (as
``granular_cast`` does; Triton 3.6 miscompiled that register transpose); 16-bit inputs
transpose the FP8 bytes in registers.

Inputs the kernels do not take (see :func:`supports`) are the caller's to cast with the torch
reference.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..scaling import FP8_DTYPES, fp8_max
from .cast import fp8_bytes, tile_offsets, tl_scale_from_amax
from .granular_cast import (FP8_GRID, HIGH_PRECISION, MAX_POW2_MARGIN, TL_DTYPES,
                            amax_pass_tile, needs_int64)
from .granular_cast import quantize_operands as granular_operands
from . import moe_weight_cast
from .moe_seg_cast import two_pass as seg_two_pass
from .moe_seg_cast import two_pass_buffers
from .tuning import interpreting

# (BLOCK_R, BLOCK_C, num_warps) of the grouped two-pass kernels on the GPU / the interpreter.
GROUPED_TILE = (64, 128, 8)
_INTERP_TILE = (32, 64, 1)


@triton.jit
def _row_groups(grp_ptr, offs_r, in_r, E):
    # Each row's expert as int32, E for rows of no group (and rows past R). A group id outside
    # [0, E) counts as "no group": it must never address the amax table out of bounds.
    g = tl.load(grp_ptr + offs_r, mask=in_r, other=E).to(tl.int32)
    return tl.where((g >= 0) & (g < E), g, E)


@triton.jit
def _group_amax_kernel(x_ptr, grp_ptr, ramax_ptr, camax_ptr, R, C, stride_r, stride_c, E,
                       ROWS: tl.constexpr, IDX64: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # Pass 1: row amaxes (ROWS) and per-(expert, column) amaxes of this tile, by atomic max
    # on |x| bit patterns into zeroed int32 tables.
    offs_r, offs_c, in_r, in_c, bits = amax_pass_tile(x_ptr, ramax_ptr, R, C, stride_r,
                                                      stride_c, ROWS, IDX64, BLOCK_R, BLOCK_C)
    g = _row_groups(grp_ptr, offs_r, in_r, E)
    g_lo = tl.min(g, axis=0)
    g_hi = tl.max(tl.where(g < E, g, -1), axis=0)
    for e in range(g_lo, g_hi + 1):  # sorted rows: one or two experts per tile
        ca = tl.max(tl.where((g == e)[:, None], bits, 0), axis=0)
        tl.atomic_max(camax_ptr + e * C + offs_c, ca, mask=in_c)


@triton.jit
def _group_scales(camax_ptr, g, g_lo, g_hi, offs_c, in_c, C, target, POW2: tl.constexpr,
                  TRANSPOSED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # The scale of every element of the tile (0 for rows of no group), [BLOCK_R, BLOCK_C], or
    # built directly as [BLOCK_C, BLOCK_R] when TRANSPOSED (no float register transpose).
    if TRANSPOSED:
        s = tl.zeros([BLOCK_C, BLOCK_R], dtype=tl.float32)
    else:
        s = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for e in range(g_lo, g_hi + 1):
        a = tl.load(camax_ptr + e * C + offs_c, mask=in_c, other=0)
        s_e = tl_scale_from_amax(a.to(tl.float32, bitcast=True), target, POW2)
        if TRANSPOSED:
            s = tl.where((g == e)[None, :], s_e[:, None], s)
        else:
            s = tl.where((g == e)[:, None], s_e[None, :], s)
    return s


@triton.jit
def _group_cast_kernel(x_ptr, grp_ptr, ramax_ptr, camax_ptr, q_ptr, inv_ptr, qt_ptr, invt_ptr,
                       R, C, stride_r, stride_c, E, n_tr, fmax, target,
                       ROWS: tl.constexpr, POW2: tl.constexpr,
                       T_RELOAD: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
                       MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, IDX64: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # Pass 2: the rows operand (ROWS) and the transposed per-(expert, column) operand
    # qt [C, R].
    tr = tl.program_id(0)
    tc = tl.program_id(1)
    offs_r, offs_c = tile_offsets(tr, tc, R, C, BLOCK_R, BLOCK_C, IDX64)
    in_r = offs_r < R
    in_c = offs_c < C
    mask = in_r[:, None] & in_c[None, :]
    x = tl.load(x_ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, mask=mask,
                other=0.0).to(tl.float32)
    if ROWS:
        ra = tl.load(ramax_ptr + offs_r, mask=in_r, other=0)
        s_r = tl_scale_from_amax(ra.to(tl.float32, bitcast=True), target, POW2)
        q = fp8_bytes(x, s_r[:, None], fmax, OUT_DTYPE, EMULATE, MANT_BITS, MIN_EXP)
        tl.store(q_ptr + offs_r[:, None] * C + offs_c[None, :], q, mask=mask)
        if tc == 0:
            tl.store(inv_ptr + offs_r, tl.math.div_rn(1.0, s_r), mask=in_r)
    g = _row_groups(grp_ptr, offs_r, in_r, E)
    g_lo = tl.min(g, axis=0)
    g_hi = tl.max(tl.where(g < E, g, -1), axis=0)
    mask_t = in_c[:, None] & in_r[None, :]
    if T_RELOAD:  # float32: see the module docstring
        xt = tl.load(x_ptr + offs_c[:, None] * stride_c + offs_r[None, :] * stride_r,
                     mask=mask_t, other=0.0).to(tl.float32)
        s_t = _group_scales(camax_ptr, g, g_lo, g_hi, offs_c, in_c, C, target, POW2, True,
                            BLOCK_R, BLOCK_C)
        qt = fp8_bytes(xt, s_t, fmax, OUT_DTYPE, EMULATE, MANT_BITS, MIN_EXP)
        qt = tl.where((g < E)[None, :], qt, tl.zeros_like(qt))
    else:
        s = _group_scales(camax_ptr, g, g_lo, g_hi, offs_c, in_c, C, target, POW2, False,
                          BLOCK_R, BLOCK_C)
        q = fp8_bytes(x, s, fmax, OUT_DTYPE, EMULATE, MANT_BITS, MIN_EXP)
        qt = tl.trans(tl.where((g < E)[:, None], q, tl.zeros_like(q)))
    tl.store(qt_ptr + offs_c[:, None] * R + offs_r[None, :], qt, mask=mask_t)
    # Every expert's inverse scales, experts with no rows included: rows tr, tr + n_tr, ...
    for e in range(tr, E, n_tr):
        a = tl.load(camax_ptr + e * C + offs_c, mask=in_c, other=0)
        s_e = tl_scale_from_amax(a.to(tl.float32, bitcast=True), target, POW2)
        tl.store(invt_ptr + e * C + offs_c, tl.math.div_rn(1.0, s_e), mask=in_c)


def supports(x: torch.Tensor, dtype: torch.dtype, *, margin: int = 0, power_of_2: bool = False,
             group: Optional[torch.Tensor] = None) -> bool:
    """Whether these kernels take ``x`` (else the caller uses the torch reference).

    ``x``: a token tensor ``[rows, K]`` or expert weights ``[E, N, K]``; float32, bfloat16 or
    float16, not empty, on CUDA (or under the Triton interpreter). ``group``: for the token
    groups, a 1-D integer tensor of ``rows`` entries on ``x``'s device. Power-of-2 scales with
    ``margin > 6`` are refused, as in ``granular_cast`` (a subnormal scale would round
    differently from ``frexp``).

    Example:
        >>> supports(torch.randn(0, 8), torch.float8_e4m3fn)
        False
    """
    if not torch.is_tensor(x) or x.dim() not in (2, 3) or x.numel() == 0:
        return False
    if x.dtype not in HIGH_PRECISION or dtype not in FP8_DTYPES:
        return False
    if x.device.type != "cuda" and not interpreting():
        return False
    if group is not None:
        if (x.dim() != 2 or group.dim() != 1 or group.shape[0] != x.shape[0]
                or group.dtype.is_floating_point or group.dtype == torch.bool
                or group.device != x.device):
            return False
    return not (power_of_2 and margin > MAX_POW2_MARGIN)


def why_unsupported(x: torch.Tensor, dtype: torch.dtype, **kw) -> str:
    """A short description of inputs :func:`supports` refuses (for the caller's log line)."""
    shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
    dt = x.dtype if torch.is_tensor(x) else None
    return f"x {shape} {dt} -> {dtype}, {kw}"


def _check(ok: bool, x, dtype, **kw) -> None:
    if not ok:
        raise ValueError(f"moe_cast cannot take {why_unsupported(x, dtype, **kw)}; use the "
                         "torch reference (fp8boost.fp8.moe.quantize)")


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, *, margin: int = 0,
                  power_of_2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row of ``x [R, C]`` (``granular_cast``'s rowwise rows kernel).

    Returns:
        ``(data [R, C] FP8, inv_scale [R] FP32)``.
    """
    _check(supports(x, dtype, margin=margin, power_of_2=power_of_2) and x.dim() == 2, x, dtype)
    q, _ = granular_operands(x, dtype, "rowwise", weight=False, rows=True, cols=False,
                              margin=margin, power_of_2=power_of_2)
    return q.data, q.inv_scale.view(-1)


def _two_pass(x2, group, num_groups, dtype, rows, margin, power_of_2):
    """Both tiled kernels on ``x2 [R, C]``: ``(data, inv) or None, data_t [C, R], inv_t [E, C]``."""
    r, c = x2.shape
    br, bc, warps = _INTERP_TILE if interpreting() else GROUPED_TILE
    grid = (triton.cdiv(r, br), triton.cdiv(c, bc))
    dummy, ramax, camax, data, inv, data_t, inv_t = two_pass_buffers(x2, num_groups, (c, r),
                                                                     dtype, rows)
    idx64 = needs_int64(x2)
    _group_amax_kernel[grid](x2, group, ramax, camax, r, c, x2.stride(0), x2.stride(1),
                             num_groups, ROWS=bool(rows), IDX64=idx64, BLOCK_R=br, BLOCK_C=bc,
                             num_warps=warps)
    fmax = fp8_max(dtype)
    mant, min_exp = FP8_GRID[dtype]
    _group_cast_kernel[grid](
        x2, group, ramax, camax, data.view(torch.uint8) if rows else dummy, inv,
        data_t.view(torch.uint8), inv_t, r, c, x2.stride(0), x2.stride(1), num_groups, grid[0],
        fmax, fmax / (2.0 ** margin), ROWS=bool(rows), POW2=bool(power_of_2),
        T_RELOAD=x2.dtype == torch.float32, OUT_DTYPE=TL_DTYPES[dtype], EMULATE=interpreting(),
        MANT_BITS=mant, MIN_EXP=min_exp, IDX64=idx64, BLOCK_R=br, BLOCK_C=bc, num_warps=warps)
    return ((data, inv) if rows else None), data_t, inv_t


def quantize_experts(w: torch.Tensor, dtype: torch.dtype, *, rows: bool = True,
                     cols: bool = False, margin: int = 0, power_of_2: bool = False
                     ) -> tuple[Optional[tuple], Optional[tuple]]:
    """Expert weights ``w [E, N, K]``: the operand scaled per (e, n) over K (``rows``) and/or
    ``w^T [E, K, N]`` scaled per (e, k) over N (``cols``); both from one pair of passes.

    Returns:
        ``((data [E, N, K], inv [E, N]) or None, (data_t [E, K, N], inv_t [E, K]) or None)``.

    Example:
        >>> w = torch.randn(4, 32, 16, device="cuda", dtype=torch.bfloat16)
        >>> _, (dt, it) = quantize_experts(w, torch.float8_e4m3fn, rows=False, cols=True)
        >>> tuple(dt.shape), tuple(it.shape)
        ((4, 16, 32), (4, 16))
    """
    kw = dict(margin=margin, power_of_2=power_of_2)
    _check(supports(w, dtype, **kw) and w.dim() == 3, w, dtype, **kw)
    e, n, k = w.shape
    w2 = w.detach().reshape(e * n, k)
    if not cols:
        if not rows:
            return None, None
        data, inv = quantize_rows(w2, dtype, **kw)
        return (data.view(e, n, k), inv.view(e, n)), None
    if not rows and w.is_contiguous():  # W^T alone (dgrad): column maxima, then one cast pass
        return None, moe_weight_cast.transposed(w, dtype, **kw)
    rq, data_t, inv_t = seg_two_pass(w2, None, None, e, n, (e, k, n), k * n, n, dtype, rows,
                                     **kw)
    if rq is not None:
        rq = (rq[0].view(e, n, k), rq[1].view(e, n))
    return rq, (data_t, inv_t)


def quantize_groups_t(x: torch.Tensor, group: torch.Tensor, num_experts: int,
                      dtype: torch.dtype, *, rows: bool = False, margin: int = 0,
                      power_of_2: bool = False, offsets: Optional[torch.Tensor] = None
                      ) -> tuple[Optional[tuple], tuple]:
    """``x [R, C]`` scaled per (expert group, column) over that expert's rows, emitted
    transposed ``[C, R]``; with ``rows``, also the per-row operand of the same ``x``.

    Args:
        x: tokens by features, rows sorted by expert (any order stays correct, see above).
        group: ``[R]`` integer expert of each row; ``num_experts`` (or anything outside
            ``[0, num_experts)``) for rows of no group, which get zero bytes.
        num_experts: E (>= 1).
        dtype: FP8 dtype.
        rows: also return ``(data [R, C], inv [R])`` scaled per row (every row, as
            :func:`quantize_rows`).
        offsets: the routing's ``[E]`` int32 end offsets (rows of expert e in
            ``[offsets[e-1], offsets[e])``, padding rows there of group E, rows past the last
            offset a tail of no group): the segmented kernels of :mod:`.moe_seg_cast`, one
            program per (expert, column block) looping down the expert's rows. Without it,
            the tiled kernels above (any row order).

    Returns:
        ``((data, inv) or None, (data_t [C, R], inv_t [E, C]))``.
    """
    kw = dict(margin=margin, power_of_2=power_of_2)
    _check(supports(x, dtype, group=group, **kw) and x.dim() == 2 and num_experts >= 1, x,
           dtype, **kw)
    r, c = x.shape
    if offsets is not None:
        if (offsets.dim() != 1 or offsets.shape[0] != num_experts or offsets.device != x.device
                or offsets.dtype.is_floating_point):
            raise ValueError(f"offsets must be the routing's [{num_experts}] integer end offsets "
                             f"on {x.device}, got {tuple(offsets.shape)} {offsets.dtype} on "
                             f"{offsets.device}")
        rq, data_t, inv_t = seg_two_pass(x.detach(), group, offsets, num_experts, 0, (c, r), 0,
                                         r, dtype, rows, **kw)
        return rq, (data_t, inv_t)
    rq, data_t, inv_t = _two_pass(x.detach(), group, num_experts, dtype, rows, **kw)
    return rq, (data_t, inv_t)
