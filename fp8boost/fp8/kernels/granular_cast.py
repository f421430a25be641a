"""Triton casts for the rowwise and blockwise recipes: the contract of
:func:`fp8boost.fp8.granular.quantize.quantize_operands`, bit for bit, in fewer reads of ``x``.

Numerics are those of ``fp8boost.fp8.kernels.cast`` (see its docstring): amaxes are integer
maxima over the bit patterns of ``|x|`` in FP32 (exact, NaN-propagating),
:func:`~fp8boost.fp8.kernels.cast.tl_scale_from_amax` mirrors ``scaling.scale_from_amax``
operation by operation (``fmax / amax`` evaluated as torch does: an IEEE reciprocal, then a
rounded multiply), the cast is ``x.float() * scale`` clamped to +-fp8_max (NaN passes) with
round-to-nearest-even, and ``inv_scale`` is the IEEE reciprocal of the scale. Masked loads fill
with zeros, which is what the reference's zero padding does to a partial tile's amax.

Reads of ``x`` (DRAM; a re-read of a tile the same program just loaded is L1/L2-hot):

==========================  =====  ==============================================================
layout                      reads  how (the candidates, timed per size class: granular_configs)
==========================  =====  ==============================================================
blockwise tiles (+ ^T)      1-2    one program per ``b x b`` tile: its ``b`` row amaxes and ``b``
                                   column amaxes, the row-tiled bytes and the transposed
                                   column-tiled bytes, both sets of scales; or ("split") the
                                   row tiles, then the column tiles of data^T (two reads, two
                                   simpler kernels; the faster one on an H200); without ^T,
                                   ``BLOCK_R x b`` a program ("rows")
blockwise weight (+ ^T)     1      one program per ``b x b`` block: one amax, data, data^T
rowwise rows only           1-2    one program per row block: the whole rows in registers (C up
                                   to 16384), or looping over C twice (amax, then cast; the
                                   second sweep re-reads the block, mostly from L2), or for wider
                                   rows an amax pass and a cast pass over tiles ("tiles")
rowwise cols (+ rows)       2      amax pass (row and column amaxes at once, integer atomic max),
                                   then one cast pass writing data and data^T; or ("colmax") the
                                   rows cast taking column amaxes (granular_colmax), then data^T
==========================  =====  ==============================================================

The picks are timed by GPU time alone (``ConfigCache(device_time=True)``): the split and colmax
candidates make more launches, whose host cost a training step hides behind the GPU's work.

A float32 input re-reads its tile in transposed order for the transposed copy (as
``kernels.cast`` does, ``T_RELOAD``: Triton 3.6 miscompiled the register transpose of that case);
the re-read hits L1/L2, not DRAM.

Inputs the kernels do not take (not 2-D, not float32/bfloat16/float16, empty, a block that is
not a power of two in [16, 128], power-of-2 scales with ``margin > 6``, where the scale can be
subnormal and the exponent-bit rounding would differ from ``frexp``) are answered by
:func:`supports` as False; the caller then uses the torch reference.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Optional

import torch
import triton
import triton.language as tl

from ..granular.operand import GranularFp8
from ..scaling import FP8_DTYPES, fp8_max
from .cast import abs_bits, fp8_bytes, tile_offsets, tl_scale_from_amax
from .granular_configs import ROWS_TUNE_MIN_NUMEL, rows_cols_configs, rows_configs, tile_configs
from .granular_colmax import rows_colmax_kernel
from .tuning import ConfigCache, bucket, interpreting, num_sms

HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
TL_DTYPES = MappingProxyType({torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5})
# (mantissa bits, smallest normal exponent) for the interpreter's grid rounding.
FP8_GRID = MappingProxyType({torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)})
# Power-of-2 scales with a larger margin can be subnormal (fp8_max / 2**7 / FP32 max < 2**-126).
MAX_POW2_MARGIN = 6
_ROWS_CACHE = ConfigCache("rows-cast-gpu", device_time=True)
_RC_CACHE = ConfigCache("rows-cols-cast-gpu", device_time=True)
_TILE_CACHE = ConfigCache("tile-cast-gpu", device_time=True)
_INTERP_TILE = (32, 64, 1)


@triton.jit
def _tile_cast_kernel(x_ptr, q_ptr, inv_ptr, qt_ptr, invt_ptr, ramax_ptr, camax_ptr,
                      R, C, stride_r, stride_c, n_tr, n_tc, fmax, target,
                      MODE: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                      POW2: tl.constexpr, T_RELOAD: tl.constexpr, OUT_DTYPE: tl.constexpr,
                      EMULATE: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                      IDX64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # MODE 0: blockwise 1 x b tiles (rows) and b x 1 tiles (cols), amaxes from this tile.
    # MODE 1: blockwise weight, one amax per b x b tile. MODE 2: rowwise, amaxes given.
    tr = tl.program_id(0)
    tc = tl.program_id(1)
    offs_r, offs_c = tile_offsets(tr, tc, R, C, BLOCK_R, BLOCK_C, IDX64)
    in_r = offs_r < R
    in_c = offs_c < C
    mask = in_r[:, None] & in_c[None, :]
    x = tl.load(x_ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, mask=mask,
                other=0.0).to(tl.float32)
    if MODE == 1:
        s = tl_scale_from_amax(tl.max(tl.max(abs_bits(x), axis=1), axis=0).to(
            tl.float32, bitcast=True), target, POW2)
        inv = tl.math.div_rn(1.0, s)
        q = fp8_bytes(x, s, fmax, OUT_DTYPE, EMULATE, MANT_BITS, MIN_EXP)
        tl.store(q_ptr + offs_r[:, None] * C + offs_c[None, :], q, mask=mask)
        tl.store(inv_ptr + tr * n_tc + tc, inv)
        if COLS:
            mask_t = in_c[:, None] & in_r[None, :]
            if T_RELOAD:  # see the module docstring
                xt = tl.load(x_ptr + offs_c[:, None] * stride_c + offs_r[None, :] * stride_r,
                             mask=mask_t, other=0.0).to(tl.float32)
                qt = fp8_bytes(xt, s, fmax, OUT_DTYPE, EMULATE, MANT_BITS, MIN_EXP)
            else:
                qt = tl.trans(q)
            tl.store(qt_ptr + offs_c[:, None] * R + offs_r[None, :], qt, mask=mask_t)
            tl.store(invt_ptr + tc * n_tr + tr, inv)
    else:
        if ROWS:
            if MODE == 0:
                ra = tl.max(abs_bits(x), axis=1)
            else:
                ra = tl.load(ramax_ptr + offs_r, mask=in_r, other=0)
            s_r = tl_scale_from_amax(ra.to(tl.float32, bitcast=True), target, POW2)
            q = fp8_bytes(x, s_r[:, None], fmax, OUT_DTYPE, EMULATE, MANT_BITS, MIN_EXP)
            tl.store(q_ptr + offs_r[:, None] * C + offs_c[None, :], q, mask=mask)
            if MODE == 0:
                tl.store(inv_ptr + offs_r * n_tc + tc, tl.math.div_rn(1.0, s_r), mask=in_r)
            elif tc == 0:  # rowwise [R, 1]: the first column of tiles writes it
                tl.store(inv_ptr + offs_r, tl.math.div_rn(1.0, s_r), mask=in_r)
        if COLS:
            if MODE == 0:
                ca = tl.max(abs_bits(x), axis=0)
            else:
                ca = tl.load(camax_ptr + offs_c, mask=in_c, other=0)
            s_c = tl_scale_from_amax(ca.to(tl.float32, bitcast=True), target, POW2)
            mask_t = in_c[:, None] & in_r[None, :]
            if T_RELOAD:
                xt = tl.load(x_ptr + offs_c[:, None] * stride_c + offs_r[None, :] * stride_r,
                             mask=mask_t, other=0.0).to(tl.float32)
                qt = fp8_bytes(xt, s_c[:, None], fmax, OUT_DTYPE, EMULATE, MANT_BITS, MIN_EXP)
            else:
                qt = tl.trans(fp8_bytes(x, s_c[None, :], fmax, OUT_DTYPE, EMULATE, MANT_BITS,
                                         MIN_EXP))
            tl.store(qt_ptr + offs_c[:, None] * R + offs_r[None, :], qt, mask=mask_t)
            if MODE == 0:
                tl.store(invt_ptr + offs_c * n_tr + tr, tl.math.div_rn(1.0, s_c), mask=in_c)
            elif tr == 0:
                tl.store(invt_ptr + offs_c, tl.math.div_rn(1.0, s_c), mask=in_c)


@triton.jit
def amax_pass_tile(x_ptr, ramax_ptr, R, C, stride_r, stride_c, ROWS: tl.constexpr,
                   IDX64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """First pass of a two-pass cast, on this program's tile: load it (zeros outside),
    atomic-max its row amaxes (|x| bit patterns) into ``ramax_ptr`` when ``ROWS``, and return
    ``(offs_r, offs_c, in_r, in_c, bits)`` for the caller's column amaxes."""
    offs_r, offs_c = tile_offsets(tl.program_id(0), tl.program_id(1), R, C, BLOCK_R, BLOCK_C, IDX64)
    in_r = offs_r < R
    in_c = offs_c < C
    x = tl.load(x_ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c,
                mask=in_r[:, None] & in_c[None, :], other=0.0)
    bits = abs_bits(x)
    if ROWS:
        tl.atomic_max(ramax_ptr + offs_r, tl.max(bits, axis=1), mask=in_r)
    return offs_r, offs_c, in_r, in_c, bits


@triton.jit
def _amax_rc_kernel(x_ptr, ramax_ptr, camax_ptr, R, C, stride_r, stride_c,
                    ROWS: tl.constexpr, COLS: tl.constexpr, IDX64: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # Rowwise pass 1: this tile's row and column amaxes (|x| bit patterns) into zeroed int32
    # buffers by integer atomic max (order-independent: the result is deterministic).
    offs_r, offs_c, in_r, in_c, bits = amax_pass_tile(x_ptr, ramax_ptr, R, C, stride_r,
                                                      stride_c, ROWS, IDX64, BLOCK_R, BLOCK_C)
    if COLS:
        tl.atomic_max(camax_ptr + offs_c, tl.max(bits, axis=0), mask=in_c)


@triton.jit
def _rows_kernel(x_ptr, q_ptr, inv_ptr, R, C, stride_r, stride_c, fmax, target,
                 POW2: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
                 MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, IDX64: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ONE_PASS: tl.constexpr):
    # Rowwise rows only: one program per BLOCK_R rows, sweeping C twice (amax, then cast);
    # ONE_PASS (BLOCK_C >= C): the whole rows stay in registers, x is loaded once.
    pid = tl.program_id(0)
    offs_r, offs_c0 = tile_offsets(pid, 0, R, C, BLOCK_R, BLOCK_C, IDX64)
    in_r = offs_r < R
    if ONE_PASS:
        mask1 = in_r[:, None] & (offs_c0[None, :] < C)
        xr = tl.load(x_ptr + offs_r[:, None] * stride_r + offs_c0[None, :] * stride_c,
                     mask=mask1, other=0.0)
        s1 = tl_scale_from_amax(tl.max(abs_bits(xr), axis=1).to(tl.float32, bitcast=True),
                                target, POW2)
        tl.store(inv_ptr + offs_r, tl.math.div_rn(1.0, s1), mask=in_r)
        q1 = fp8_bytes(xr.to(tl.float32), s1[:, None], fmax, OUT_DTYPE, EMULATE, MANT_BITS,
                       MIN_EXP)
        tl.store(q_ptr + offs_r[:, None] * C + offs_c0[None, :], q1, mask=mask1)
    else:  # distinct names: Triton types both branches, and the loops carry theirs
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
        for c0 in range(0, C, BLOCK_C):
            offs_c = c0 + offs_c0
            mask = in_r[:, None] & (offs_c[None, :] < C)
            x = tl.load(x_ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c,
                        mask=mask, other=0.0)
            acc = tl.maximum(acc, abs_bits(x))
        s = tl_scale_from_amax(tl.max(acc, axis=1).to(tl.float32, bitcast=True), target, POW2)
        tl.store(inv_ptr + offs_r, tl.math.div_rn(1.0, s), mask=in_r)
        for c0 in range(0, C, BLOCK_C):
            offs_c = c0 + offs_c0
            mask = in_r[:, None] & (offs_c[None, :] < C)
            x = tl.load(x_ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c,
                        mask=mask, other=0.0).to(tl.float32)
            q = fp8_bytes(x, s[:, None], fmax, OUT_DTYPE, EMULATE, MANT_BITS, MIN_EXP)
            tl.store(q_ptr + offs_r[:, None] * C + offs_c[None, :], q, mask=mask)


def supports(x: torch.Tensor, dtype: torch.dtype, recipe: str, *, block: int = 128,
             margin: int = 0, power_of_2: bool = False) -> bool:
    """Whether :func:`quantize_operands` takes these inputs (else use the torch reference).

    Example:
        >>> supports(torch.randn(0, 8), torch.float8_e4m3fn, "rowwise")
        False
    """
    if not torch.is_tensor(x) or x.dim() != 2 or x.numel() == 0:
        return False
    if x.dtype not in HIGH_PRECISION or dtype not in FP8_DTYPES:
        return False
    if recipe not in ("rowwise", "blockwise"):
        return False
    if recipe == "blockwise" and (block < 16 or block > 128 or block & (block - 1)):
        return False
    if x.device.type != "cuda" and not interpreting():
        return False
    return not (power_of_2 and margin > MAX_POW2_MARGIN)


def needs_int64(x: torch.Tensor) -> bool:
    r, c = x.shape
    span = (r - 1) * abs(x.stride(0)) + (c - 1) * abs(x.stride(1)) + 1
    return max(span, r * c) >= 2**31


def _common(x: torch.Tensor, dtype: torch.dtype, margin: int, power_of_2: bool) -> dict:
    mant, min_exp = FP8_GRID[dtype]
    return dict(POW2=bool(power_of_2), OUT_DTYPE=TL_DTYPES[dtype], EMULATE=interpreting(),
                MANT_BITS=mant, MIN_EXP=min_exp, IDX64=needs_int64(x))


def _outputs(x, dtype, mode, rows, cols, n_tr, n_tc):
    """Empty (data, inv, data_t, inv_t) of a tile-kernel cast (None where not asked) and the
    kernel's pointer arguments for them (uint8 views of the FP8 tensors, a dummy for None)."""
    r, c = x.shape
    dev = x.device
    shapes = {0: ((r, n_tc), (c, n_tr)), 1: ((n_tr, n_tc), (n_tc, n_tr)), 2: ((r, 1), (c, 1))}
    inv_shape, invt_shape = shapes[mode]
    data = torch.empty((r, c), dtype=dtype, device=dev) if rows or mode == 1 else None
    inv = torch.empty(inv_shape, dtype=torch.float32, device=dev) if rows or mode == 1 else None
    data_t = torch.empty((c, r), dtype=dtype, device=dev) if cols else None
    inv_t = torch.empty(invt_shape, dtype=torch.float32, device=dev) if cols else None
    dummy = torch.empty(1, dtype=torch.int32, device=dev)
    ptrs = [dummy if t is None else t.view(torch.uint8) if t.dtype == dtype else t
            for t in (data, inv, data_t, inv_t)]
    return (data, inv, data_t, inv_t), ptrs, dummy


def _launch_tiles(x, dtype, mode, rows, cols, br, bc, warps, kw, ramax=None, camax=None,
                  reload=False):
    """One ``_tile_cast_kernel`` launch; returns (data, inv, data_t, inv_t) (None if not asked).
    ``reload``: data^T from a transposed re-read of the tile (always so for float32 input)."""
    r, c = x.shape
    n_tr, n_tc = triton.cdiv(r, br), triton.cdiv(c, bc)
    outs, ptrs, dummy = _outputs(x, dtype, mode, rows, cols, n_tr, n_tc)
    fmax = fp8_max(dtype)
    _tile_cast_kernel[(n_tr, n_tc)](
        x, *ptrs, ramax if ramax is not None else dummy, camax if camax is not None else dummy,
        r, c, x.stride(0), x.stride(1), n_tr, n_tc, fmax, fmax / (2.0 ** kw["margin"]),
        MODE=mode, ROWS=bool(rows), COLS=bool(cols),
        T_RELOAD=bool(reload) or x.dtype == torch.float32, BLOCK_R=br, BLOCK_C=bc,
        num_warps=warps, **_common(x, dtype, kw["margin"], kw["power_of_2"]))
    return outs


def rows_only(x: torch.Tensor, dtype: torch.dtype, *, margin: int = 0, power_of_2: bool = False,
              config: Optional[tuple] = None) -> GranularFp8:
    """Rowwise rows of ``x`` (one scale per row) by the rows-only kernel: ``config``
    ``(BLOCK_R, BLOCK_C, num_warps)`` or ``("tiles", BLOCK_R, BLOCK_C, num_warps)`` (an amax
    pass and a cast pass over tiles, for wide rows), or None for the one timed once per size
    class (the first candidate of :func:`rows_configs` below ``ROWS_TUNE_MIN_NUMEL`` elements;
    the interpreter's small tile under ``TRITON_INTERPRET=1``). Every config gives the same
    bytes."""
    r, c = x.shape
    dev = x.device
    fmax = fp8_max(dtype)
    common = _common(x, dtype, margin, power_of_2)
    out = []

    def run(cfg):
        if cfg[0] == "tiles":
            out[:] = _two_pass_tiles(x, dtype, True, False, cfg[1:],
                                     {"margin": margin, "power_of_2": power_of_2}, common)[:2]
            return
        br, bc, warps = cfg
        data = torch.empty((r, c), dtype=dtype, device=dev)
        inv = torch.empty((r, 1), dtype=torch.float32, device=dev)
        _rows_kernel[(triton.cdiv(r, br),)](
            x, data.view(torch.uint8), inv, r, c, x.stride(0), x.stride(1), fmax,
            fmax / (2.0 ** margin), BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
            ONE_PASS=bc >= c, **common)
        out[:] = data, inv

    _run_tuned(run, _ROWS_CACHE, (bucket(r), bucket(c), x.dtype, dev.index), rows_configs(c),
               r * c, _INTERP_TILE, config)
    data, inv = out
    return GranularFp8(data, inv, "row")


def _run_tuned(run, cache: ConfigCache, key: tuple, candidates: tuple, numel: int,
               interp_config, config=None) -> None:
    """``run(config)`` with ``config`` if one is given, else with ``interp_config`` under the
    interpreter, else with the config timed once for ``key`` (below ``ROWS_TUNE_MIN_NUMEL``
    elements the first candidate, untimed)."""
    if config is not None:
        run(config)
    elif interpreting():
        run(interp_config)
    else:
        run(cache.pick(key, candidates, run, bench=numel >= ROWS_TUNE_MIN_NUMEL))


def _rows_colmax(x, dtype, rows, cfg, kw, common):
    """A ``("colmax", ...)`` candidate: the rows cast taking column amaxes, then data^T."""
    _, br, warps, per_sm, br2, bc2, warps2 = cfg
    r, c = x.shape
    dev = x.device
    data = torch.empty((r, c), dtype=dtype, device=dev) if rows else None
    inv = torch.empty((r, 1), dtype=torch.float32, device=dev) if rows else None
    n_blocks = triton.cdiv(r, br)
    programs = min(n_blocks, per_sm * num_sms(dev))
    partials = torch.empty((programs, c), dtype=torch.int32, device=dev)
    fmax = fp8_max(dtype)
    rows_colmax_kernel[(programs,)](
        x, data.view(torch.uint8) if rows else partials, inv if rows else partials, partials,
        r, c, x.stride(0), x.stride(1), fmax, fmax / (2.0 ** kw["margin"]), n_blocks,
        ROWS=bool(rows), BLOCK_R=br, BLOCK_C=triton.next_power_of_2(c), num_warps=warps,
        **common)
    camax = partials.amax(dim=0)
    return (data, inv) + _launch_tiles(x, dtype, 2, False, True, br2, bc2, warps2, kw, None,
                                       camax, reload=True)[2:]


def _two_pass_tiles(x, dtype, rows, cols, cfg, kw, common):
    """Rowwise over ``(BLOCK_R, BLOCK_C, num_warps)`` tiles: the amax pass (row and/or column
    amaxes by integer atomic max into zeroed buffers), then the cast pass writing the operands
    asked for; returns (data, inv, data_t, inv_t)."""
    br, bc, warps = cfg
    r, c = x.shape
    ramax = torch.zeros(r, dtype=torch.int32, device=x.device) if rows else None
    camax = torch.zeros(c, dtype=torch.int32, device=x.device) if cols else None
    _amax_rc_kernel[(triton.cdiv(r, br), triton.cdiv(c, bc))](
        x, ramax if rows else camax, camax if cols else ramax, r, c, x.stride(0), x.stride(1),
        ROWS=bool(rows), COLS=bool(cols), IDX64=common["IDX64"], BLOCK_R=br, BLOCK_C=bc,
        num_warps=warps)
    return _launch_tiles(x, dtype, 2, rows, cols, br, bc, warps, kw, ramax, camax)


def _rowwise(x, dtype, rows, cols, kw, config=None):
    r, c = x.shape
    dev = x.device
    common = _common(x, dtype, kw["margin"], kw["power_of_2"])
    if not cols:  # rows only: one launch, one program per row block
        return rows_only(x, dtype, config=config, **kw), None
    out = []

    def run(cfg):
        if cfg[0] == "colmax":
            out[:] = _rows_colmax(x, dtype, rows, cfg, kw, common)
        else:
            out[:] = _two_pass_tiles(x, dtype, rows, True, cfg, kw, common)

    _run_tuned(run, _RC_CACHE, (bucket(r), bucket(c), x.dtype, bool(rows), dev.index),
               rows_cols_configs(c), r * c, _INTERP_TILE, config)
    data, inv, data_t, inv_t = out
    return (GranularFp8(data, inv, "row") if rows else None), GranularFp8(data_t, inv_t, "row")


def _blockwise(x, dtype, weight, rows, cols, block, kw, config=None):
    mode = 1 if weight else 0
    out = []

    def run(cfg):
        if isinstance(cfg, int):
            out[:] = _launch_tiles(x, dtype, mode, rows, cols, block, block, cfg, kw)
        elif cfg[0] == "split":  # ("split", BLOCK_R, num_warps, BLOCK_C2, num_warps2, reload)
            _, br, warps, bc2, warps2, reload = cfg
            data, inv = _launch_tiles(x, dtype, 0, True, False, br, block, warps, kw)[:2] \
                if rows else (None, None)
            out[:] = (data, inv) + _launch_tiles(x, dtype, 0, False, True, block, bc2, warps2,
                                                 kw, reload=reload)[2:]
        else:  # ("rows", BLOCK_R, num_warps): 1 x block tiles, BLOCK_R rows a program
            out[:] = _launch_tiles(x, dtype, 0, True, False, cfg[1], block, cfg[2], kw)

    key = (bucket(x.shape[0]), bucket(x.shape[1]), x.dtype, mode, bool(rows), bool(cols), block,
           x.device.index)
    _run_tuned(run, _TILE_CACHE, key, tile_configs(block, weight, rows, cols), x.numel(), 1,
               config)
    return tuple(out)


def quantize_operands(x: torch.Tensor, dtype: torch.dtype, recipe: str, *, weight: bool,
                      rows: bool = True, cols: bool = False, block: int = 128, margin: int = 0,
                      power_of_2: bool = False, config=None
                      ) -> tuple[Optional[GranularFp8], Optional[GranularFp8]]:
    """:func:`fp8boost.fp8.granular.quantize.quantize_operands` in Triton: the same bytes.

    Args:
        x: 2-D float32/bfloat16/float16 CUDA tensor ``[R, C]`` (any strides); check
            :func:`supports` first.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        recipe: ``"rowwise"`` or ``"blockwise"``.
        weight: blockwise only: ``block x block`` blocks (else 1 x ``block`` tiles).
        rows: make the operand reduced over C (``x`` itself).
        cols: make the operand reduced over R (``x^T``).
        block: tile length / block side (blockwise).
        margin: scales target ``fp8_max / 2**margin``.
        power_of_2: round scales down to powers of two.
        config: None (the candidate timed fastest for this size class), or one candidate to
            run: of :func:`rows_configs` (rowwise rows only), :func:`rows_cols_configs`
            (rowwise with ``cols``) or :func:`tile_configs` (blockwise). Every candidate gives
            the same bytes.

    Returns:
        ``(rows_operand or None, cols_operand or None)``.

    Example:
        >>> x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
        >>> xq, xq_t = quantize_operands(x, torch.float8_e4m3fn, "blockwise", weight=False,
        ...                              cols=True)
        >>> tuple(xq_t.inv_scale.shape)
        (64, 2)
    """
    if not supports(x, dtype, recipe, block=block, margin=margin, power_of_2=power_of_2):
        raise ValueError(f"granular_cast.quantize_operands cannot take x {tuple(x.shape)} "
                         f"{x.dtype} on {x.device}, {recipe} block={block} margin={margin} "
                         f"power_of_2={power_of_2}; use the torch reference (granular.quantize)")
    if not rows and not cols:
        return None, None
    kw = {"margin": margin, "power_of_2": power_of_2}
    if recipe == "rowwise":
        return _rowwise(x, dtype, rows, cols, kw, config)
    data, inv, data_t, inv_t = _blockwise(x, dtype, weight, rows, cols, block, kw, config)
    kind = "block" if weight else "tile"
    return (GranularFp8(data, inv, kind, block) if rows else None,
            GranularFp8(data_t, inv_t, kind, block) if cols else None)
