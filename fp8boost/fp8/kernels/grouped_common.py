"""What the two Triton grouped FP8 GEMMs of the experts share (:mod:`.grouped_mm`, M-grouped:
forward and input gradient; :mod:`.grouped_wgrad`, K-grouped: weight gradient): the tile
configs, the first row of a group read from the routing's end offsets, the operand checks
both make, and the dispatch that times their configs against torch's kernel once per shape
class and runs the fastest.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable, NamedTuple

import torch
import triton
import triton.language as tl

from fp8boost import _state

from .tuning import ConfigCache, interpreting

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class TileConfig(NamedTuple):
    """Block sizes, pipeline depth and warps of one launch."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int


TORCH = "torch"  # pseudo-config: torch._scaled_grouped_mm
CONFIGS = (TileConfig(128, 128, 128, 4, 8), TileConfig(128, 256, 128, 3, 8),
           TileConfig(64, 128, 128, 4, 4), TileConfig(128, 128, 64, 5, 8))
# Smaller problems (the GEMM's M * N * K) run torch's kernel untimed: timing compiles every
# config (seconds), repaid only where the GEMM is a measurable share of a step.
TUNE_MIN_WORK = 1 << 32
# The configs each dispatcher times against torch's kernel (CONFIGS: every config, tested and
# benchmarked). From bench/moe_gemm.py on an H200, 2026-11-28 (moe_gemm_h200_2026-11-28.json,
# promoted accumulation): M-grouped input gradient, (64, 128, 128) beat torch 1.5-2.2x at
# Qwen3-30B-A3B's shapes and (128, 128, 128) came second (torch won at Mixtral's); the
# K-grouped weight gradient reached 76-177 TFLOP/s in every config (105-158 in its second
# version, moe_gemm_h200_wgradhint_2026-11-28.json), below torch's kernel at every shape
# (150-927), so it is not offered until it is faster: each offered config is a Triton compile
# at first use (seconds on every rank), paid for nothing.
MM_OFFERED = (TileConfig(64, 128, 128, 4, 4), TileConfig(128, 128, 128, 4, 8))
WGRAD_OFFERED: tuple[TileConfig, ...] = ()
INTERP_CONFIG = TileConfig(16, 32, 32, 1, 1)


@triton.jit
def group_start(off_ptr, e):
    """First row of expert ``e``'s group: ``offsets[e-1]`` (0 for the first), a multiple of
    16 (the routing aligns each group), so loads from it stay 16-byte aligned."""
    start = tl.load(off_ptr + tl.maximum(e - 1, 0))
    return tl.multiple_of(tl.where(e > 0, start, 0), 16)


def common_ok(a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
              offsets: torch.Tensor) -> bool:
    """The checks both kernels make: tensors, FP8 operands, FP32 scales, int32 1-D offsets,
    one device, CUDA (or the Triton interpreter)."""
    tensors = (a, b, a_inv, b_inv, offsets)
    if not all(torch.is_tensor(t) for t in tensors):
        return False
    if a.dtype not in FP8 or b.dtype not in FP8 or offsets.dim() != 1:
        return False
    if offsets.dtype != torch.int32 or a_inv.dtype != torch.float32 \
            or b_inv.dtype != torch.float32:
        return False
    return len({t.device for t in tensors}) == 1 and (a.is_cuda or interpreting())


def refusal(name: str, a, a_inv, b, b_inv, offsets) -> ValueError:
    """The error a kernel raises for operands its ``supports`` refuses."""
    return ValueError(f"{name} cannot take a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} "
                      f"{b.dtype}, a_inv {tuple(a_inv.shape)}, b_inv {tuple(b_inv.shape)}, "
                      f"offsets {tuple(offsets.shape)} {offsets.dtype} on {a.device}; use "
                      "torch._scaled_grouped_mm")


def torch_only(name: str, a, b, torch_gemm: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``torch_gemm()`` for operands the Triton kernel ``name`` refuses, said once at INFO
    (the experts then run torch's kernel alone at this shape, untimed against ours)."""
    _state.log_once(logging.getLogger("fp8boost.fp8.kernels"), ("grouped-torch-only", name),
                    f"fp8boost: the expert GEMM {name} runs torch._scaled_grouped_mm only: the "
                    f"Triton kernel does not take a {tuple(a.shape)} {a.dtype} x "
                    f"{tuple(b.shape)} {b.dtype} (see {name}.supports)", level=logging.INFO)
    return torch_gemm()


def fastest(cache: ConfigCache, key: Hashable, work: int,
            launch: Callable[[TileConfig], torch.Tensor],
            torch_gemm: Callable[[], torch.Tensor],
            offered: tuple[TileConfig, ...]) -> torch.Tensor:
    """Run ``launch(cfg)`` with the config of ``offered`` timed fastest for ``key`` against
    ``torch_gemm()`` (once on the GPU; problems of ``work`` under :data:`TUNE_MIN_WORK` take
    torch's untimed, as does an empty ``offered``; the interpreter :data:`INTERP_CONFIG`)."""
    if interpreting():
        return launch(INTERP_CONFIG)

    def run(cfg):
        return torch_gemm() if cfg == TORCH else launch(cfg)

    return run(cache.pick(key, (TORCH,) + offered, run, bench=work >= TUNE_MIN_WORK))
