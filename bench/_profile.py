"""Where a training step's GPU time goes: kernel time per step by category (torch.profiler).

Used by ``bench/train.py --profile-steps N``: after the timed steps, N more steps run under
the profiler (CUDA activity only) and the result gains ``kernels``: milliseconds per step for
each category below and the 25 kernels with the most time. The categories come from kernel
names (cuBLAS, Triton, flash attention, inductor), so they are approximate where a name is
ambiguous; ``other`` collects what no pattern matched.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Callable

import torch

# First match wins; names are lower-cased. cuBLAS's Hopper kernels are ``nvjet_sm90_<types>``:
# ``q`` marks an FP8 operand (``qq`` fast accumulation, ``qr`` FP32-promoted), a BF16 GEMM has
# none (``nvjet_sm90_tst_...``). Dtype conversions (``direct_copy``, ``bfloat16_copy``) are
# the master-weight and gradient copies of mixed precision, not FP8 casts.
CATEGORIES: list[tuple[str, str]] = [
    ("nccl", r"^nccl"),
    ("gemm_fp8_cublas", r"nvjet_sm\d+_q|(xmma|cutlass|gemm).*(e4m3|e5m2)"),
    ("gemm_fp8_triton", r"^_gemm_(tma|ptr)_kernel"),
    ("gemm_bf16", r"nvjet|xmma_gemm|sm90_.*gemm|cutlass|gemm|splitk"),
    ("attention", r"flash|fmha|attention|sdpa|compute_dot_do_o"),
    ("dtype_copy", r"direct_copy_kernel|bfloat16_copy_kernel|float_copy_kernel"),
    # the granular casts (``fp8boost/fp8/kernels/granular_cast.py``: ``_rows_kernel``,
    # ``_tile_cast_kernel``, ``_amax_rc_kernel``) count here too, not under "other"
    ("fp8_cast",
     r"^_(cast|amax|row_amax|cast_rows|quantize_rows|transpose|dequant|rows|tile_cast)\w*_kernel"),
    ("optimizer", r"adam|fusedoptimizer|lpnorm|multi_tensor"),
    ("loss_softmax", r"softmax|cross_entropy|nll_loss"),
    ("inductor_fused", r"^triton_"),
    ("elementwise", r"elementwise|reduce_kernel|fill|index|catarray"),
]


def categorize(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping (start, end) intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the (merged) ``spans`` not covered by the (merged) ``cover``."""
    total, j = 0.0, 0
    for a, b in spans:
        cur = a
        while j < len(cover) and cover[j][1] <= cur:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            if cover[k][0] > cur:
                total += cover[k][0] - cur
            cur = max(cur, cover[k][1])
            k += 1
        if cur < b:
            total += b - cur
    return total


def overlap(kernels: list[tuple[str, float, float]], steps: int) -> dict[str, float]:
    """Compute against communication on the GPU, ms per step, from (category, start, end) in us.

    ``busy``: time any non-NCCL kernel runs; ``idle``: the profiled span when none runs (the
    GPU waits for a collective, the CPU or a sync); ``nccl_exposed``: NCCL kernel time with no
    compute kernel beside it (communication the step waits for, or a collective's wait for its
    slowest peer). Kernels of one step overlap across streams, so categories alone do not say
    this.
    """
    if not kernels:
        return {}
    comp = _union([(a, b) for c, a, b in kernels if c != "nccl"])
    comm = _union([(a, b) for c, a, b in kernels if c == "nccl"])
    span = max(b for _, _, b in kernels) - min(a for _, a, _ in kernels)
    busy = _length(comp)
    return {k: round(v / steps / 1e3, 3) for k, v in dict(
        span=span, busy=busy, idle=span - busy, nccl=_length(comm),
        nccl_exposed=_minus(comm, comp)).items()}


def kernel_breakdown(step: Callable[[], Any], steps: int, device: torch.device,
                     top: int = 25, trace: str | None = None,
                     cpu: bool = False) -> dict[str, Any]:
    """Run ``steps`` steps under the profiler; kernel ms per step by category and top kernels.

    ``overlap`` (see :func:`overlap`) says how much of the step the GPU computed and how much
    NCCL time no compute hid; ``trace``: also write the Chrome trace to this path; ``cpu``:
    record CPU ops as well (their ``record_function`` ranges, e.g. FSDP's, land in the trace).
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    if trace:
        prof.export_chrome_trace(trace)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans: list[tuple[str, float, float]] = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        rec = per_kernel[ev.name]
        rec[0] += ev.device_time_total / 1e3  # us -> ms
        rec[1] += 1
        rng = getattr(ev, "time_range", None)
        if rng is not None and rng.end > rng.start:
            spans.append((categorize(ev.name), float(rng.start), float(rng.end)))
    by_cat: dict[str, float] = defaultdict(float)
    for name, (ms, _n) in per_kernel.items():
        by_cat[categorize(name)] += ms / steps
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(steps=steps,
                total_ms_per_step=sum(by_cat.values()),
                overlap=overlap(spans, steps),
                by_category_ms={k: round(v, 3) for k, v in sorted(by_cat.items(),
                                                                   key=lambda kv: -kv[1])},
                top_kernels=[dict(name=n[:160], category=categorize(n),
                                  ms_per_step=round(ms / steps, 3), calls_per_step=c / steps)
                             for n, (ms, c) in ranked])


def format_breakdown(config: str, kb: dict[str, Any]) -> str:
    lines = [f"[{config}] kernel time {kb['total_ms_per_step']:.1f} ms/step: " + ", ".join(
        f"{k} {v:.1f}" for k, v in kb["by_category_ms"].items())]
    if kb.get("overlap"):
        lines.append(f"[{config}] GPU ms/step: " + ", ".join(
            f"{k} {v:.1f}" for k, v in kb["overlap"].items()))
    for k in kb["top_kernels"][:15]:
        lines.append(f"  {k['ms_per_step']:7.2f} ms x{k['calls_per_step']:<5.0f} "
                     f"{k['category']:<15} {k['name'][:100]}")
    return "\n".join(lines)
