"""Timing inside GPU tests that the GPU suite runs side by side on one GPU."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def least_ms(fns: Sequence[Callable[[], object]], reps: int = 7) -> list[float]:
    """Each function's least time in ms over ``reps`` calls, the functions called in turns after
    one warm-up call each (Triton casts, cuBLAS heuristics). The GPU suite runs other test files
    on the same GPU meanwhile, which only ever adds time, and unevenly: timing one function
    after the other once read the FP8 lm_head at 60.8 ms against BF16's 44.2 (bench/lm_head.py,
    alone on the GPU, times that FP8 head at 35.8 ms)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            best[i] = min(best[i], start.elapsed_time(end))
    return best
