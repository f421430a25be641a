"""Rowwise/blockwise FP8 casts: the Triton kernels (``fp8boost.fp8.kernels.granular_cast``)
vs the torch reference in eager mode (``fp8boost.fp8.granular.quantize``), vs the memory floor.

Layouts (``quantize_operands`` arguments): blockwise activation tiles + transposed tiles
(``weight=False, rows, cols``), blockwise weight blocks + transpose, rowwise rows only, rowwise
rows + transposed cols. Bytes counted = the fewest the operation must move:

    R*C*in_bytes (read x once) + R*C per FP8 operand written + 4 bytes per scale written

GB/s = those bytes / median time; ``pct_hbm`` compares with the H100's ~3.35 TB/s HBM peak
(``--peak-gbps`` for another device) and ``x_floor`` with the copy bandwidth measured here
(``dst.copy_(src)`` on 1 GiB, read + write). The blockwise kernels read x once, so they can
approach the floor; the rowwise ones read it twice (amax pass, cast pass), by design.

Two more columns, under ``torch.compile`` (``--no-compiled`` leaves them out): ``compiled``, the
reference ops compiled alone (what a compiled training step runs: the Triton kernels are eager
only), and ``fused``, the extra time the cast adds when inductor fuses it into its producer, an
RMSNorm (``rms_norm(x) -> cast`` minus ``rms_norm(x)`` alone, both compiled; its GB/s counts only
the FP8 bytes and scales written, the read of x being the norm's). The compiled results are
compared with the eager reference too (``compiled_bit_exact``, and ``compiled_vs_eager``: the
fraction of FP8 bytes that differ, the largest relative difference of the scales). On CPU they
are bit-exact; on an H200 they are not: a scale can be 1 ulp off and 0.005-0.03% of the bytes
one FP8 step apart (likely cause, not verified: inductor's Triton code divides with Triton's
default FP32 division, which is not correctly rounded; our kernels use ``div_rn``).

Timings: median of many runs (``triton.testing.do_bench``, L2 flushed before each run; inputs
rotate over copies exceeding 2x L2), after a warm-up call; eager launches, as a training step
without torch.compile makes them. Each Triton result is checked bit-exact against the
reference on this device first (NaN bytes compared as NaN). ``--graph`` times the Triton and
compiled casts as CUDA graph replays instead: the kernels' own time, without the Python launch
cost that dominates an eager call at these sizes.

    python bench/cast_granular.py [--quick] [--graph] [--peak-gbps 3350]

Writes JSON to $OUT if set, else bench/results/cast_granular_<date>.json; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import env_info, write_json  # noqa: E402 (bench/ is on sys.path)

E4M3 = torch.float8_e4m3fn
# (name, recipe, weight, rows, cols)
LAYOUTS = [("block_tiles+T", "blockwise", False, True, True),
           ("block_weight+T", "blockwise", True, True, True),
           ("block_tiles", "blockwise", False, True, False),
           ("row_rows", "rowwise", False, True, False),
           ("row_rows+T", "rowwise", False, True, True)]
# 125M Llama (d 768, MLP 2048; 8 x 1024 tokens) activations and weights, and a larger shape.
SHAPES = [(8192, 768), (8192, 2048), (2048, 768), (768, 768), (8192, 4096)]
QUICK_SHAPES = [(8192, 768), (8192, 4096)]
GRAPH_REPS = 4  # rounds over the rotating inputs per captured graph (--graph)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    import triton.testing

    src = torch.randn(256 * 1024 * 1024, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def timed(fns, graph: bool = False) -> float:
    """Median ms per call over rotating inputs (do_bench: warm-up, then many timed runs).

    ``graph``: the calls are captured once into a CUDA graph (``GRAPH_REPS`` rounds over the
    inputs) and the replays timed, so the figure is the kernels' time alone: eager launches
    from Python cost 25-100 us a call on the lent machines, more than these kernels take.
    """
    import triton.testing

    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm (tuning, compilation) outside the capture
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(GRAPH_REPS):
                for fn in fns:
                    fn()
        ms = triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median")
        return ms / (GRAPH_REPS * len(fns))
    state = [0]

    def run():
        fns[state[0] % len(fns)]()
        state[0] += 1

    return triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")


def min_bytes(R, C, in_bytes, recipe, weight, rows, cols, block=128) -> int:
    """Read x once, write each FP8 operand once, write its scales."""
    nbytes = R * C * in_bytes + R * C * (int(rows) + int(cols))
    tr, tc = -(-R // block), -(-C // block)
    if recipe == "rowwise":
        scales = R * rows + C * cols
    elif weight:
        scales = tr * tc * (int(rows) + int(cols))
    else:
        scales = R * tc * rows + C * tr * cols
    return nbytes + 4 * scales


def same(a, b) -> bool:
    """Bit-identical casts (NaN bytes compared as NaN)."""
    d = differences(a, b)
    return d["data_frac"] == 0.0 and d["inv_scale_max_rel"] == 0.0


def differences(a, b) -> dict:
    """How far two casts of one input differ: the fraction of FP8 bytes that differ (NaN bytes
    compared as NaN) and the largest relative difference of their ``inv_scale``."""
    if a is None or b is None:
        return {"data_frac": float(a is not b), "inv_scale_max_rel": 0.0}
    ua, ub = a.data.view(torch.uint8).clone(), b.data.view(torch.uint8).clone()
    ua[a.data.float().isnan()] = 0x7F
    ub[b.data.float().isnan()] = 0x7F
    sa, sb = a.inv_scale.nan_to_num(7.0).double(), b.inv_scale.nan_to_num(7.0).double()
    rel = ((sa - sb).abs() / sb.abs().clamp_min(1e-300)).max().item() if sa.numel() else 0.0
    return {"data_frac": (ua != ub).double().mean().item(), "inv_scale_max_rel": rel}


def compiled_casts(recipe: str, kw: dict):
    """``(cast, norm_then_cast, norm)``, each ``torch.compile``d: the reference cast alone, the
    cast fused after an RMSNorm (its producer in a decoder layer), and the norm alone."""
    from fp8boost.fp8.granular.quantize import quantize_operands

    def cast(x):
        return quantize_operands(x, E4M3, recipe, **kw)

    def norm(x, w):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6)

    def norm_then_cast(x, w):
        return quantize_operands(norm(x, w), E4M3, recipe, **kw)

    return (torch.compile(cast, dynamic=False), torch.compile(norm_then_cast, dynamic=False),
            torch.compile(norm, dynamic=False))


def bench_case(R, C, layout, bw, peak, l2, compiled=True, graph=False) -> dict:
    from fp8boost.fp8.granular.quantize import quantize_operands

    name, recipe, weight, rows, cols = layout
    n = max(1, min(8, -(-2 * l2 // (R * C * 2))))
    xs = [torch.randn(R, C, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(n)]
    kw = dict(weight=weight, rows=rows, cols=cols)
    variants = {
        "triton": [lambda x=x: quantize_operands(x, E4M3, recipe, backend="triton", **kw)
                   for x in xs],
        "torch_eager": [lambda x=x: quantize_operands(x, E4M3, recipe, **kw) for x in xs],
    }
    ref = variants["torch_eager"][0]()
    exact = all(same(g, r) for g, r in zip(variants["triton"][0](), ref))
    nbytes = min_bytes(R, C, 2, recipe, weight, rows, cols)
    floor_ms = nbytes / bw * 1e3
    res = {"layout": name, "R": R, "C": C, "bytes": nbytes, "floor_ms": floor_ms,
           "bit_exact": exact, "timing": "cuda_graph" if graph else "eager_launch"}
    torch.cuda.synchronize()
    for tag, fns in variants.items():
        # the torch reference column is the eager baseline: always eager launches
        res.update(rate(tag, timed(fns, graph and tag == "triton"), nbytes, floor_ms, peak))
    # The eager columns are timed before anything is compiled in this case, and each case
    # starts dynamo afresh: one code object compiled for every layout and shape otherwise
    # reaches dynamo's recompile limit after 8 cases and silently runs eager (the first GPU
    # run, 2026-11-29, timed "compiled" at torch-eager speed that way).
    if compiled:
        torch._dynamo.reset()
        cast, norm_then_cast, norm = compiled_casts(recipe, kw)
        fns = [lambda x=x: cast(x) for x in xs]
        got = fns[0]()
        res["compiled_bit_exact"] = all(same(g, r) for g, r in zip(got, ref))
        res["compiled_vs_eager"] = [differences(g, r) for g, r in zip(got, ref)]
        torch.cuda.synchronize()
        res.update(rate("compiled", timed(fns, graph), nbytes, floor_ms, peak))
    res["speedup"] = res["torch_eager_ms"] / res["triton_ms"]
    if compiled:
        res.update(fused_extra(xs, norm_then_cast, norm, nbytes - R * C * 2, graph))
    return res


def rate(tag: str, ms: float, nbytes: int, floor_ms: float, peak: float) -> dict:
    """``<tag>_ms``, ``_GBps``, ``_pct_hbm`` (of ``peak`` GB/s) and ``_x_floor`` of one timing."""
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {f"{tag}_ms": ms, f"{tag}_GBps": gbps, f"{tag}_pct_hbm": 100 * gbps / peak,
            f"{tag}_x_floor": ms / floor_ms}


def fused_extra(xs, norm_then_cast, norm, written: int, graph: bool = False) -> dict:
    """The cast's extra time when fused after its producer (compiled), and the GB/s of what it
    adds: ``written`` bytes (FP8 operands and scales; the norm reads x either way)."""
    w = torch.ones(xs[0].shape[-1], device=xs[0].device, dtype=xs[0].dtype)
    both = timed([lambda x=x: norm_then_cast(x, w) for x in xs], graph)
    alone = timed([lambda x=x: norm(x, w) for x in xs], graph)
    extra = max(both - alone, 1e-6)
    return {"norm_ms": alone, "norm_cast_ms": both, "fused_extra_ms": extra,
            "fused_extra_GBps": written / (extra * 1e-3) / 1e9}


def parse_shapes(text: str) -> list:
    """``"1024x128256,8192x4096"`` as ``[(1024, 128256), (8192, 4096)]``."""
    try:
        shapes = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise SystemExit(f"--shapes: expected RxC[,RxC...], got {text!r}")
    return shapes


def tuning_timings() -> dict:
    """Per cast kernel and size class: each candidate config's timed ms (the pick is the
    fastest), as the kernels' tuning caches measured them in this process."""
    from fp8boost.fp8.kernels import granular_cast as gc

    return {cache.name: {str(key): [(str(cfg), ms) for cfg, ms in results]
                         for key, results in cache.timings.items()}
            for cache in (gc._ROWS_CACHE, gc._RC_CACHE, gc._TILE_CACHE)}


def main(argv=None) -> None:
    argv = sys.argv if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="two shapes only")
    p.add_argument("--peak-gbps", type=float, default=3350.0, help="HBM peak (H100 SXM: 3350)")
    p.add_argument("--no-compiled", action="store_true",
                   help="leave out the torch.compile columns (compiled, fused into a norm)")
    p.add_argument("--shapes", default=None,
                   help="comma-separated RxC shapes instead of the default ones, e.g. "
                        "1024x128256 (an lm_head chunk's logit gradient)")
    p.add_argument("--graph", action="store_true",
                   help="time the Triton and compiled casts as CUDA graph replays (kernel time "
                        "without Python's launch cost; the torch eager column stays eager)")
    args = p.parse_args(argv[1:])
    bw = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    out = []
    shapes = parse_shapes(args.shapes) if args.shapes else QUICK_SHAPES if args.quick else SHAPES
    for (R, C) in shapes:
        for layout in LAYOUTS:
            r = bench_case(R, C, layout, bw, args.peak_gbps, l2, compiled=not args.no_compiled,
                           graph=args.graph)
            out.append(r)
            print(json.dumps(r), flush=True)
    payload = {**env_info(argv), "copy_bandwidth_GBps": bw / 1e9, "peak_GBps": args.peak_gbps,
               "l2_bytes": l2, "rows": out, "tuning": tuning_timings()}
    path = write_json("cast_granular", payload)
    print(f"\nwrote {path}\ncopy bandwidth {bw / 1e9:.0f} GB/s (read+write), "
          f"peak {args.peak_gbps:.0f} GB/s")
    print(f"{'layout':>15} {'R':>6} {'C':>6} {'floor_us':>8} {'tri_us':>7} {'GB/s':>6} "
          f"{'%hbm':>5} {'torch_us':>8} {'GB/s':>6} {'speedup':>7} {'exact':>5} "
          f"{'comp_us':>7} {'GB/s':>6} {'fused+us':>8} {'GB/s':>6}")
    for r in out:
        print(f"{r['layout']:>15} {r['R']:>6} {r['C']:>6} {r['floor_ms'] * 1e3:8.1f} "
              f"{r['triton_ms'] * 1e3:7.1f} {r['triton_GBps']:6.0f} {r['triton_pct_hbm']:5.1f} "
              f"{r['torch_eager_ms'] * 1e3:8.1f} {r['torch_eager_GBps']:6.0f} "
              f"{r['speedup']:7.2f} {str(r['bit_exact']):>5} " + (
                  f"{r['compiled_ms'] * 1e3:7.1f} {r['compiled_GBps']:6.0f} "
                  f"{r['fused_extra_ms'] * 1e3:8.1f} {r['fused_extra_GBps']:6.0f}"
                  if "compiled_ms" in r else ""))


if __name__ == "__main__":
    main()
