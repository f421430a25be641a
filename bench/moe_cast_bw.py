"""Bandwidth of each FP8 expert cast on its own (issue 34, item 2: >= 70% of HBM bandwidth).

For the Mixtral-8x7B and Qwen3-30B-A3B expert shapes at T tokens, every operand the three
grouped GEMMs of one training step need, cast by the fused Triton kernels
(``fp8boost.fp8.moe.quantize`` under ``backend="scaled_grouped_mm"``):

* token operands ``x`` / ``dy`` with their transposed per-(expert, column) copies, in one call,
  by the tiled kernels (no offsets) and the segmented ones (the routing's offsets, what
  training runs);
* expert weights: the rows operand (forward) and ``W^T`` (input gradient: the column-maxima
  pass, then the transposed cast, :mod:`fp8boost.fp8.kernels.moe_weight_cast`).

Bytes are the floor: the input read once (BF16) and each FP8 layout written once (+ scales);
GB/s = bytes / median time. ``--peak-gbps`` (default: the GPU's HBM peak, :data:`PEAK_GBPS`
by device name: H100 SXM 3350, H200 4800) gives the fraction.

    python3 bench/moe_cast_bw.py [--tokens 8192] [--output bench/results/moe_cast_bw.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench, env_info  # noqa: E402

# (name, E, top-k, hidden, expert width)
SHAPES = (("mixtral_8x7b", 8, 2, 4096, 14336), ("qwen3_30b_a3b", 128, 8, 2048, 768))
GPU = "scaled_grouped_mm"


def cells(name, e, k, h, i, t):
    from fp8boost.fp8.moe import quantize as Q
    from fp8boost.fp8.moe.routing import route

    idx = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)])
    r = route(idx, e)
    so = Q.ScaleOptions(power_of_2=True)
    dt = so.fwd_dtype
    out = []
    for what, width in (("x gate_up", h), ("h down", i), ("dy gate_up", 2 * i),
                        ("dy down", h)):
        x = torch.zeros(r.rows, width, device="cuda", dtype=torch.bfloat16)
        x[r.pos] = torch.randn(t * k, width, device="cuda").bfloat16()
        nbytes = r.rows * width * (2 + 1 + 1) + (r.rows + e * width) * 4
        for how, off in (("tiled", None), ("segmented", r.offsets)):
            ms = bench(lambda: Q.quantize_tokens_and_groups_t(
                x, r.group, e, dt, so, backend=GPU, offsets=off))
            out.append(dict(shape=name, operand=f"{what} + ^T", kernels=how, ms=ms,
                            gbytes=nbytes / 1e9))
        del x
    for what, n_out, k_in in (("W gate_up", 2 * i, h), ("W down", h, i)):
        w = (torch.randn(e, n_out, k_in, device="cuda") * 0.02).bfloat16()
        for tr, label in ((False, "rows"), (True, "^T")):
            ms = bench(lambda: Q.quantize_experts(w, so, transpose=tr, backend=GPU))
            nbytes = w.numel() * 3 + e * (k_in if tr else n_out) * 4
            out.append(dict(shape=name, operand=f"{what} {label}", kernels="colmax+cast" if tr
                            else "rows", ms=ms, gbytes=nbytes / 1e9))
        del w
    return out


PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0}


def default_peak() -> float:
    """The HBM peak of this GPU by name (H100 SXM's when the name is not in PEAK_GBPS)."""
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_GBPS.items() if k in name), PEAK_GBPS["H100"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--peak-gbps", type=float, default=None,
                    help="HBM peak for the fraction (default: by GPU name)")
    ap.add_argument("--output", default="bench/results/moe_cast_bw.json")
    args = ap.parse_args()
    if args.peak_gbps is None:
        args.peak_gbps = default_peak()
    rows = []
    for shape in SHAPES:
        rows += cells(*shape, args.tokens)
        torch.cuda.empty_cache()
    print(f"{'shape':>14} {'operand':>18} {'kernels':>10} {'ms':>7} {'GB/s':>6} {'% peak':>6}")
    for r in rows:
        r["gbps"] = r["gbytes"] / (r["ms"] * 1e-3)
        r["fraction_of_peak"] = r["gbps"] / args.peak_gbps
        print(f"{r['shape']:>14} {r['operand']:>18} {r['kernels']:>10} {r['ms']:7.3f} "
              f"{r['gbps']:6.0f} {100 * r['fraction_of_peak']:6.1f}")
    # The tile configs each size class timed (next tuning lists keep the winners).
    from fp8boost.fp8.kernels import granular_cast, moe_seg_cast, moe_weight_cast

    tuned = {f"{cache.name} {key}": [(list(cfg), round(ms, 4)) for cfg, ms in t]
             for cache in (moe_seg_cast._CACHE, granular_cast._ROWS_CACHE,
                           moe_weight_cast._COLMAX_CACHE, moe_weight_cast._T_CACHE)
             for key, t in cache.timings.items()}
    for k, t in tuned.items():
        print(f"tuned {k}: " + ", ".join(f"{cfg} {ms:.3f}" for cfg, ms in t))
    res = dict(env_info(sys.argv), tokens=args.tokens, peak_gbps=args.peak_gbps, cells=rows,
               tuned=tuned)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(res, f, indent=1)
    print("JSON:", args.output)


if __name__ == "__main__":
    main()
