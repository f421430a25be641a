"""FP8 GEMM benchmark: Triton persistent kernel vs torch._scaled_mm (cuBLASLt) vs BF16 cuBLAS.

All variants run side by side in one process on the same operands. Each timing is the median
of many runs after warm-up (``triton.testing.do_bench``, which also flushes L2 before every
run); operands rotate over enough copies to exceed 2x the L2 size. TFLOP/s = 2*M*N*K / time.

    python bench/gemm.py                 # default sweep (squares 256..16384, Llama shapes, ragged M)
    python bench/gemm.py --quick         # a few shapes

Writes JSON (device, torch/triton versions, date, command, per-shape results and the tuned
config) to $OUT if set, else bench/results/gemm_<date>.json, and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import env_info, write_json  # noqa: E402 (bench/ is on sys.path)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SQUARES = [256, 512, 1024, 2048, 4096, 8192, 16384]
LLAMA = [(8192, 4096, 4096), (8192, 11008, 4096), (8192, 4096, 11008), (8192, 12288, 4096),
         (8190, 4096, 4096), (4096, 4096, 8192)]






def bench(fn, warmup_ms=25, rep_ms=150) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def rotating(make, bytes_each: int, l2_bytes: int) -> list:
    """Enough independent copies of the operands that cycling through them exceeds 2x L2."""
    n = max(1, min(8, -(-2 * l2_bytes // max(bytes_each, 1))))
    return [make() for _ in range(n)]


def cycler(fn_list):
    state = [0]

    def run():
        fn_list[state[0] % len(fn_list)]()
        state[0] += 1

    return run


def bench_shape(m, n, k, l2, precise: bool) -> dict:
    from fp8boost.fp8.kernels import gemm

    one = torch.ones((), device="cuda")
    sa = torch.tensor(0.5, device="cuda")
    sb = torch.tensor(0.25, device="cuda")
    a_dt = E5M2 if precise else E4M3  # promoted accumulation is what dgrad (e5m2 dy) uses

    def make():
        a = torch.randn(m, k, device="cuda").to(a_dt)
        b = torch.randn(n, k, device="cuda").to(E4M3)
        return a, b, a.to(torch.bfloat16) if not precise else None, b.to(torch.bfloat16)

    sets = rotating(make, m * k + n * k, l2)
    fast = not precise
    triton_fns = [lambda s=s: gemm.mm(s[0], s[1], sa, sb, None, torch.bfloat16, fast) for s in sets]
    cublas_fns = [lambda s=s: torch._scaled_mm(s[0], s[1].t(), scale_a=sa, scale_b=sb,
                                               out_dtype=torch.bfloat16, use_fast_accum=fast)
                  for s in sets]
    gemm.mm(sets[0][0], sets[0][1], sa, sb, None, torch.bfloat16, fast)  # tune once, untimed
    flops = 2.0 * m * n * k
    res = {"M": m, "N": n, "K": k, "accum": "promoted" if precise else "fast"}
    t_tri = bench(cycler(triton_fns))
    t_cub = bench(cycler(cublas_fns))
    res.update(triton_ms=t_tri, scaled_mm_ms=t_cub, triton_tflops=flops / t_tri / 1e9,
               scaled_mm_tflops=flops / t_cub / 1e9, triton_vs_scaled_mm=t_cub / t_tri)
    if not precise:
        bf16_fns = [lambda s=s: torch.mm(s[2], s[3].t()) for s in sets]
        t_bf = bench(cycler(bf16_fns))
        res.update(bf16_ms=t_bf, bf16_tflops=flops / t_bf / 1e9, triton_vs_bf16=t_bf / t_tri)
    # Sanity: same operands, two implementations.
    a, b = sets[0][0], sets[0][1]
    ref = (a.float() * sa) @ (b.float() * sb).t()
    for name, out in (("triton", gemm.mm(a, b, sa, sb, None, torch.float32, fast)),
                      ("scaled_mm", torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                                     out_dtype=torch.float32,
                                                     use_fast_accum=fast))):
        res[f"{name}_rel_err_fp32_out"] = ((out - ref).norm() / ref.norm()).item()
    def chosen(allow):
        keys = [k_ for k_ in gemm._CACHE.best if k_[2] == n and k_[3] == k and k_[7] == fast
                and k_[1] == gemm.bucket(m) and k_[9] == allow]
        return str(gemm._CACHE.best[keys[0]]) if keys else None

    res["config"] = chosen(False)
    # What TritonBackend (measured per-shape dispatch, allow_cublas=True) picks for this shape.
    gemm.mm(sets[0][0], sets[0][1], sa, sb, None, torch.bfloat16, fast, allow_cublas=True)
    res["backend_choice"] = chosen(True)
    del one
    return res


def main(argv=None) -> None:
    argv = sys.argv if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="only 4096/8192 squares and 2 Llama shapes")
    p.add_argument("--no-precise", action="store_true", help="skip promoted-accumulation rows")
    args = p.parse_args(argv[1:])
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    shapes = [(s, s, s) for s in ([4096, 8192] if args.quick else SQUARES)]
    shapes += LLAMA[:2] if args.quick else LLAMA
    rows = []
    for (m, n, k) in shapes:
        for precise in ((False,) if args.no_precise else (False, True)):
            if precise and min(m, n, k) < 4096:
                continue
            r = bench_shape(m, n, k, l2, precise)
            rows.append(r)
            print(json.dumps(r), flush=True)
    big = [r for r in rows if min(r["M"], r["N"], r["K"]) >= 4096]
    summary = {
        "min_triton_vs_scaled_mm_fast_ge4096": min(
            (r["triton_vs_scaled_mm"] for r in big if r["accum"] == "fast"), default=None),
        "min_triton_vs_scaled_mm_promoted_ge4096": min(
            (r["triton_vs_scaled_mm"] for r in big if r["accum"] == "promoted"), default=None),
        "triton_vs_bf16_8192cubed": next((r["triton_vs_bf16"] for r in rows if
                                          (r["M"], r["N"], r["K"]) == (8192,) * 3 and
                                          r["accum"] == "fast"), None),
    }
    path = write_json("gemm", {**env_info(argv), "l2_bytes": l2, "rows": rows,
                               "summary": summary})
    print(f"\nwrote {path}\n{'M':>6} {'N':>6} {'K':>6} {'acc':>8} {'triton':>8} {'cublas':>8} "
          f"{'bf16':>7} {'tri/cub':>7} {'tri/bf16':>8} {'backend':>7} config  (TFLOP/s)")
    for r in rows:
        cfg = (r["config"] or "").replace("GemmConfig", "")
        for f in ("block_m=", "block_n=", "block_k=", "group_m=", "stages=", "warps=",
                  "subtile=", "lagged="):
            cfg = cfg.replace(f, "")
        pick = "cublas" if r["backend_choice"] == "cublas" else "triton"
        print(f"{r['M']:>6} {r['N']:>6} {r['K']:>6} {r['accum']:>8} {r['triton_tflops']:8.0f} "
              f"{r['scaled_mm_tflops']:8.0f} {r.get('bf16_tflops', float('nan')):7.0f} "
              f"{r['triton_vs_scaled_mm']:7.3f} {r.get('triton_vs_bf16', float('nan')):8.3f} "
              f"{pick:>7} {cfg}")
    print("summary:", json.dumps(summary))


if __name__ == "__main__":
    main()
