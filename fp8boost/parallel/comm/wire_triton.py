"""Fused Triton casts for the FP8 wire format (see :mod:`fp8boost.parallel.comm.wire`).

Each cast is one memory-bound pass: read the high-precision rows once, write FP8 bytes once (and
the reverse), instead of the 3-4 passes of the torch reference. Imported lazily by
``fp8_wire`` the first time ``impl="triton"`` is used; never at package import.

The kernels compute exactly what the torch reference computes (FP32 ``x * scale``, saturate to
+-fp8_max with NaN passing through, round-to-nearest-even cast; FP32 ``q * inv_scale``), so on
sm89+ hardware the bytes are identical. Under ``TRITON_INTERPRET=1`` the interpreter's own
FP32->FP8 conversion is not faithful (see shared/CPU-TESTING.md); tests there use values that
need no rounding.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from fp8boost.fp8.kernels.cast import abs_bits, tl_scale_from_amax
from fp8boost.fp8.scaling import fp8_max

BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _cast_rows_kernel(x_ptr, x_row_stride, scale_ptr, out_ptr, out_row_stride, n_cols,
                      FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr, BLOCK: tl.constexpr):
    # Columns on grid axis 0 (2**31 blocks), rows on axis 1 (<= 65535 rows: ranks, not data).
    row = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    q = _fp8_bytes(x * tl.load(scale_ptr + row), FP8_MAX, IS_E4M3)
    tl.store(out_ptr + row * out_row_stride + offs, q, mask=mask)


@triton.jit
def _fp8_bytes(y, FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr):
    # Saturate explicitly (e5m2 would overflow to inf); comparisons with NaN are false, so a NaN
    # passes through and stays visible. Round to nearest even; return the bytes as uint8.
    y = tl.where(y > FP8_MAX, FP8_MAX, y)
    y = tl.where(y < -FP8_MAX, -FP8_MAX, y)
    if IS_E4M3:
        q = y.to(tl.float8e4nv)
    else:
        q = y.to(tl.float8e5)
    return q.to(tl.uint8, bitcast=True)


@triton.jit
def _row_amax_kernel(x_ptr, x_row_stride, part_ptr, n_cols, n_blocks, P,
                     BLOCK: tl.constexpr):
    # Program (p, row) reduces blocks p, p + P, ... of its row to one partial: max |x| as int32
    # bits (exact and NaN-propagating: see fp8boost.fp8.kernels.cast).
    row = tl.program_id(1).to(tl.int64)
    p = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for b in range(p, n_blocks, P):
        offs = tl.cast(b, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + offs, mask=offs < n_cols, other=0.0)
        acc = tl.maximum(acc, abs_bits(x))
    tl.store(part_ptr + row * P + p, tl.max(acc, axis=0))


@triton.jit
def _quantize_rows_kernel(x_ptr, x_row_stride, part_ptr, P, out_ptr, out_row_stride, n_cols,
                          trailer_off, FP8_MAX: tl.constexpr,
                          POW2: tl.constexpr, IS_E4M3: tl.constexpr, BLOCK: tl.constexpr,
                          PBLOCK: tl.constexpr):
    # Each program derives its row's scale from the row's amax partials (a few bytes, no extra
    # launch), casts one block, and program 0 of the row writes the FP32 inverse scale into
    # the segment's trailer, byte by byte (little-endian, as tensor.view(torch.uint8) lays it).
    row = tl.program_id(1).to(tl.int64)
    pidx = tl.arange(0, PBLOCK)
    bits = tl.max(tl.load(part_ptr + row * P + pidx, mask=pidx < P, other=0), axis=0)
    scale = tl_scale_from_amax(bits.to(tl.float32, bitcast=True), FP8_MAX, POW2)  # margin 0
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + offs, _fp8_bytes(x * scale, FP8_MAX, IS_E4M3),
             mask=mask)
    inv_bits = tl.math.div_rn(1.0, scale).to(tl.int32, bitcast=True)
    k = tl.arange(0, 4)
    byte = ((inv_bits >> (k * 8)) & 0xFF).to(tl.uint8)
    n_bytes = tl.where(tl.program_id(0) == 0, 4, 0)  # only the row's first program writes
    tl.store(out_ptr + row * out_row_stride + trailer_off + k, byte, mask=k < n_bytes)


@triton.jit
def _load_fp8_as_f32(ptr, mask, IS_E4M3: tl.constexpr):
    b = tl.load(ptr, mask=mask, other=0)
    if IS_E4M3:
        v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = b.to(tl.float8e5, bitcast=True).to(tl.float32)
    return v


@triton.jit
def _dequant_rows_kernel(in_ptr, in_row_stride, inv_ptr, out_ptr, out_row_stride, n_cols,
                         IS_E4M3: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    v = _load_fp8_as_f32(in_ptr + row * in_row_stride + offs, mask, IS_E4M3)
    y = v * tl.load(inv_ptr + row)
    tl.store(out_ptr + row * out_row_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_sum_kernel(in_ptr, in_row_stride, n_rows, inv_ptr, local_ptr, out_ptr, n_cols,
                        post_scale, HAS_LOCAL: tl.constexpr, IS_E4M3: tl.constexpr,
                        BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    if HAS_LOCAL:
        acc = tl.load(local_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
    # Advance a pointer instead of computing r * stride: no 32-bit overflow on GB-sized rows.
    ptrs = in_ptr + offs
    for r in range(0, n_rows):
        acc += _load_fp8_as_f32(ptrs, mask, IS_E4M3) * tl.load(inv_ptr + r)
        ptrs += in_row_stride
    acc = acc * post_scale
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _device_ctx(t: torch.Tensor):
    # Triton launches on the current CUDA device: make it the tensor's.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check_unit_col_stride(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be 2-D with unit column stride, got shape "
                         f"{tuple(t.shape)} stride {t.stride()}")


def cast_rows(x2d: torch.Tensor, scale: torch.Tensor, packed: torch.Tensor,
              fp8_dtype: torch.dtype) -> None:
    """Quantize ``x2d[R, C]`` with per-row FP32 ``scale[R]`` into ``packed[:, :C]`` (uint8)."""
    _check_unit_col_stride(x2d, "x2d")
    rows, cols = x2d.shape
    grid = (triton.cdiv(cols, BLOCK), rows)
    with _device_ctx(x2d):
        _cast_rows_kernel[grid](x2d, x2d.stride(0), scale, packed, packed.stride(0), cols,
                                FP8_MAX=fp8_max(fp8_dtype),
                                IS_E4M3=fp8_dtype == torch.float8_e4m3fn, BLOCK=BLOCK,
                                num_warps=NUM_WARPS)


def quantize_rows(x2d: torch.Tensor, packed: torch.Tensor, trailer_off: int,
                  fp8_dtype: torch.dtype, power_of_2: bool) -> None:
    """Each row of ``x2d[R, C]`` cast with the scale from its own amax into ``packed[:, :C]``
    (uint8), its FP32 inverse scale into ``packed[:, trailer_off:trailer_off + 4]``.

    Two launches for any number of rows: per-row amax partials, then scale + cast + trailer
    (instead of an amax reduction, ~8 small scale-math kernels, a trailer copy and the cast).
    Bytes and scales equal :func:`fp8boost.parallel.comm.wire.quantize_rows`'s torch path.
    """
    _check_unit_col_stride(x2d, "x2d")
    rows, cols = x2d.shape
    n_blocks = triton.cdiv(cols, BLOCK)
    parts = max(1, min(n_blocks, 64))
    part = torch.empty((rows, parts), dtype=torch.int32, device=x2d.device)
    is_e4m3 = fp8_dtype == torch.float8_e4m3fn
    with _device_ctx(x2d):
        _row_amax_kernel[(parts, rows)](x2d, x2d.stride(0), part, cols, n_blocks, parts,
                                        BLOCK=BLOCK, num_warps=NUM_WARPS)
        _quantize_rows_kernel[(max(n_blocks, 1), rows)](
            x2d, x2d.stride(0), part, parts, packed, packed.stride(0), cols, trailer_off,
            FP8_MAX=fp8_max(fp8_dtype), POW2=bool(power_of_2),
            IS_E4M3=is_e4m3, BLOCK=BLOCK, PBLOCK=triton.next_power_of_2(parts),
            num_warps=NUM_WARPS)


def dequant_rows(packed: torch.Tensor, inv: torch.Tensor, out: torch.Tensor, numel: int,
                 fp8_dtype: torch.dtype) -> None:
    """``out[R, numel] = packed[:, :numel] as FP8 * inv[R]`` in the output's dtype."""
    _check_unit_col_stride(out, "out")
    rows = packed.shape[0]
    grid = (triton.cdiv(numel, BLOCK), rows)
    with _device_ctx(packed):
        _dequant_rows_kernel[grid](packed, packed.stride(0), inv, out, out.stride(0), numel,
                                   IS_E4M3=fp8_dtype == torch.float8_e4m3fn, BLOCK=BLOCK,
                                   num_warps=NUM_WARPS)


def dequant_sum(packed: torch.Tensor, inv: torch.Tensor, local: Optional[torch.Tensor],
                out: torch.Tensor, numel: int, fp8_dtype: torch.dtype, post_scale: float) -> None:
    """``out = post_scale * (local + sum_r packed[r] * inv[r])`` with an FP32 accumulator."""
    target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype,
                                                         device=out.device)
    loc = local.contiguous() if local is not None else target  # dummy pointer when absent
    grid = (triton.cdiv(numel, BLOCK),)
    with _device_ctx(packed):
        _dequant_sum_kernel[grid](packed, packed.stride(0) if packed.shape[0] else 0,
                                  packed.shape[0], inv, loc, target, numel, float(post_scale),
                                  HAS_LOCAL=local is not None,
                                  IS_E4M3=fp8_dtype == torch.float8_e4m3fn, BLOCK=BLOCK,
                                  num_warps=NUM_WARPS)
    if target is not out:
        out.copy_(target)
