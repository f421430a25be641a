"""Segmented two-pass casts of the expert operands reduced over rows: ``x^T``/``dy^T`` scaled
per (expert, column) over that expert's token rows, and ``W^T`` per (expert, k) over N.

The bytes and scales of :mod:`.moe_cast`'s tiled kernels (same numerics, same contract), laid
out for speed. Rows come in *segments*: expert ``s``'s rows of a routed token tensor are
``[offsets[s-1], offsets[s])`` (the routing's end offsets, read on the device: no host
sync), the rows past ``offsets[E-1]`` are a tail segment of no expert; the experts operand's
``[E*N, K]`` view has segments of ``SEG = N`` rows. A program owns one column block of one
segment (or of a slice of it, ``SPLIT`` slices when segments are few) and loops down its rows:

* pass 1 keeps the column maxima of ``|x|`` (bit patterns) in registers across the loop and
  writes them with one integer atomic max per column and slice (relaxed: only the values
  matter, and the next kernel sees them all) (the old tiled pass made one
  per 64-row tile: hundreds of atomics on each (expert, column) of a Mixtral ``W^T``), plus,
  with ``ROWS``, each row's partial maximum (one atomic per row and column block);
* pass 2 computes the segment's column scales once, then casts every tile with that one scale
  vector (and the rows operand with the row scales) and stores the transposed bytes.

Rows inside a segment whose ``group`` is not the segment's expert (padding) join no amax and
get zero bytes, as do all tail rows: the contract of :mod:`fp8boost.fp8.moe.quantize`.

Tile shape and programs per SM are timed once per size class on the GPU for operands of at
least :data:`TUNE_MIN_NUMEL` elements (:class:`~fp8boost.fp8.kernels.tuning.ConfigCache`
``"moe-seg-cast"``); repeated launches give the same bytes (integer max is idempotent), so
the timing runs write real outputs.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..scaling import fp8_max
from .cast import abs_bits, fp8_bytes, tl_scale_from_amax
from .granular_cast import FP8_GRID, TL_DTYPES, needs_int64
from .tuning import ConfigCache, bucket, interpreting, num_sms

# (BLOCK_R, BLOCK_C, num_warps, programs per SM aimed at by the row split). The transposed
# store writes BLOCK_R contiguous bytes per column: 64 or 128 bytes.
SEG_CONFIGS = ((64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 4))
# Smaller operands take the first config untimed: each timed config is a Triton compile of
# both kernels (seconds), repaid only where a cast takes a measurable share of a step.
TUNE_MIN_NUMEL = 1 << 24
_INTERP_SEG = (16, 32, 1, 2)
_MAX_SPLIT = 64
_CACHE = ConfigCache("moe-seg-cast")


@triton.jit
def _segment(off_ptr, s, sp, E, R, SEG, SPLIT, GROUPED: tl.constexpr, BLOCK_R: tl.constexpr):
    # Rows [lo, hi) of slice sp of segment s; start is the segment's first row.
    if GROUPED:
        start = tl.load(off_ptr + tl.maximum(s - 1, 0)).to(tl.int32)
        start = tl.where(s > 0, start, 0)
        end = tl.load(off_ptr + tl.minimum(s, E - 1)).to(tl.int32)
        end = tl.where(s < E, end, R)
    else:
        start = s * SEG
        end = start + SEG
    chunk = tl.cdiv(tl.cdiv(end - start, SPLIT), BLOCK_R) * BLOCK_R
    lo = start + sp * chunk
    hi = tl.minimum(end, lo + chunk)
    return start, lo, hi


@triton.jit
def _tile(x_ptr, grp_ptr, r0, hi, offs_c, in_c, s, E, stride_r, stride_c, GROUPED: tl.constexpr,
          IDX64: tl.constexpr, BLOCK_R: tl.constexpr):
    # One [BLOCK_R, BLOCK_C] tile at row r0 (zeros outside), its row offsets and masks, and
    # which rows belong to segment s's expert (all rows of the experts operand).
    offs_r = r0 + tl.arange(0, BLOCK_R)
    if IDX64:
        offs_r = offs_r.to(tl.int64)
    in_r = offs_r < hi
    x = tl.load(x_ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c,
                mask=in_r[:, None] & in_c[None, :], other=0.0)
    if GROUPED:
        g = tl.load(grp_ptr + offs_r, mask=in_r, other=E).to(tl.int32)
        mine = in_r & (g == s) & (s < E)
    else:
        mine = in_r
    return x, offs_r, in_r, mine


@triton.jit
def _seg_amax_kernel(x_ptr, grp_ptr, off_ptr, ramax_ptr, camax_ptr, R, C, stride_r, stride_c,
                     E, SEG, SPLIT, ROWS: tl.constexpr, GROUPED: tl.constexpr,
                     IDX64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    s = tl.program_id(0)
    cb = tl.program_id(1)
    sp = tl.program_id(2)
    _, lo, hi = _segment(off_ptr, s, sp, E, R, SEG, SPLIT, GROUPED, BLOCK_R)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = offs_c < C
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
    for r0 in range(lo, hi, BLOCK_R):
        x, offs_r, in_r, mine = _tile(x_ptr, grp_ptr, r0, hi, offs_c, in_c, s, E, stride_r,
                                      stride_c, GROUPED, IDX64, BLOCK_R)
        bits = abs_bits(x)
        if ROWS:
            tl.atomic_max(ramax_ptr + offs_r, tl.max(bits, axis=1), mask=in_r, sem="relaxed")
        acc = tl.maximum(acc, tl.where(mine[:, None], bits, 0))
    if s < E:
        tl.atomic_max(camax_ptr + s * C + offs_c, tl.max(acc, axis=0), mask=in_c,
                      sem="relaxed")


@triton.jit
def _seg_cast_kernel(x_ptr, grp_ptr, off_ptr, ramax_ptr, camax_ptr, q_ptr, inv_ptr, qt_ptr,
                     invt_ptr, R, C, stride_r, stride_c, E, SEG, SPLIT, OUT_G, OUT_C, fmax,
                     target, ROWS: tl.constexpr, GROUPED: tl.constexpr, POW2: tl.constexpr,
                     T_RELOAD: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
                     MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, IDX64: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # Element (r, c) of segment s goes to qt[s*OUT_G + c*OUT_C + r - start]: [C, R] for the
    # token groups (OUT_G = 0, OUT_C = R, start added back), [E, K, N] for the experts.
    s = tl.program_id(0)
    cb = tl.program_id(1)
    sp = tl.program_id(2)
    start, lo, hi = _segment(off_ptr, s, sp, E, R, SEG, SPLIT, GROUPED, BLOCK_R)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = offs_c < C
    if IDX64:
        offs_c = offs_c.to(tl.int64)
    a = tl.load(camax_ptr + tl.minimum(s, E - 1) * C + offs_c, mask=in_c, other=0)
    s_c = tl_scale_from_amax(a.to(tl.float32, bitcast=True), target, POW2)
    if (s < E) & (sp == 0):
        tl.store(invt_ptr + s * C + offs_c, tl.math.div_rn(1.0, s_c), mask=in_c)
    if GROUPED:
        base = 0
    else:
        base = s * OUT_G - start
    for r0 in range(lo, hi, BLOCK_R):
        x, offs_r, in_r, mine = _tile(x_ptr, grp_ptr, r0, hi, offs_c, in_c, s, E, stride_r,
                                      stride_c, GROUPED, IDX64, BLOCK_R)
        x = x.to(tl.float32)
        if ROWS:
            ra = tl.load(ramax_ptr + offs_r, mask=in_r, other=0)
            s_r = tl_scale_from_amax(ra.to(tl.float32, bitcast=True), target, POW2)
            q = fp8_bytes(x, s_r[:, None], fmax, OUT_DTYPE, EMULATE, MANT_BITS, MIN_EXP)
            tl.store(q_ptr + offs_r[:, None] * C + offs_c[None, :], q,
                     mask=in_r[:, None] & in_c[None, :])
            if cb == 0:
                tl.store(inv_ptr + offs_r, tl.math.div_rn(1.0, s_r), mask=in_r)
        row_out = offs_r + base
        mask_t = in_c[:, None] & in_r[None, :]
        if T_RELOAD:  # float32: no register transpose (see moe_cast's docstring)
            xt = tl.load(x_ptr + offs_c[:, None] * stride_c + offs_r[None, :] * stride_r,
                         mask=mask_t, other=0.0).to(tl.float32)
            qt = fp8_bytes(xt, s_c[:, None], fmax, OUT_DTYPE, EMULATE, MANT_BITS, MIN_EXP)
            qt = tl.where(mine[None, :], qt, tl.zeros_like(qt))
        else:
            q = fp8_bytes(x, s_c[None, :], fmax, OUT_DTYPE, EMULATE, MANT_BITS, MIN_EXP)
            qt = tl.trans(tl.where(mine[:, None], q, tl.zeros_like(q)))
        tl.store(qt_ptr + offs_c[:, None] * OUT_C + row_out[None, :], qt, mask=mask_t)


def two_pass_buffers(x2: torch.Tensor, num_groups: int, out_shape, dtype: torch.dtype,
                     rows: bool):
    """The outputs and zeroed amax tables of a two-pass expert cast of ``x2 [R, C]`` (this
    module's and :mod:`.moe_cast`'s tiled one): ``(dummy, ramax [R] or dummy, camax [G, C],
    data [R, C] or None, inv [R] or dummy, data_t out_shape, inv_t [G, C])``."""
    r, c = x2.shape
    dev = x2.device
    dummy = torch.empty(1, dtype=torch.int32, device=dev)
    ramax = torch.zeros(r, dtype=torch.int32, device=dev) if rows else dummy
    camax = torch.zeros(num_groups, c, dtype=torch.int32, device=dev)
    data = torch.empty((r, c), dtype=dtype, device=dev) if rows else None
    inv = torch.empty(r, dtype=torch.float32, device=dev) if rows else dummy
    data_t = torch.empty(out_shape, dtype=dtype, device=dev)
    inv_t = torch.empty(num_groups, c, dtype=torch.float32, device=dev)
    return dummy, ramax, camax, data, inv, data_t, inv_t


def two_pass(x2: torch.Tensor, group: Optional[torch.Tensor], offsets: Optional[torch.Tensor],
             num_segments: int, seg: int, out_shape, out_g: int, out_c: int,
             dtype: torch.dtype, rows: bool, margin: int, power_of_2: bool):
    """Both segmented passes on ``x2 [R, C]``.

    ``group`` and ``offsets`` given: token segments (``num_segments`` experts and a tail);
    both None: ``num_segments`` segments of ``seg`` rows. Returns
    ``((data [R, C], inv [R]) or None, data_t out_shape, inv_t [num_segments, C])``.
    """
    r, c = x2.shape
    dev = x2.device
    grouped = group is not None
    dummy, ramax, camax, data, inv, data_t, inv_t = two_pass_buffers(x2, num_segments, out_shape,
                                                                     dtype, rows)
    fmax = fp8_max(dtype)
    mant, min_exp = FP8_GRID[dtype]
    idx64 = needs_int64(x2) or data_t.numel() >= 2**31
    n_seg = num_segments + 1 if grouped else num_segments
    sms = num_sms(dev)
    grp = group if grouped else dummy
    off = offsets if grouped else dummy
    common = dict(ROWS=bool(rows), GROUPED=grouped, IDX64=idx64)

    def run(cfg):
        br, bc, warps, per_sm = cfg
        n_c = triton.cdiv(c, bc)
        split = max(1, min(_MAX_SPLIT, triton.cdiv(per_sm * sms, n_seg * n_c)))
        grid = (n_seg, n_c, split)
        # The amax tables start at zero once: a timing re-run maxes the same values again.
        _seg_amax_kernel[grid](x2, grp, off, ramax, camax, r, c, x2.stride(0), x2.stride(1),
                               num_segments, seg, split, BLOCK_R=br, BLOCK_C=bc,
                               num_warps=warps, **common)
        _seg_cast_kernel[grid](
            x2, grp, off, ramax, camax, data.view(torch.uint8) if rows else dummy, inv,
            data_t.view(torch.uint8), inv_t, r, c, x2.stride(0), x2.stride(1), num_segments,
            seg, split, out_g, out_c, fmax, fmax / (2.0 ** margin), POW2=bool(power_of_2),
            T_RELOAD=x2.dtype == torch.float32, OUT_DTYPE=TL_DTYPES[dtype],
            EMULATE=interpreting(), MANT_BITS=mant, MIN_EXP=min_exp, BLOCK_R=br, BLOCK_C=bc,
            num_warps=warps, **common)

    if interpreting():
        cfg = _INTERP_SEG
    else:
        key = (bucket(r), bucket(c), bucket(num_segments), x2.dtype, bool(rows), grouped,
               dev.index)
        cfg = _CACHE.pick(key, SEG_CONFIGS, run, bench=r * c >= TUNE_MIN_NUMEL)
    run(cfg)
    return ((data, inv) if rows else None), data_t, inv_t
