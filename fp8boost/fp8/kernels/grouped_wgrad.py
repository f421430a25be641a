"""K-grouped FP8 weight-gradient GEMM of the experts, in Triton.

``out[e] = (a_e @ b_e^T) * a_inv[e][:, None] * b_inv[e][None, :]`` where ``a_e = a[:, rows of
expert e]`` and ``b_e = b[:, rows of expert e]``: the reduction runs over each expert's token
rows (``[offsets[e-1], offsets[e])``, the routing's end offsets read on the device), and each
expert's scales are one per row of ``a`` (``a_inv [E, M]``) and of ``b`` (``b_inv [E, N]``),
as :func:`fp8boost.fp8.moe.gemm.scaled_mm_wgrad` takes them. ``a [M, rows]`` and ``b [N,
rows]`` are FP8, row-major (token-major: the transposed operands the segmented casts write).

Why: ``torch._scaled_grouped_mm``'s 2-D x 2-D form ran at 0.21-0.31x BF16's ``_grouped_mm`` on
Qwen3-30B-A3B's 128 experts x 768 (H200, issue 34). One program here owns one ``BLOCK_M x
BLOCK_N`` output tile for every expert: it streams all experts' rows ``BLOCK_K`` at a time in
one loop (a chunk never mixes experts; 16-row aligned group starts keep the loads 16-byte
aligned) and stores expert ``e``'s tile when ``e``'s rows are in; padding rows hold zero bytes
and add nothing; an expert with no rows gets zeros. (The first version, one program per
(tile, expert) looping over that expert's 2-4 chunks, ran 76-177 TFLOP/s on an H200.) Accumulation: fast (the tensor cores' FP8
accumulator over the whole group) or promoted to FP32 every ``BLOCK_K`` rows
(``max_num_imprecise_acc``), as the dense Triton GEMM does.

:func:`grouped_wgrad` times the configs of :data:`.grouped_common.WGRAD_OFFERED` against
torch's kernel once per shape class on the GPU (:class:`~fp8boost.fp8.kernels.tuning.ConfigCache`
``"moe-wgrad"``) and runs the fastest. None is offered today: on an H200 (2026-11-28) the first
version reached 76-177 TFLOP/s and this one, with the expert slices and the 16-aligned mask
bound, 105-158 (0.23-0.28x BF16's ``_grouped_mm``, below torch's FP8 kernel at every shape;
``bench/moe_gemm.py --gemms-only``). The same loads and dot run 500-850 TFLOP/s in the
M-grouped kernel, so the loop with its per-expert epilogue and loop-carried, loaded addresses
is the suspect (likely not software-pipelined); until a faster version lands the experts run
torch's kernel untimed, or the weight gradient in BF16 where the precision choice says so.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from .grouped_common import (WGRAD_OFFERED, CONFIGS, INTERP_CONFIG, TileConfig, common_ok,
                             fastest, group_start, refusal, torch_only)
from .tuning import ConfigCache, bucket

_CACHE = ConfigCache("moe-wgrad")


@triton.jit
def _wgrad_kernel(a_ptr, b_ptr, out_ptr, a_inv_ptr, b_inv_ptr, off_ptr, chunk_end_ptr, M, N, E,
                  stride_a, stride_b, PROMOTE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (tile, s) owns output tile `tile` (pid_m, pid_n) of experts [e_lo, e_hi), the
    # s-th of the grid's second axis's equal slices of the experts: it streams those experts'
    # chunks of BLOCK_K rows in order (chunk_end: each expert's last chunk + 1, cumulated; an
    # expert with no rows has one empty chunk, so its tile is stored as zeros) and stores
    # expert e's tile when e's last chunk is in. One long pipelined loop instead of one short
    # loop per (tile, expert) program: at Qwen3-30B-A3B's 128 experts an expert has 256-512
    # rows, 2-4 chunks, too few to fill a software pipeline (the per-expert-program kernel ran
    # 76-177 TFLOP/s on an H200). The expert slices exist for the SMs: Qwen3's down projection
    # has 96 tiles of 128 x 128 for 132 SMs; each expert's output is its own, so slices need no
    # reduction. Programs of one slice run through its rows roughly together, so the chunks they
    # share stay in L2.
    tile = tl.program_id(0)
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = tile // tiles_n
    pid_n = tile - pid_m * tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # Clamp rows past M / N instead of masking them: their results are never stored.
    rows_a = tl.where(m_ok, offs_m, 0).to(tl.int64)
    rows_b = tl.where(n_ok, offs_n, 0).to(tl.int64)
    offs_k0 = tl.arange(0, BLOCK_K)
    e_lo = split * E // n_split  # the launcher keeps n_split <= E: every slice has an expert
    e_hi = (split + 1) * E // n_split
    j_lo = tl.load(chunk_end_ptr + tl.maximum(e_lo - 1, 0))
    j_lo = tl.where(e_lo > 0, j_lo, 0)
    j_hi = tl.load(chunk_end_ptr + e_hi - 1)
    e = e_lo
    first = j_lo  # e's first chunk
    last = tl.load(chunk_end_ptr + e_lo) - 1  # e's last chunk
    start = group_start(off_ptr, e_lo)  # e's first row (a multiple of 16)
    end = tl.load(off_ptr + e_lo)  # e's end row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(j_lo, j_hi):
        k0 = tl.multiple_of(start + (j - first) * BLOCK_K, 16)
        offs_k = k0 + offs_k0
        # The bound is a group end, a multiple of 16 (the routing's padding): said here, at
        # the use, so the masked loads stay 16-byte vectors (without it every byte was a load
        # of its own: 105-158 TFLOP/s on an H200 at every shape, 2026-11-28).
        k_ok = offs_k[None, :] < tl.multiple_of(end, 16)
        a = tl.load(a_ptr + rows_a[:, None] * stride_a + offs_k[None, :], mask=k_ok, other=0.0)
        b = tl.load(b_ptr + rows_b[:, None] * stride_b + offs_k[None, :], mask=k_ok, other=0.0)
        acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=PROMOTE)
        if j == last:
            a_inv = tl.load(a_inv_ptr + e * M + offs_m, mask=m_ok, other=0.0)
            b_inv = tl.load(b_inv_ptr + e * N + offs_n, mask=n_ok, other=0.0)
            tile_out = acc * a_inv[:, None] * b_inv[None, :]
            out = (out_ptr + e.to(tl.int64) * M * N + offs_m.to(tl.int64)[:, None] * N
                   + offs_n[None, :])
            tl.store(out, tile_out.to(tl.bfloat16), mask=m_ok[:, None] & n_ok[None, :])
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            nxt = tl.minimum(e + 1, e_hi - 1)  # past the slice's last expert: the loop ends
            e = e + 1
            first = j + 1
            last = tl.load(chunk_end_ptr + nxt) - 1
            start = group_start(off_ptr, nxt)
            end = tl.load(off_ptr + nxt)


def supports(a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
             offsets: torch.Tensor) -> bool:
    """Whether :func:`triton_wgrad` takes these operands (FP8 row-major ``a [M, rows]``, ``b
    [N, rows]``, FP32 ``a_inv [E, M]``, ``b_inv [E, N]``, int32 ``offsets [E]``, one CUDA
    device or the interpreter, the row count a multiple of 16).

    Example:
        >>> e4 = torch.float8_e4m3fn
        >>> supports(torch.zeros(8, 32, dtype=e4), torch.zeros(4, 32, dtype=e4),
        ...          torch.ones(2, 8), torch.ones(2, 4), torch.tensor([16, 32]))
        False
    """
    if not common_ok(a, b, a_inv, b_inv, offsets) or a.dim() != 2 or b.dim() != 2:
        return False
    rows, e = a.shape[1], offsets.shape[0]
    if b.shape[1] != rows or rows % 16 or e < 1:
        return False
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) % 16 or b.stride(0) % 16:
        return False
    return tuple(a_inv.shape) == (e, a.shape[0]) and tuple(b_inv.shape) == (e, b.shape[0])


def triton_wgrad(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
                 offsets: torch.Tensor, fast_accum: bool, cfg: TileConfig = CONFIGS[0],
                 split: int | None = None) -> torch.Tensor:
    """The Triton kernel with one config: ``[E, M, N]`` BF16 (see the module docstring).
    ``split``: slices of the experts (programs per output tile); None: :func:`expert_split`."""
    if not supports(a, b, a_inv, b_inv, offsets):
        raise refusal("grouped_wgrad", a, a_inv, b, b_inv, offsets)
    return _launch(a, a_inv, b, b_inv, offsets, fast_accum, cfg, split)


def expert_split(tiles: int, experts: int, device: torch.device) -> int:
    """Programs per output tile: enough slices of the experts for about four programs per SM
    (the programs differ in length with the routing; more of them even out the last wave),
    at most one slice per expert. One under the interpreter (no SMs to fill).

    Example:
        >>> expert_split(96, 128, torch.device("cpu"))
        1
    """
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(experts, triton.cdiv(4 * sms, tiles)))


def _launch(a, a_inv, b, b_inv, offsets, fast_accum: bool, cfg: TileConfig,
            split: int | None = None) -> torch.Tensor:
    m, n, e = a.shape[0], b.shape[0], offsets.shape[0]
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = expert_split(tiles, e, a.device) if split is None else split
    if not 1 <= split <= e:
        raise ValueError(f"split={split}: between 1 and the {e} experts")
    out = torch.empty(e, m, n, dtype=torch.bfloat16, device=a.device)
    # The chunk schedule, on the device (no host sync): an empty expert still gets one chunk.
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    chunks = ((sizes + cfg.block_k - 1) // cfg.block_k).clamp_(min=1)
    chunk_end = torch.cumsum(chunks, 0).to(torch.int32)
    grid = (tiles, split)
    _wgrad_kernel[grid](a, b, out, a_inv.contiguous(), b_inv.contiguous(), offsets, chunk_end,
                        m, n, e,
                        a.stride(0), b.stride(0), PROMOTE=None if fast_accum else cfg.block_k,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                        num_stages=cfg.stages, num_warps=cfg.warps)
    return out


def grouped_wgrad(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
                  offsets: torch.Tensor, fast_accum: bool,
                  torch_wgrad: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The fastest of torch's kernel (``torch_wgrad()``) and this module's configs for this
    shape class, timed once on the GPU; torch's kernel where the Triton one cannot take the
    operands (:func:`supports`)."""
    if not supports(a, b, a_inv, b_inv, offsets):
        return torch_only("grouped_wgrad", a, b, torch_wgrad)
    m, n, e, rows = a.shape[0], b.shape[0], offsets.shape[0], a.shape[1]
    key = (bucket(rows), m, n, e, a.dtype, b.dtype, bool(fast_accum), a.device.index)
    return fastest(_CACHE, key, m * n * rows,
                   lambda cfg: _launch(a, a_inv, b, b_inv, offsets, fast_accum, cfg),
                   torch_wgrad, WGRAD_OFFERED)
