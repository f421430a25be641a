"""M-grouped FP8 GEMM of the experts (forward and input gradient), in Triton.

``out[r] = (a[r] @ b[e]^T) * a_inv[r] * b_inv[e]`` for the rows ``r`` of expert ``e``
(``[offsets[e-1], offsets[e])``, the routing's end offsets): ``a [rows, K]`` FP8 with a scale
per row, ``b [E, N, K]`` FP8 with a scale per (expert, n), both K-major, as
:func:`fp8boost.fp8.moe.gemm.scaled_mm` takes them. Rows past ``offsets[E-1]`` are left
unwritten (the caller masks them, as for torch's kernel).

Why: with promoted accumulation (the input gradient's default) ``torch._scaled_grouped_mm``
ran at 0.44-0.61x BF16 at Qwen3-30B-A3B's 128 experts x 768 (H100, issue 34). Each expert's
rows are cut into ``BLOCK_M`` tiles; a schedule built on the device (each expert's tile count,
cumulated: no host sync) maps program ``t`` to (expert, tile), so no tile mixes experts and
the grid is the upper bound ``cdiv(rows, BLOCK_M) + E`` (programs past the schedule exit).

:func:`grouped_mm` times the configs of :data:`.grouped_common.MM_OFFERED` against torch's
once per shape class on the GPU (:class:`~fp8boost.fp8.kernels.tuning.ConfigCache` ``"moe-mm"``)
and runs the fastest; small problems keep torch's kernel untimed
(:func:`.grouped_common.fastest`). On an H200 the input gradient at Qwen3-30B-A3B's shapes ran
1.5-2.2x torch's kernel (505-574 against 251-339 TFLOP/s, promoted accumulation); at
Mixtral-8x7B's, torch's ran faster and is the one chosen.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from .grouped_common import (MM_OFFERED, CONFIGS, INTERP_CONFIG, TileConfig, common_ok,
                             fastest, group_start, refusal, torch_only)
from .tuning import ConfigCache, bucket

_CACHE = ConfigCache("moe-mm")


@triton.jit
def _grouped_mm_kernel(a_ptr, b_ptr, out_ptr, a_inv_ptr, b_inv_ptr, off_ptr, tile_end_ptr,
                       N, K, E, stride_a, stride_be, stride_bn, E_P2: tl.constexpr,
                       PROMOTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    experts = tl.arange(0, E_P2)
    ends = tl.load(tile_end_ptr + experts, mask=experts < E, other=2**30)
    if t < tl.load(tile_end_ptr + E - 1):
        e = tl.sum((ends <= t).to(tl.int32))  # the first expert whose tiles end past t
        first = tl.load(tile_end_ptr + tl.maximum(e - 1, 0))
        first = tl.where(e > 0, first, 0)
        start = group_start(off_ptr, e)
        end = tl.load(off_ptr + e)
        offs_m = start + (t - first) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < end
        n_ok = offs_n < N
        rows_a = tl.where(m_ok, offs_m, 0).to(tl.int64)  # clamped: never stored
        rows_b = tl.where(n_ok, offs_n, 0).to(tl.int64)
        b_base = b_ptr + e.to(tl.int64) * stride_be
        offs_k0 = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + offs_k0
            k_ok = offs_k[None, :] < K
            a = tl.load(a_ptr + rows_a[:, None] * stride_a + offs_k[None, :], mask=k_ok,
                        other=0.0)
            b = tl.load(b_base + rows_b[:, None] * stride_bn + offs_k[None, :], mask=k_ok,
                        other=0.0)
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=PROMOTE)
        a_inv = tl.load(a_inv_ptr + offs_m, mask=m_ok, other=0.0)
        b_inv = tl.load(b_inv_ptr + e * N + offs_n, mask=n_ok, other=0.0)
        acc = acc * a_inv[:, None] * b_inv[None, :]
        out = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(out, acc.to(tl.bfloat16), mask=m_ok[:, None] & n_ok[None, :])


def supports(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
             offsets: torch.Tensor) -> bool:
    """Whether :func:`triton_mm` takes these operands (FP8 K-major ``a [rows, K]``, ``b [E, N,
    K]``, FP32 ``a_inv [rows]``, ``b_inv [E, N]``, int32 ``offsets [E]``, one CUDA device or
    the interpreter; K a multiple of 16)."""
    if not common_ok(a, b, a_inv, b_inv, offsets) or a.dim() != 2 or b.dim() != 3:
        return False
    e, n, k = b.shape
    if a.shape[1] != k or k % 16 or offsets.shape != (e,):
        return False
    if a.stride(1) != 1 or b.stride(2) != 1 or a.stride(0) % 16 or b.stride(1) % 16:
        return False
    return a_inv.numel() == a.shape[0] and tuple(b_inv.shape) == (e, n)


def triton_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
              offsets: torch.Tensor, fast_accum: bool,
              cfg: TileConfig = CONFIGS[0]) -> torch.Tensor:
    """The Triton kernel with one config: ``[rows, N]`` BF16, rows past the groups unset."""
    if not supports(a, a_inv, b, b_inv, offsets):
        raise refusal("grouped_mm", a, a_inv, b, b_inv, offsets)
    return _launch(a, a_inv, b, b_inv, offsets, fast_accum, cfg)


def _launch(a, a_inv, b, b_inv, offsets, fast_accum: bool, cfg: TileConfig) -> torch.Tensor:
    rows, k = a.shape
    e, n, _ = b.shape
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    tile_end = torch.cumsum((sizes + cfg.block_m - 1) // cfg.block_m, 0).to(torch.int32)
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=a.device)
    grid = (triton.cdiv(rows, cfg.block_m) + e, triton.cdiv(n, cfg.block_n))
    _grouped_mm_kernel[grid](a, b, out, a_inv.contiguous().view(-1), b_inv.contiguous(), offsets,
                             tile_end, n, k, e, a.stride(0), b.stride(0), b.stride(1),
                             E_P2=triton.next_power_of_2(e),
                             PROMOTE=None if fast_accum else cfg.block_k,
                             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                             num_stages=cfg.stages, num_warps=cfg.warps)
    return out


def grouped_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
               offsets: torch.Tensor, fast_accum: bool,
               torch_mm: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The fastest of torch's kernel (``torch_mm()``) and this module's configs for this shape
    class, timed once on the GPU; torch's where the Triton kernel cannot take the operands."""
    if not supports(a, a_inv, b, b_inv, offsets):
        return torch_only("grouped_mm", a, b, torch_mm)
    rows, k = a.shape
    e, n, _ = b.shape
    key = (bucket(rows), n, k, e, a.dtype, b.dtype, bool(fast_accum), a.device.index)
    return fastest(_CACHE, key, rows * n * k,
                   lambda cfg: _launch(a, a_inv, b, b_inv, offsets, fast_accum, cfg), torch_mm,
                   MM_OFFERED)
