"""MoE expert GEMMs: FP8 grouped (torch._scaled_grouped_mm, rowwise) vs BF16 torch._grouped_mm.

Shapes (E experts, top-k, hidden h, expert width i) like Qwen3-30B-A3B (128, 8, 2048, 768) and
Mixtral-8x7B (8, 2, 4096, 14336), at several token counts T, with balanced routing (equal tokens
per expert: S = T*k rows, S/E each), the two projections of an expert MLP: gate_up (K = h,
N = 2i) and down (K = i, N = h). Per projection:

* ``bf16``: ``torch._grouped_mm`` on BF16 operands (the baseline: transformers' grouped_mm);
* ``fp8_gemm``: ``torch._scaled_grouped_mm`` on operands already in FP8 (the GEMM alone,
  fast accumulation), and ``fp8_wgrad_gemm`` / ``bf16_wgrad``: the weight-gradient form
  (2-D x 2-D over each expert's tokens);
* ``fp8_fprop``: fp8boost's forward with its casts (``grouped_linear`` under no_grad: per-token
  and per-expert-row quantization, the GEMM, masking of the rows past the groups);
* ``fp8_train`` / ``bf16_train``: forward + backward of one projection (three GEMMs each).

``fp8_fprop`` and ``fp8_train`` run with the fused Triton casts
(``fp8boost.fp8.kernels.moe_cast``, what ``scaled_grouped_mm`` takes in eager mode);
``fp8_fprop_torchcast`` / ``fp8_train_torchcast`` force the torch-op casts (the path before the
kernels), and ``casts_*_ms`` time the casts alone (forward: x rowwise, W per expert row, x^T per
(expert, column); backward: dy rowwise, W^T per (expert, k), dy^T per (expert, column); the
``fused`` forward/backward also give the one-call x + x^T cast of
``quantize_tokens_and_groups_t``).

TFLOP/s = 2*S*N*K / time per GEMM (x3 for the train rows). Each time is the median of many
runs after warm-up (``triton.testing.do_bench``).

    python bench/moe_gemm.py            # both shapes, T in 2048 4096 8192 16384
    python bench/moe_gemm.py --quick    # T = 4096 and 8192

Writes JSON (device, versions, date, command, rows) to $OUT if set, else bench/results/
moe_gemm_<date>.json, and prints a table last.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import bench, env_info, write_json  # noqa: E402 (bench/ is on sys.path)

SHAPES = {"qwen3_30b_a3b": (128, 8, 2048, 768), "mixtral_8x7b": (8, 2, 4096, 14336)}
TOKENS = (2048, 4096, 8192, 16384)


@contextlib.contextmanager
def torch_casts():
    """The expert casts in torch ops even under ``scaled_grouped_mm`` (the pre-kernel path)."""
    from fp8boost.fp8.moe import quantize as Q

    saved = Q.FUSED_BACKENDS
    Q.FUSED_BACKENDS = ()
    try:
        yield
    finally:
        Q.FUSED_BACKENDS = saved


def cast_times(x, dy, w, r, so, backend) -> dict:
    """Milliseconds of one projection's forward and backward casts under ``backend``."""
    from fp8boost.fp8.moe import quantize as Q

    e, b = r.num_experts, backend

    def fwd():
        Q.quantize_tokens(x, so.fwd_dtype, so, backend=b)
        Q.quantize_experts(w, so, backend=b)
        Q.quantize_groups_t(x, r.group, e, so.fwd_dtype, so, backend=b, offsets=r.offsets)

    def bwd():
        Q.quantize_tokens(dy, so.grad_dtype, so, backend=b)
        Q.quantize_experts(w, so, transpose=True, backend=b)
        Q.quantize_groups_t(dy, r.group, e, so.grad_dtype, so, backend=b, offsets=r.offsets)

    def fwd_fused():  # x and x^T in one call: what grouped_linear could use
        Q.quantize_tokens_and_groups_t(x, r.group, e, so.fwd_dtype, so, backend=b, offsets=r.offsets)
        Q.quantize_experts(w, so, backend=b)

    def bwd_fused():
        Q.quantize_tokens_and_groups_t(dy, r.group, e, so.grad_dtype, so, backend=b, offsets=r.offsets)
        Q.quantize_experts(w, so, transpose=True, backend=b)

    return {"fwd": bench(fwd), "bwd": bench(bwd), "fwd_fused": bench(fwd_fused),
            "bwd_fused": bench(bwd_fused)}


def bf16_rows(e: int, s: int):
    offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * (s // e)
    return offs


def projection(e, k, t, n_out, k_in, gemms_only: bool = False) -> dict:
    """Every variant for one projection W [E, N, K] at T tokens (``gemms_only``: the GEMMs on
    FP8 operands, torch's and each Triton config, without the casts and training rows)."""
    from fp8boost.fp8.moe import GroupedOptions, grouped_linear, route
    from fp8boost.fp8.moe.gemm import scaled_mm, scaled_mm_wgrad
    from fp8boost.fp8.moe.quantize import (ScaleOptions, quantize_experts, quantize_groups_t,
                                           quantize_tokens)

    s = t * k
    idx = (torch.arange(s, device="cuda") % e).view(t, k)  # balanced: S/E rows per expert
    r = route(idx, e)
    w = (torch.randn(e, n_out, k_in, device="cuda") * 0.02).bfloat16()
    x = torch.zeros(r.rows, k_in, device="cuda", dtype=torch.bfloat16)
    x[r.pos] = torch.randn(s, k_in, device="cuda").bfloat16()
    dy = torch.zeros(r.rows, n_out, device="cuda", dtype=torch.bfloat16)
    dy[r.pos] = torch.randn(s, n_out, device="cuda").bfloat16()
    so = ScaleOptions(power_of_2=True)
    opts = GroupedOptions(so, "scaled_grouped_mm")
    xq, xi = quantize_tokens(x, so.fwd_dtype, so)
    wq, wi = quantize_experts(w, so)
    dyt, dyti = quantize_groups_t(dy, r.group, e, so.grad_dtype, so)
    xt, xti = quantize_groups_t(x, r.group, e, so.fwd_dtype, so)
    # BF16 baseline on exactly S rows (no padding: its best case).
    offs = bf16_rows(e, s)
    xb, dyb = x[r.pos].contiguous(), dy[r.pos].contiguous()
    flops = 2.0 * s * n_out * k_in
    res = {"E": e, "top_k": k, "T": t, "S": s, "N": n_out, "K": k_in}

    def tf(ms, gemms=1):
        return gemms * flops / (ms * 1e-3) / 1e12

    res["bf16_tflops"] = tf(bench(lambda: torch._grouped_mm(xb, w.transpose(-2, -1),
                                                            offs=offs)))
    res["fp8_gemm_tflops"] = tf(bench(lambda: scaled_mm(xq, xi, wq, wi, r.offsets, True)))
    res["bf16_wgrad_tflops"] = tf(bench(lambda: torch._grouped_mm(dyb.t(), xb, offs=offs)))
    res["fp8_wgrad_gemm_tflops"] = tf(bench(
        lambda: scaled_mm_wgrad(dyt, dyti, xt, xti, r.offsets, False)))
    # The wgrad op above runs the faster of torch's kernel and fp8boost's Triton K-grouped
    # kernel (fp8boost.fp8.kernels.grouped_wgrad); each on its own:
    from fp8boost.fp8.kernels import grouped_wgrad as gw

    res["fp8_wgrad_torch_tflops"] = tf(bench(lambda: torch._scaled_grouped_mm(
        dyt, xt.t(), dyti.reshape(-1), xti.reshape(-1), offs=r.offsets,
        out_dtype=torch.bfloat16)))
    res["fp8_wgrad_triton_tflops"] = {str(tuple(c)): tf(bench(lambda: gw.triton_wgrad(
        dyt, dyti, xt, xti, r.offsets, False, c))) for c in gw.CONFIGS}
    # The same without the expert slices (one program per output tile; the default fills the
    # SMs, gw.expert_split).
    res["fp8_wgrad_triton_nosplit_tflops"] = {str(tuple(c)): tf(bench(lambda: gw.triton_wgrad(
        dyt, dyti, xt, xti, r.offsets, False, c, 1))) for c in gw.CONFIGS}
    torch_wgrad = torch._scaled_grouped_mm(dyt, xt.t(), dyti.reshape(-1), xti.reshape(-1),
                                           offs=r.offsets, out_dtype=torch.bfloat16).float()
    res["fp8_wgrad_triton_rel_err_vs_torch"] = max(
        ((gw.triton_wgrad(dyt, dyti, xt, xti, r.offsets, False, c).float() - torch_wgrad).norm()
         / torch_wgrad.norm()).item() for c in gw.CONFIGS)
    # Fast accumulation in the gradient GEMMs (off by default: Fp8Config.fast_accum_*).
    res["fp8_wgrad_gemm_fast_tflops"] = tf(bench(
        lambda: scaled_mm_wgrad(dyt, dyti, xt, xti, r.offsets, True)))
    dyq, dyi = quantize_tokens(dy, so.grad_dtype, so)
    wtq, wti = quantize_experts(w, so, transpose=True)
    dgrad_flops = 2.0 * s * n_out * k_in  # dx = dy . W: the same FLOPs as fprop
    res["fp8_dgrad_gemm_tflops"] = dgrad_flops / (bench(
        lambda: scaled_mm(dyq, dyi, wtq, wti, r.offsets, False)) * 1e-3) / 1e12
    res["fp8_dgrad_gemm_fast_tflops"] = dgrad_flops / (bench(
        lambda: scaled_mm(dyq, dyi, wtq, wti, r.offsets, True)) * 1e-3) / 1e12
    res["bf16_dgrad_tflops"] = tf(bench(lambda: torch._grouped_mm(dyb, w, offs=offs)))
    # dgrad (promoted accumulation) on torch's kernel alone and on each Triton config (the op
    # above runs the faster: fp8boost.fp8.kernels.grouped_mm).
    from fp8boost.fp8.kernels import grouped_mm as gm

    res["fp8_dgrad_torch_tflops"] = tf(bench(lambda: torch._scaled_grouped_mm(
        dyq, wtq.transpose(-2, -1), dyi, wti, offs=r.offsets, out_dtype=torch.bfloat16)))
    res["fp8_dgrad_triton_tflops"] = {str(tuple(c)): tf(bench(lambda: gm.triton_mm(
        dyq, dyi, wtq, wti, r.offsets, False, c))) for c in gm.CONFIGS}
    if gemms_only:
        return res
    with torch.no_grad():
        res["fp8_fprop_tflops"] = tf(bench(lambda: grouped_linear(x, w, r, opts)))
    wg = w.clone().requires_grad_()
    xg, xbg = x.clone().requires_grad_(), xb.clone().requires_grad_()

    def fp8_train():
        grouped_linear(xg, wg, r, opts).backward(dy)

    def bf16_train():
        torch._grouped_mm(xbg, wg.transpose(-2, -1), offs=offs).backward(dyb)

    res["fp8_train_tflops"] = tf(bench(fp8_train), 3)
    with torch_casts():
        with torch.no_grad():
            res["fp8_fprop_torchcast_tflops"] = tf(bench(lambda: grouped_linear(x, w, r, opts)))
        res["fp8_train_torchcast_tflops"] = tf(bench(fp8_train), 3)
    for name, backend in (("torch", None), ("triton", "scaled_grouped_mm")):
        for part, ms in cast_times(x, dy, w, r, so, backend).items():
            res[f"casts_{part}_{name}_ms"] = ms
    # The fused casts' bandwidth: each operand read once (BF16) and every FP8 layout written
    # once (x: x and x^T; W: one layout per pass), over the time of the fused calls.
    rows, wn = r.rows, e * n_out * k_in
    fwd_bytes = rows * k_in * (2 + 1 + 1) + wn * (2 + 1)
    bwd_bytes = rows * n_out * (2 + 1 + 1) + wn * (2 + 1)
    for part, nbytes in (("fwd_fused", fwd_bytes), ("bwd_fused", bwd_bytes)):
        res[f"casts_{part}_triton_gbps"] = nbytes / (res[f"casts_{part}_triton_ms"] * 1e-3) / 1e9
    try:
        res["bf16_train_tflops"] = tf(bench(bf16_train), 3)
    except RuntimeError as exc:  # no autograd formula for _grouped_mm in this torch
        res["bf16_train_tflops"] = None
        res["bf16_train_error"] = str(exc)[:200]
    for a, b in (("fp8_gemm", "bf16"), ("fp8_wgrad_gemm", "bf16_wgrad"),
                 ("fp8_wgrad_gemm_fast", "bf16_wgrad"), ("fp8_dgrad_gemm", "bf16_dgrad"),
                 ("fp8_dgrad_gemm_fast", "bf16_dgrad"),
                 ("fp8_fprop", "bf16"), ("fp8_train", "bf16_train"),
                 ("fp8_fprop_torchcast", "bf16"), ("fp8_train_torchcast", "bf16_train")):
        if res.get(f"{b}_tflops"):
            res[f"{a}_vs_{b}"] = res[f"{a}_tflops"] / res[f"{b}_tflops"]
    return res


def main(argv=None) -> None:
    argv = sys.argv if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="T = 4096 and 8192 only")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--gemms-only", action="store_true",
                   help="the grouped GEMMs on FP8 operands only (torch's and each Triton "
                        "config), no casts or training rows")
    args = p.parse_args(argv[1:])
    from fp8boost.fp8 import Fp8Config
    from fp8boost.fp8.moe.gemm import probe_problem, resolve_backend

    why = probe_problem(torch.device("cuda"))
    if why is not None:
        raise SystemExit(f"torch._scaled_grouped_mm unusable here: {why}")
    assert resolve_backend(Fp8Config(), torch.device("cuda")) == "scaled_grouped_mm"
    from fp8boost.fp8.moe import quantize as Q

    why = Q.fused_path_problem(torch.device("cuda"))
    if why is not None:
        print(f"WARNING: the fused Triton casts are not taken here ({why}): the 'fused' "
              "columns measure the torch-op casts too", flush=True)
    rows = []
    for name in args.shapes:
        e, k, h, i = SHAPES[name]
        for t in ((4096, 8192) if args.quick else TOKENS):
            for proj, (n_out, k_in) in (("gate_up", (2 * i, h)), ("down", (h, i))):
                r = {"shape": name, "proj": proj,
                     **projection(e, k, t, n_out, k_in, args.gemms_only)}
                rows.append(r)
                print(json.dumps(r), flush=True)
                torch.cuda.empty_cache()
    path = write_json("moe_gemm", {**env_info(argv), "rows": rows})
    print(f"\nwrote {path}")
    (print_gemm_table if args.gemms_only else print_tables)(rows)


def _x(r: dict, key: str) -> float:
    v = r.get(key)
    return float("nan") if v is None else v


def print_gemm_table(rows: list) -> None:
    """The gradient GEMMs (TFLOP/s): BF16, torch's FP8 and the best Triton config."""
    print(f"{'shape':>14} {'proj':>7} {'T':>6} | {'dgrad bf16':>10} {'torch':>6} {'triton':>6} | "
          f"{'wgrad bf16':>10} {'torch':>6} {'triton':>6} {'nosplit':>7} {'x bf16':>6}")
    for r in rows:
        dg, wg = r["fp8_dgrad_triton_tflops"], r["fp8_wgrad_triton_tflops"]
        best_w = max(wg.values())
        print(f"{r['shape']:>14} {r['proj']:>7} {r['T']:>6} | {r['bf16_dgrad_tflops']:10.0f} "
              f"{r['fp8_dgrad_torch_tflops']:6.0f} {max(dg.values()):6.0f} | "
              f"{r['bf16_wgrad_tflops']:10.0f} {r['fp8_wgrad_torch_tflops']:6.0f} {best_w:6.0f} "
              f"{max(r['fp8_wgrad_triton_nosplit_tflops'].values()):7.0f} "
              f"{best_w / r['bf16_wgrad_tflops']:6.2f}  best {max(wg, key=wg.get)}")


def print_tables(rows: list) -> None:
    """The GEMMs (TFLOP/s), then the expert path with torch vs fused casts (x BF16, ms)."""
    print(f"{'shape':>14} {'proj':>7} {'T':>6} {'bf16':>6} {'fp8':>6} {'x':>5} {'wg bf16':>7} "
          f"{'wg fp8':>6} {'fprop':>6} {'train b':>7} {'train 8':>7} {'x':>5}  (TFLOP/s)")
    for r in rows:
        print(f"{r['shape']:>14} {r['proj']:>7} {r['T']:>6} {r['bf16_tflops']:6.0f} "
              f"{r['fp8_gemm_tflops']:6.0f} {r['fp8_gemm_vs_bf16']:5.2f} "
              f"{r['bf16_wgrad_tflops']:7.0f} {r['fp8_wgrad_gemm_tflops']:6.0f} "
              f"{r['fp8_fprop_tflops']:6.0f} {_x(r, 'bf16_train_tflops'):7.0f} "
              f"{r['fp8_train_tflops']:7.0f} {_x(r, 'fp8_train_vs_bf16_train'):5.2f}")
    print(f"\nexpert path vs BF16 (x): torch-op casts vs fused Triton casts; casts alone in ms"
          f"\n{'shape':>14} {'proj':>7} {'T':>6} {'fwd torch':>9} {'fwd fused':>9} "
          f"{'f+b torch':>9} {'f+b fused':>9} | {'fwd torch/tri':>13} {'bwd torch/tri':>13} "
          f"{'x+x^T 1 call':>12}")
    for r in rows:
        print(f"{r['shape']:>14} {r['proj']:>7} {r['T']:>6} "
              f"{_x(r, 'fp8_fprop_torchcast_vs_bf16'):9.2f} {_x(r, 'fp8_fprop_vs_bf16'):9.2f} "
              f"{_x(r, 'fp8_train_torchcast_vs_bf16_train'):9.2f} "
              f"{_x(r, 'fp8_train_vs_bf16_train'):9.2f} | "
              f"{r['casts_fwd_torch_ms']:6.3f}/{r['casts_fwd_triton_ms']:6.3f} "
              f"{r['casts_bwd_torch_ms']:6.3f}/{r['casts_bwd_triton_ms']:6.3f} "
              f"{r['casts_fwd_fused_triton_ms']:12.3f}")
    print(f"\ngradient GEMMs x BF16 (fast accumulation off / on); fused casts GB/s"
          f"\n{'shape':>14} {'proj':>7} {'T':>6} {'dgrad':>6} {'dg fast':>7} {'wgrad':>6} "
          f"{'wg fast':>7} | {'fwd GB/s':>8} {'bwd GB/s':>8}")
    for r in rows:
        print(f"{r['shape']:>14} {r['proj']:>7} {r['T']:>6} "
              f"{_x(r, 'fp8_dgrad_gemm_vs_bf16_dgrad'):6.2f} "
              f"{_x(r, 'fp8_dgrad_gemm_fast_vs_bf16_dgrad'):7.2f} "
              f"{_x(r, 'fp8_wgrad_gemm_vs_bf16_wgrad'):6.2f} "
              f"{_x(r, 'fp8_wgrad_gemm_fast_vs_bf16_wgrad'):7.2f} | "
              f"{_x(r, 'casts_fwd_fused_triton_gbps'):8.0f} "
              f"{_x(r, 'casts_bwd_fused_triton_gbps'):8.0f}")
    for what in ("wgrad", "dgrad"):
        print(f"\nFP8 {what} TFLOP/s (promoted accumulation): BF16, torch, each Triton config"
              f"\n{'shape':>14} {'proj':>7} {'T':>6} {'bf16':>6} {'torch':>6} | Triton configs")
        for r in rows:
            tri = r.get(f"fp8_{what}_triton_tflops") or {}
            print(f"{r['shape']:>14} {r['proj']:>7} {r['T']:>6} "
                  f"{_x(r, f'bf16_{what}_tflops'):6.0f} {_x(r, f'fp8_{what}_torch_tflops'):6.0f} | "
                  + "  ".join(f"{c} {v:.0f}" for c, v in tri.items()))


if __name__ == "__main__":
    main()
