"""Fp8Linear fwd+bwd (eager) vs nn.Linear BF16 at M=8192 tokens, backends cublas and triton.

Shapes (K=in, N=out): (4096, 4096), (4096, 11008), (11008, 4096) -- Llama-7B o_proj/q/k/v,
gate/up and down -- and (4096, 12288), Llama-7B's fused QKV. No bias (Llama has none).
One timed step = forward + ``torch.autograd.grad`` w.r.t. input and weight (no grad
accumulation kernels). Fp8Linear runs its default recipe (tensorwise current scaling, e4m3
fwd / e5m2 grads, fast accumulation in fprop only). ``triton`` is TritonBackend as shipped
(per-shape measured dispatch between the Triton GEMM and cuBLAS), ``tritonpure`` forces the
Triton GEMM everywhere; casts are the Triton kernels in both. ``nocache`` rows re-cast the weight every
step (one optimizer step per forward: the honest training cost); ``cache`` rows reuse the cached
weight cast (gradient accumulation / pipeline micro-batches).

Median of many runs after warm-up (``triton.testing.do_bench``), inputs rotating over copies
larger than L2; ``gpu`` columns are the summed kernel time of one step (torch.profiler, CUDA
activity), i.e. the step time without the GPU idling on Python and kernel launches; peak memory = max_memory_allocated during one step minus what was allocated
before it (inputs, weights, and for Fp8 nothing cached beyond the weight cast).

    python bench/linear.py [--quick]

Writes JSON to $OUT if set, else bench/results/linear_<date>.json; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import env_info, write_json  # noqa: E402 (bench/ is on sys.path)

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 12288)]






def make_layer(kind: str, k: int, n: int, base: nn.Linear) -> nn.Module:
    from fp8boost.fp8 import Fp8Config, Fp8Linear

    if kind == "bf16":
        return base
    backend, cache = kind.split("_")
    pure = backend == "tritonpure"  # Triton GEMMs only (no measured cuBLAS dispatch)
    cfg = Fp8Config(backend="triton" if pure else backend, cache_weight_cast=(cache == "cache"))
    layer = Fp8Linear.from_linear(base, cfg)
    if pure:
        from fp8boost.fp8.kernels.backend import TritonBackend

        layer.use_backend(TritonBackend(allow_cublas=False), base.weight.device)
    return layer


def step_fn(layer, x, dy):
    def step():
        y = layer(x)
        torch.autograd.grad(y, (x, layer.weight), dy)
    return step


def bench_layer(layer, xs, dys) -> tuple[float, float]:
    import triton.testing

    steps = [step_fn(layer, x, dy) for x, dy in zip(xs, dys)]
    state = [0]

    def run():
        steps[state[0] % len(steps)]()
        state[0] += 1

    for _ in range(3):
        run()  # compile, tune, fill caches
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    # GPU busy time per step: the sum of kernel durations (profiler/CUPTI) over 10 steps. It
    # excludes the gaps where the GPU waits for Python and kernel launches.
    gpu_ms = float("nan")
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                run()
            torch.cuda.synchronize()
        gpu_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 10 / 1e3
    except Exception as exc:  # noqa: BLE001 (report, don't hide)
        print(f"profiler failed: {exc!r}", flush=True)
    return ms, peak / 2**20, gpu_ms


def main(argv=None) -> None:
    argv = sys.argv if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="first two shapes only")
    p.add_argument("--m", type=int, default=8192, help="tokens per step (rows of x)")
    p.add_argument("--kinds", default="bf16,cublas_nocache,triton_nocache,tritonpure_nocache,"
                   "triton_cache")
    args = p.parse_args(argv[1:])
    kinds = args.kinds.split(",")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for (k, n) in (SHAPES[:2] if args.quick else SHAPES):
        torch.manual_seed(0)
        base = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        nrot = max(1, min(4, -(-2 * l2 // (args.m * k * 2))))
        xs = [torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for _ in range(nrot)]
        dys = [torch.randn(args.m, n, device="cuda", dtype=torch.bfloat16) for _ in range(nrot)]
        row = {"M": args.m, "K": k, "N": n}
        ref_y = base(xs[0]).float()
        for kind in kinds:
            layer = make_layer(kind, k, n, base)
            ms, peak, gpu_ms = bench_layer(layer, xs, dys)
            with torch.no_grad():
                err = ((layer(xs[0]).float() - ref_y).norm() / ref_y.norm()).item()
            row[f"{kind}_ms"], row[f"{kind}_peak_MiB"], row[f"{kind}_fwd_rel_err"] = ms, peak, err
            row[f"{kind}_gpu_ms"] = gpu_ms
        for kind in kinds[1:]:
            row[f"{kind}_speedup_vs_bf16"] = row["bf16_ms"] / row[f"{kind}_ms"]
            row[f"{kind}_gpu_speedup_vs_bf16_gpu"] = row["bf16_gpu_ms"] / row[f"{kind}_gpu_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    path = write_json("linear", {**env_info(argv), "rows": rows})
    print(f"\nwrote {path}\n{'M':>5} {'K':>6} {'N':>6} " +
          " ".join(f"{k_[:14]:>14}" for k_ in kinds) + "   (ms fwd+bwd; speedup vs bf16; peak MiB)")
    for r in rows:
        print(f"{r['M']:>5} {r['K']:>6} {r['N']:>6} " +
              " ".join(f"{r[k_ + '_ms']:14.3f}" for k_ in kinds))
        print(f"{'':>19} " + " ".join(
            f"{r.get(k_ + '_speedup_vs_bf16', 1.0):13.2f}x" for k_ in kinds))
        print(f"{'':>19} " + " ".join(f"{r[k_ + '_peak_MiB']:12.0f}Mi" for k_ in kinds))
        print(f"{'gpu ms':>19} " + " ".join(f"{r[k_ + '_gpu_ms']:14.3f}" for k_ in kinds))
        print(f"{'':>19} " + " ".join(
            f"{r.get(k_ + '_gpu_speedup_vs_bf16_gpu', 1.0):13.2f}x" for k_ in kinds))


if __name__ == "__main__":
    main()
