"""Probe (2026-11-29, one H200): where the transposed casts' time goes. Each variant of a
transposed FP8 cast given column scales (V0: register transpose of the FP8 bytes, as
granular_cast's tile kernel; V1: transposed load; V2: transpose of the BF16 tile; V3: a
uint8 transpose-copy baseline; V4: an int32-packing attempt, wrong bytes, ``ok`` False) per
tile and warps, timed as CUDA graph replays; then the rows-only one-pass configs at 16384
wide and every rows + columns^T and blockwise + ^T candidate of the code of that day
(the chunked "sweeps" kernel, since removed, among them).

Run from the repository root on the GPU machine: ``OUT=... python bench/probes/cast_transpose_variants.py``;
its output is bench/results/cast_probe_transpose_h200_2026-11-29.json. Kept as it ran: with
today's candidate lists its last loops time the present candidates instead.
"""
import json, os, sys, re
import torch, triton, triton.language as tl
sys.path.insert(0, os.getcwd())
from fp8boost.fp8.kernels.cast import fp8_bytes
from fp8boost.fp8.kernels import granular_cast as gc

@triton.jit
def kt(x_ptr, qt_ptr, s_ptr, R, C, sr, sc, fmax, BR: tl.constexpr, BC: tl.constexpr, V: tl.constexpr):
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    offs_r = pr * BR + tl.arange(0, BR)
    offs_c = pc * BC + tl.arange(0, BC)
    in_r = offs_r < R
    in_c = offs_c < C
    mask_t = in_c[:, None] & in_r[None, :]
    mask = in_r[:, None] & in_c[None, :]
    s = tl.load(s_ptr + offs_c, mask=in_c, other=1.0)
    if V == 0:
        x = tl.load(x_ptr + offs_r[:, None] * sr + offs_c[None, :] * sc, mask=mask, other=0.0).to(tl.float32)
        qt = tl.trans(fp8_bytes(x, s[None, :], fmax, tl.float8e4nv, False, 3, -6))
    elif V == 1:
        xt = tl.load(x_ptr + offs_c[:, None] * sc + offs_r[None, :] * sr, mask=mask_t, other=0.0).to(tl.float32)
        qt = fp8_bytes(xt, s[:, None], fmax, tl.float8e4nv, False, 3, -6)
    elif V == 2:
        x = tl.load(x_ptr + offs_r[:, None] * sr + offs_c[None, :] * sc, mask=mask, other=0.0)
        xt = tl.trans(x).to(tl.float32)
        qt = fp8_bytes(xt, s[:, None], fmax, tl.float8e4nv, False, 3, -6)
    elif V == 3:  # uint8 transpose-copy baseline of the fp8 bytes (reads bf16 x's low bytes)
        x = tl.load(x_ptr + offs_r[:, None] * sr + offs_c[None, :] * sc, mask=mask, other=0.0)
        qt = tl.trans(x.to(tl.int16, bitcast=True).to(tl.uint8))
    else:  # V 4: fp8 in load layout, then an explicit layout hop through int32 words
        x = tl.load(x_ptr + offs_r[:, None] * sr + offs_c[None, :] * sc, mask=mask, other=0.0).to(tl.float32)
        q = fp8_bytes(x, s[None, :], fmax, tl.float8e4nv, False, 3, -6)
        q4 = tl.reshape(q.to(tl.int32), (BR // 4, 4, BC))
        q4 = tl.permute(q4, (0, 2, 1))
        a, b = tl.split(tl.reshape(q4, (BR // 4, BC, 2, 2)))
        b0, b1 = tl.split(a)
        b2, b3 = tl.split(b)
        w = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)  # bytes of rows 4k..4k+3 of column c
        wt = tl.trans(w)  # [BC, BR // 4]
        offs_r4 = pr * (BR // 4) + tl.arange(0, BR // 4)
        tl.store(qt_ptr.to(tl.pointer_type(tl.int32)) + offs_c[:, None] * (R // 4) + offs_r4[None, :], wt,
                 mask=in_c[:, None] & (offs_r4 < R // 4)[None, :])
    if V != 4:
        tl.store(qt_ptr + offs_c[:, None] * R + offs_r[None, :], qt, mask=mask_t)


sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
from cast_granular import timed  # CUDA-graph replays, GRAPH_REPS = 4 rounds, per-call median


def graph_ms(fns):
    return timed(fns, graph=True)


out = {}
for (R, C) in ((8192, 4096), (8192, 14336)):
    xs = [torch.randn(R, C, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(3)]
    s = torch.rand(C, device="cuda") * 10 + 1
    qts = [torch.empty(C, R, dtype=torch.uint8, device="cuda") for _ in xs]
    ref = (xs[0].float() * s[None, :]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).t().contiguous()
    nbytes = R * C * 3
    for V in (0, 1, 2, 3, 4):
        for (BR, BC, W) in ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (32, 128, 4), (128, 32, 4), (64, 64, 2)):
            key = f"{R}x{C} V{V} {BR}x{BC} w{W}"
            try:
                fns = [lambda x=x, q=q: kt[(triton.cdiv(R, BR), triton.cdiv(C, BC))](x, q, s, R, C, x.stride(0), x.stride(1), 448.0, BR=BR, BC=BC, V=V, num_warps=W) for x, q in zip(xs, qts)]
                k = kt[(triton.cdiv(R, BR), triton.cdiv(C, BC))](xs[0], qts[0], s, R, C, C, 1, 448.0, BR=BR, BC=BC, V=V, num_warps=W)
                ok = V == 3 or bool((qts[0] == ref).all())
                ms = graph_ms(fns)
                cvt = [ln.strip()[:160] for ln in k.asm["ttgir"].splitlines() if "convert_layout" in ln]
                out[key] = dict(us=ms * 1e3, GBps=nbytes / ms / 1e6, ok=ok, regs=k.n_regs, spills=k.n_spills, cvt=cvt)
                print(f"{key}: {ms*1e3:7.1f} us {nbytes/ms/1e6:6.0f} GB/s ok={ok} regs={k.n_regs} spills={k.n_spills} cvts={len(cvt)}", flush=True)
            except Exception as e:
                print(key, "FAIL", repr(e)[:300], flush=True)
    # torch transpose baseline, bf16
    fns = [lambda x=x: x.t().contiguous() for x in xs]
    ms = graph_ms(fns)
    print(f"{R}x{C} torch bf16 t().contiguous(): {ms*1e3:.1f} us {R*C*4/ms/1e6:.0f} GB/s")
    out[f"{R}x{C} torch_t"] = ms * 1e3
    # rows-only: one pass at 16384 wide
    if C > 8192:
        for cfg in ((1, 16384, 16), (1, 16384, 8), (2, 16384, 16), (4, 1024, 4)):
            try:
                got = gc.rows_only(xs[0], torch.float8_e4m3fn, config=cfg)
                fns = [lambda x=x: gc.rows_only(x, torch.float8_e4m3fn, config=cfg) for x in xs]
                ms = graph_ms(fns)
                print(f"{R}x{C} rows {cfg}: {ms*1e3:.1f} us {R*C*3/ms/1e6:.0f} GB/s", flush=True)
                out[f"{R}x{C} rows {cfg}"] = ms * 1e3
            except Exception as e:
                print(cfg, "FAIL", repr(e)[:300])
    for cfg in gc.rows_cols_configs(C):
        fns = [lambda x=x: gc.quantize_operands(x, torch.float8_e4m3fn, "rowwise", weight=False, cols=True, config=cfg) for x in xs]
        ms = graph_ms(fns)
        print(f"{R}x{C} rows+T {cfg}: {ms*1e3:.1f} us", flush=True)
        out[f"{R}x{C} rows+T {cfg}"] = ms * 1e3
    for weight in (False, True):
        for cfg in gc.tile_configs(128, weight, True, True):
            fns = [lambda x=x: gc.quantize_operands(x, torch.float8_e4m3fn, "blockwise", weight=weight, cols=True, config=cfg) for x in xs]
            ms = graph_ms(fns)
            print(f"{R}x{C} block w={weight}+T {cfg}: {ms*1e3:.1f} us", flush=True)
            out[f"{R}x{C} block w={weight} +T {cfg}"] = ms * 1e3
    # dump one ttgir of the current rowwise cast pass for reading
json.dump(out, open(os.environ["OUT"] + "/trans.json", "w"), indent=1)
