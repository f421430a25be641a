"""``W^T`` of the expert weights in two kernels that each run near HBM bandwidth.

An expert projection casts its weight ``W [E, N, K]`` twice a step: in forward along K (one
scale per (e, n), the operand of fprop: :mod:`.granular_cast`'s rows kernel) and in backward
transposed, ``W^T [E, K, N]`` along N (one scale per (e, k), the operand of dgrad). The
backward cast needs every column's maximum over N before it writes a byte, so it reads ``W``
twice. :mod:`.moe_seg_cast`'s two passes did that at 33-40% of an H200's HBM bandwidth
(counting one read; ``bench/results/moe_cast_bw_h200_2026-11-28.json``), the cast pass with
its transposed store being the slow one. Here:

* :func:`colmax`: one program per (expert, column block, slice of the rows), a running
  elementwise maximum of the ``|W|`` bit patterns in registers, one relaxed integer atomic max
  per column and slice at the end (read only);
* :func:`transposed_from_colmax`: one program per ``[BLOCK_N, BLOCK_K]`` tile of one expert,
  cast with the tile's column scales, transposed in registers, stored ``BLOCK_N`` contiguous
  bytes per row.

Taking the column maxima inside the forward's rows cast instead (so that backward reads ``W``
once) was measured and dropped: the per-chunk column reduction ran that kernel at half the
speed of the rows cast alone (1.90 against 0.88 ms at Mixtral's gate_up, with atomics or a
partial buffer alike; ``bench/results/moe_cast_bw_h200_colmax_atomics_2026-11-28.json``), which
cost more than the backward saved.

Bytes and scales are the torch reference's (:func:`fp8boost.fp8.moe.quantize.quantize_experts`
with ``transpose=True``), bit for bit: the numerics of :mod:`.granular_cast` (integer maxima over
bit patterns, NaN/Inf poisoning the scales the reference poisons). Tile shapes are timed once
per size class on the GPU (:class:`~fp8boost.fp8.kernels.tuning.ConfigCache` ``"moe-w-colmax"``
and ``"moe-w-t"``) for weights of at least :data:`TUNE_MIN_NUMEL` elements.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..scaling import fp8_max
from .cast import abs_bits, fp8_bytes, tl_scale_from_amax
from .granular_cast import FP8_GRID, TL_DTYPES
from .tuning import ConfigCache, bucket, interpreting, num_sms

# (BLOCK_R, BLOCK_K, num_warps, programs per SM aimed at by the row split) of the column-maxima
# pass: BLOCK_K * 2 contiguous bytes per loaded row.
COLMAX_CONFIGS = ((64, 128, 4, 4), (32, 256, 8, 4), (128, 64, 4, 4))
# (BLOCK_N, BLOCK_K, num_warps) of the transposed cast: BLOCK_N contiguous bytes per stored row.
T_CONFIGS = ((128, 64, 4), (128, 128, 8), (64, 128, 4), (256, 64, 8))
TUNE_MIN_NUMEL = 1 << 24
_INTERP_COLMAX = (8, 16, 1, 2)
_INTERP_T = (16, 16, 1)
_MAX_SPLIT = 64
_COLMAX_CACHE = ConfigCache("moe-w-colmax")
_T_CACHE = ConfigCache("moe-w-t")


@triton.jit
def _colmax_kernel(x_ptr, camax_ptr, N, K, SPLIT, IDX64: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    # Column maxima of rows slice sp of expert e, columns of block kb: an elementwise running
    # maximum in registers, one reduction and one relaxed integer atomic per column at the end.
    e = tl.program_id(0)
    kb = tl.program_id(1)
    sp = tl.program_id(2)
    chunk = tl.cdiv(tl.cdiv(N, SPLIT), BLOCK_R) * BLOCK_R
    lo = sp * chunk
    hi = tl.minimum(N, lo + chunk)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    in_k = offs_k < K
    if IDX64:  # E*N*K >= 2**31 (each expert's N*K below it)
        base = e.to(tl.int64) * N * K
    else:
        base = e * N * K
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.int32)
    for r0 in range(lo, hi, BLOCK_R):
        offs_n = r0 + tl.arange(0, BLOCK_R)
        x = tl.load(x_ptr + base + offs_n[:, None] * K + offs_k[None, :],
                    mask=(offs_n < hi)[:, None] & in_k[None, :], other=0.0)
        acc = tl.maximum(acc, abs_bits(x))  # zeros outside: they never raise a maximum
    tl.atomic_max(camax_ptr + e * K + offs_k, tl.max(acc, axis=0), mask=in_k, sem="relaxed")


@triton.jit
def _t_from_colmax_kernel(x_ptr, camax_ptr, qt_ptr, invt_ptr, N, K, fmax, target,
                          POW2: tl.constexpr, T_RELOAD: tl.constexpr, OUT_DTYPE: tl.constexpr,
                          EMULATE: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                          IDX64: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Tile (n block, k block) of expert e: qt[e, k, n] = cast(W[e, n, k] * s[e, k]).
    e = tl.program_id(0)
    kb = tl.program_id(1)
    nb = tl.program_id(2)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    in_k = offs_k < K
    in_n = offs_n < N
    a = tl.load(camax_ptr + e * K + offs_k, mask=in_k, other=0)
    s = tl_scale_from_amax(a.to(tl.float32, bitcast=True), target, POW2)
    if nb == 0:
        tl.store(invt_ptr + e * K + offs_k, tl.math.div_rn(1.0, s), mask=in_k)
    if IDX64:  # E*N*K >= 2**31 (each expert's N*K below it)
        base = e.to(tl.int64) * N * K
    else:
        base = e * N * K
    mask_t = in_k[:, None] & in_n[None, :]
    if T_RELOAD:  # float32: no register transpose (see moe_cast's docstring)
        xt = tl.load(x_ptr + base + offs_n[None, :] * K + offs_k[:, None], mask=mask_t,
                     other=0.0).to(tl.float32)
        qt = fp8_bytes(xt, s[:, None], fmax, OUT_DTYPE, EMULATE, MANT_BITS, MIN_EXP)
    else:
        x = tl.load(x_ptr + base + offs_n[:, None] * K + offs_k[None, :],
                    mask=in_n[:, None] & in_k[None, :], other=0.0).to(tl.float32)
        qt = tl.trans(fp8_bytes(x, s[None, :], fmax, OUT_DTYPE, EMULATE, MANT_BITS, MIN_EXP))
    tl.store(qt_ptr + base + offs_k[:, None] * N + offs_n[None, :], qt, mask=mask_t)


def _common(w: torch.Tensor, dtype: torch.dtype, margin: int, power_of_2: bool) -> dict:
    mant, min_exp = FP8_GRID[dtype]
    return dict(POW2=bool(power_of_2), OUT_DTYPE=TL_DTYPES[dtype], EMULATE=interpreting(),
                MANT_BITS=mant, MIN_EXP=min_exp, IDX64=w.numel() >= 2**31)


def _key(w: torch.Tensor) -> tuple:
    e, n, k = w.shape
    return (bucket(e), bucket(n), bucket(k), w.dtype, w.device.index)


def colmax(w: torch.Tensor) -> torch.Tensor:
    """The column maxima of ``|w [E, N, K]|`` over N (contiguous ``w``): ``[E, K]`` FP32, NaN
    where a column holds one (integer maxima of the bit patterns, as the reference's amax)."""
    e, n, k = w.shape
    camax = torch.zeros((e, k), dtype=torch.int32, device=w.device)
    sms = num_sms(w.device)
    idx64 = w.numel() >= 2**31

    def run(cfg):
        br, bk, warps, per_sm = cfg
        n_k = triton.cdiv(k, bk)
        split = max(1, min(_MAX_SPLIT, triton.cdiv(per_sm * sms, e * n_k), triton.cdiv(n, br)))
        # Zeroed once: a timing re-run maxes the same values into the table again.
        _colmax_kernel[(e, n_k, split)](w, camax, n, k, split, IDX64=idx64, BLOCK_R=br,
                                        BLOCK_K=bk, num_warps=warps)

    if interpreting():
        run(_INTERP_COLMAX)
    else:
        run(_COLMAX_CACHE.pick(_key(w), COLMAX_CONFIGS, run, bench=w.numel() >= TUNE_MIN_NUMEL))
    return camax.view(torch.float32)


def transposed_from_colmax(w: torch.Tensor, colmax: torch.Tensor, dtype: torch.dtype, *,
                           margin: int = 0, power_of_2: bool = False):
    """``w^T [E, K, N]`` scaled per (e, k) over N, given :func:`colmax` of the same ``w``
    (one read of ``w``).

    Returns:
        ``(data_t [E, K, N], inv_t [E, K])``.
    """
    e, n, k = w.shape
    data_t = torch.empty((e, k, n), dtype=dtype, device=w.device)
    inv_t = torch.empty((e, k), dtype=torch.float32, device=w.device)
    camax = colmax.contiguous().view(torch.int32)
    fmax = fp8_max(dtype)
    common = _common(w, dtype, margin, power_of_2)

    def run(cfg):
        bn, bk, warps = cfg
        _t_from_colmax_kernel[(e, triton.cdiv(k, bk), triton.cdiv(n, bn))](
            w, camax, data_t.view(torch.uint8), inv_t, n, k, fmax, fmax / (2.0 ** margin),
            T_RELOAD=w.dtype == torch.float32, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
            **common)

    if interpreting():
        run(_INTERP_T)
    else:
        run(_T_CACHE.pick(_key(w), T_CONFIGS, run, bench=w.numel() >= TUNE_MIN_NUMEL))
    return data_t, inv_t


def transposed(w: torch.Tensor, dtype: torch.dtype, *, margin: int = 0,
               power_of_2: bool = False):
    """``w^T [E, K, N]`` (contiguous ``w [E, N, K]``) scaled per (e, k) over N: the column
    maxima (a read-only pass), then the cast (one read, one transposed write).

    Returns:
        ``(data_t [E, K, N], inv_t [E, K])``, the bytes and scales of the torch reference.

    Example:
        >>> w = torch.randn(4, 32, 16, device="cuda", dtype=torch.bfloat16)
        >>> dt, it = transposed(w, torch.float8_e4m3fn)
        >>> tuple(dt.shape), tuple(it.shape)
        ((4, 16, 32), (4, 16))
    """
    return transposed_from_colmax(w, colmax(w), dtype, margin=margin, power_of_2=power_of_2)
