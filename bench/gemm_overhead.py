"""CPU cost per FP8 GEMM call: what a compiled layer pays on the host before the GPU runs it.

The 4xH200 profile of 2026-11-28 (BENCHMARKS.md, "4 GPUs") showed ``fp8boost::scaled_mm`` at
250-330 us of CPU per call in compiled graphs against 47-70 us for ``aten::_scaled_mm``; when
the CPU sets the pace (FSDP with FP8 all-gather) that is the step's time. This bench times the
host side alone: tiny operands (the GPU finishes each GEMM in a few microseconds), many calls
back to back, one synchronize at the end, so wall time / calls is the CPU's cost per call.

Rows (each the median of ``--repeats`` timings of ``--calls`` calls):
  * ``op``: ``torch.ops.fp8boost.scaled_mm`` (the dispatcher path compiled graphs take);
  * ``mm``: ``fp8boost.fp8.kernels.gemm.mm`` called directly (no dispatcher);
  * ``scaled_mm``: ``torch._scaled_mm`` (cuBLASLt, C++), the baseline torchao uses;
  * ``op_fast`` / ``mm_fast``: the same with fast accumulation (the forward's setting);
  * ``compiled_<path>`` (CUDA, ``--compiled``): one ``torch.compile``d function of
    ``--graph-gemms`` GEMMs, per GEMM: ``dispatch`` (the graph calls ``fp8boost::scaled_mm``,
    the op compiled graphs used until 2026-11-29), ``direct`` (``gemm_direct.compiled_mm``,
    what ``TritonBackend`` runs under compile: kernel chosen at trace time and launched from
    inductor's wrapper, the Triton kernel itself or ``aten._scaled_mm``) and ``scaled_mm``
    (``torch._scaled_mm`` in the graph, torchao's path). ``--kernel triton|cublas`` fixes the
    decision those paths read (at 128^3 the tuner picks cuBLAS).

    python bench/gemm_overhead.py                       # CUDA
    python bench/gemm_overhead.py --compiled            # CUDA, with the compiled-graph rows
    python bench/gemm_overhead.py --device cpu --calls 50   # the reference ops (a smoke run)

Writes JSON (device, versions, date, command, rows) to ``--output``, else $OUT, else
bench/results/gemm_overhead_<date>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import env_info, write_json  # noqa: E402 (bench/ is on sys.path)

E4M3 = torch.float8_e4m3fn


def per_call_us(fn: Callable[[], object], calls: int, repeats: int, sync: Callable[[], None]
                ) -> float:
    """Median over ``repeats`` of (wall time of ``calls`` calls) / calls, in microseconds."""
    for _ in range(max(3, calls // 10)):  # warm-up: tuning, compilation, allocator
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def rows(device: torch.device, size: int, calls: int, repeats: int) -> list[dict]:
    """Every variant this device runs, on one set of ``size`` x ``size`` operands."""
    import fp8boost.fp8.kernels.ops  # noqa: F401  (registers torch.ops.fp8boost)

    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device=device, dtype=E4M3)
    b = torch.randn(size, size, generator=g).to(device=device, dtype=E4M3)
    one = torch.ones((), device=device)
    op = torch.ops.fp8boost.scaled_mm
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    variants: dict[str, Callable[[], object]] = {}
    for fast in (False, True):
        tag = "_fast" if fast else ""
        variants["op" + tag] = (lambda f=fast: op(a, b, one, one, None, torch.bfloat16, f, False))
        if cuda:
            from fp8boost.fp8.kernels import gemm  # lazy: imports triton (CUDA rows only)

            variants["mm" + tag] = (lambda f=fast: gemm.mm(a, b, one, one, None,
                                                          torch.bfloat16, f))
            variants["scaled_mm" + tag] = (lambda f=fast: torch._scaled_mm(
                a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=f))
    with torch.no_grad():  # as compiled graphs call the op: no autograd recording
        return [dict(variant=name, size=size, calls=calls, repeats=repeats,
                     us_per_call=round(per_call_us(fn, calls, repeats, sync), 2))
                for name, fn in variants.items()]


def compiled_rows(size: int, calls: int, repeats: int, gemms: int, fast: bool,
                  kernel: str = "tuned") -> list[dict]:
    """Per-GEMM host cost inside a compiled graph of ``gemms`` GEMMs, by path (CUDA only).

    Both fp8boost ops may choose cuBLAS (``allow_cublas``, as ``TritonBackend`` calls them);
    the row records which kernel the tuner chose for the shape."""
    from fp8boost.fp8.kernels import gemm, gemm_direct  # lazy: triton (CUDA rows only)

    device = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    a = torch.randn(size, size, generator=g).to(device=device, dtype=E4M3)
    bs = [torch.randn(size, size, generator=g).to(device=device, dtype=E4M3)
          for _ in range(gemms)]  # distinct operands: no call is a duplicate the graph drops
    one = torch.ones((), device=device)
    paths = {
        "dispatch": lambda b: torch.ops.fp8boost.scaled_mm(a, b, one, one, None,
                                                           torch.bfloat16, fast, True),
        "direct": lambda b: gemm_direct.compiled_mm(a, b, one, one, None, torch.bfloat16,
                                                    fast, True),
        "scaled_mm": lambda b: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                out_dtype=torch.bfloat16, use_fast_accum=fast),
    }
    if kernel != "tuned":  # the decision every compiled path reads, fixed before tracing
        key, cands = gemm.candidates(a, bs[0], None, torch.bfloat16, fast, True, True)
        gemm._CACHE.best[key] = gemm.CUBLAS if kernel == "cublas" else cands[0]
    out = []
    with torch.no_grad():
        for name, gemm_of in paths.items():
            torch._dynamo.reset()
            graph = torch.compile(lambda bs, f=gemm_of: [f(b) for b in bs], fullgraph=True)
            us = per_call_us(lambda: graph(bs), max(1, calls // gemms), repeats,
                             lambda: torch.cuda.synchronize(device)) / gemms
            out.append(dict(variant="compiled_" + name + ("_fast" if fast else ""), size=size,
                            calls=calls, repeats=repeats, graph_gemms=gemms, kernel=kernel,
                            us_per_call=round(us, 2)))
    for r in out:
        r["tuned"] = {str(k): str(v) for k, v in gemm._CACHE.best.items()
                      if k[2] == size and k[7] == fast}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--size", type=int, default=128, help="M = N = K (small: host-bound)")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", default=None)
    p.add_argument("--compiled", action="store_true",
                   help="CUDA: add the compiled-graph rows (compiled_dispatch/direct/scaled_mm)")
    p.add_argument("--graph-gemms", type=int, default=32,
                   help="GEMMs per compiled graph (--compiled)")
    p.add_argument("--kernel", default="tuned", choices=("tuned", "triton", "cublas"),
                   help="--compiled: the kernel the compiled paths are given (the tuner's "
                   "choice, or the decision fixed to the Triton kernel or to cuBLAS)")
    args = p.parse_args(argv)
    if args.size % 16 or args.size <= 0:
        raise ValueError(f"--size must be a positive multiple of 16 (FP8 GEMM shapes), got "
                         f"{args.size}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a GPU; use --device cpu for a smoke run")
    if args.compiled and args.device != "cuda":
        raise ValueError("--compiled times inductor's CUDA wrapper: it needs --device cuda")
    if args.graph_gemms <= 0:
        raise ValueError(f"--graph-gemms must be positive, got {args.graph_gemms}")
    device = torch.device(args.device)
    argv = sys.argv if argv is None else ["bench/gemm_overhead.py", *argv]
    env = env_info(argv) if device.type == "cuda" else {
        "device": f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python " + " ".join(argv)}
    result = dict(env, benchmark="gemm_overhead", size=args.size,
                  rows=rows(device, args.size, args.calls, args.repeats))
    if args.compiled:
        for fast in (False, True):
            result["rows"] += compiled_rows(args.size, args.calls, args.repeats,
                                            args.graph_gemms, fast, args.kernel)
    for r in result["rows"]:
        print(f"{r['variant']:<14} {r['us_per_call']:9.2f} us/call")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"JSON written to {args.output}")
    else:
        print(f"JSON written to {write_json('gemm_overhead', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
