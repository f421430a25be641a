"""Probe (2026-11-29, one H200): the rowwise rows + columns^T cast split into its passes (the
tile amax pass alone, and with the cast pass, per tile config, with and without the transposed
re-read), the blockwise tiles/weight + ^T kernel per warps and re-read, and blockwise tiles +
^T as two launches (rows tiles, then column tiles), all as CUDA graph replays, bit-checked
against the reference. Its findings chose granular_cast's "split" and "colmax" candidates.

Run from the repository root on the GPU machine: ``OUT=... python bench/probes/cast_pass_split.py``;
its output is bench/results/cast_probe_passes_h200_2026-11-29.json.
"""
import os, sys, json
import torch, triton
sys.path.insert(0, os.getcwd())
from fp8boost.fp8.kernels import granular_cast as gc
from fp8boost.fp8.granular import quantize as Q
E4M3 = torch.float8_e4m3fn
KW = {"margin": 0, "power_of_2": False}

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
from cast_granular import timed  # CUDA-graph replays, GRAPH_REPS = 4 rounds, per-call median


def graph_ms(fns):
    return timed(fns, graph=True)

def same(a, b):
    return all(torch.equal(p.data.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(p.inv_scale, q.inv_scale) for p, q in zip(a, b) if q is not None)

out = {}
from fp8boost.fp8.granular.operand import GranularFp8
for (R, C) in ((8192, 4096), (8192, 14336)):
    xs = [torch.randn(R, C, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(3)]
    # rowwise rows + cols^T: amax pass + cast pass, reload on/off
    ref = Q.quantize_operands(xs[0], E4M3, "rowwise", weight=False, cols=True)
    for (br, bc, w) in ((64, 64, 4), (128, 64, 8), (64, 128, 4), (32, 128, 4), (128, 128, 8), (64, 64, 2), (128, 64, 4)):
        for reload in (False, True):
            def run(x, br=br, bc=bc, w=w, reload=reload):
                r, c = x.shape
                ramax = torch.zeros(r, dtype=torch.int32, device="cuda")
                camax = torch.zeros(c, dtype=torch.int32, device="cuda")
                gc._amax_rc_kernel[(triton.cdiv(r, br), triton.cdiv(c, bc))](x, ramax, camax, r, c, x.stride(0), x.stride(1), ROWS=True, COLS=True, IDX64=False, BLOCK_R=br, BLOCK_C=bc, num_warps=w)
                d, i, dt, it = gc._launch_tiles(x, E4M3, 2, True, True, br, bc, w, KW, ramax, camax, reload=reload)
                return GranularFp8(d, i, "row"), GranularFp8(dt, it, "row")
            def amax_only(x, br=br, bc=bc, w=w):
                r, c = x.shape
                ramax = torch.zeros(r, dtype=torch.int32, device="cuda")
                camax = torch.zeros(c, dtype=torch.int32, device="cuda")
                gc._amax_rc_kernel[(triton.cdiv(r, br), triton.cdiv(c, bc))](x, ramax, camax, r, c, x.stride(0), x.stride(1), ROWS=True, COLS=True, IDX64=False, BLOCK_R=br, BLOCK_C=bc, num_warps=w)
            ok = same(run(xs[0]), ref)
            ms = graph_ms([lambda x=x: run(x) for x in xs])
            ms_a = graph_ms([lambda x=x: amax_only(x) for x in xs])
            key = f"{R}x{C} rows+T {br}x{bc} w{w} reload={reload}"
            out[key] = dict(us=ms * 1e3, amax_us=ms_a * 1e3, ok=ok)
            print(f"{key}: {ms*1e3:.1f} us (amax pass {ms_a*1e3:.1f}) ok={ok}", flush=True)
    for weight in (False, True):
        ref = Q.quantize_operands(xs[0], E4M3, "blockwise", weight=weight, cols=True)
        for w in (4, 8, 16, 2):
            if weight and w == 2: continue
            for reload in (False, True):
                def run(x, w=w, reload=reload, weight=weight):
                    d, i, dt, it = gc._launch_tiles(x, E4M3, 1 if weight else 0, True, True, 128, 128, w, KW, reload=reload)
                    k = "block" if weight else "tile"
                    return GranularFp8(d, i, k, 128), GranularFp8(dt, it, k, 128)
                ok = same(run(xs[0]), ref)
                ms = graph_ms([lambda x=x: run(x) for x in xs])
                key = f"{R}x{C} block weight={weight}+T w{w} reload={reload}"
                out[key] = dict(us=ms * 1e3, ok=ok)
                print(f"{key}: {ms*1e3:.1f} us ok={ok}", flush=True)
        # two kernels: rows-only tiles + cols-only with in-tile amax (MODE 0 COLS only, 128 x bc)
        if not weight:
            for (bc, w) in ((64, 4), (32, 4), (64, 8), (128, 8)):
                for reload in (False, True):
                    def run(x, bc=bc, w=w, reload=reload):
                        rq, _ = gc.quantize_operands(x, E4M3, "blockwise", weight=False, config=("rows", 64, 8))
                        _, _, dt, it = gc._launch_tiles(x, E4M3, 0, False, True, 128, bc, w, KW, reload=reload)
                        return rq, GranularFp8(dt, it, "tile", 128)
                    got = run(xs[0])
                    ok = same(got, ref)
                    ms = graph_ms([lambda x=x: run(x) for x in xs])
                    key = f"{R}x{C} tiles+T two-kernel cols 128x{bc} w{w} reload={reload}"
                    out[key] = dict(us=ms * 1e3, ok=ok)
                    print(f"{key}: {ms*1e3:.1f} us ok={ok}", flush=True)
json.dump(out, open(os.environ["OUT"] + "/reload.json", "w"), indent=1)
