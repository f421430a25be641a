"""Outlier stress test of the FP8 recipes (issue 26, item 5): massive activations on one token.

LLMs grow "massive activations": a few tokens (the first of a sequence, a delimiter) whose
hidden states are hundreds to thousands of times larger than the rest. This script gives a
small Llama exactly that, without changing what it computes: every decoder linear layer gets
its input on the first token of each sequence multiplied by ``G`` and its output on that
token divided by ``G`` (``G`` a power of two, so BF16/FP32 arithmetic is unchanged bit for bit:
the BF16 run is the same with or without the stress). Only FP8 scaling sees the difference:

* tensorwise: one scale per tensor, set by the massive token, so every other token's
  activations (and, in backward, their output gradients against the token's ``1/G`` ones)
  lose precision or underflow;
* rowwise / blockwise: forward and input-gradient operands are scaled per token (row / 1x128
  tiles), unaffected; but the weight-gradient operands are scaled along the token axis
  (per channel over all tokens / 128-token tiles), and those contain the massive token;
* rowwise_with_gw_hp: the weight gradient in BF16: unaffected everywhere.

Each recipe trains the same model (same init, data order, schedule) on byte-level
Shakespeare for ``--steps`` steps on the CPU with the emulated FP8 backend (FP8 numerics
bit-exact with the GPU casts, no speed), and the held-out loss is compared with BF16's.

    python bench/outlier_stress.py --steps 300 --gains 1,1024,8192
    # -> bench/results/outlier_stress_<date>.json and .png (table printed last)
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPES = ("bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared/data/shakespeare.txt"))
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--gains", default="1,1024,8192", help="massive-token gains (powers of 2)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--output", default=None, help="JSON path (default: bench/results/...)")
    return p.parse_args()


def _data(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    raw = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
    cut = int(len(raw) * 0.95)
    return raw[:cut], raw[cut:]


def _batch(data: torch.Tensor, step: int, bs: int, seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (bs,), generator=g)
    return torch.stack([data[s:s + seq] for s in starts.tolist()])


def _model(args) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=args.seq_len,
                      use_cache=False)
    return LlamaForCausalLM(cfg)


def _stress(model: torch.nn.Module, gain: float) -> int:
    """Massive first token at every decoder linear: input x gain, output / gain (exact)."""
    if gain == 1:
        return 0

    def pre(_m, args):
        x = args[0].clone()
        x[:, 0] = x[:, 0] * gain
        return (x, *args[1:])

    def post(_m, _args, y):
        y = y.clone()
        y[:, 0] = y[:, 0] / gain
        return y

    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            mod.register_forward_pre_hook(pre)
            mod.register_forward_hook(post)
            n += 1
    return n


def _run(recipe: str, gain: float, train, val, args) -> dict:
    booster, model, opt = _boosted(recipe, args)
    stressed = _stress(booster.plugin.unwrap_model(model), gain)
    curve, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        ids = _batch(train, step, args.batch_size, args.seq_len, 0)
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        if step % args.eval_every == 0 or step == args.steps:
            curve.append({"step": step, "train": loss.item(), "val": _eval(model, val, args)})
    final = curve[-1]["val"]
    return {"recipe": recipe, "gain": gain, "stressed_linears": stressed, "curve": curve,
            "final_val": final, "finite": all(math.isfinite(c["val"]) for c in curve),
            "seconds": time.perf_counter() - t0}


def _boosted(recipe: str, args, fused_lm_loss: bool = True):
    from fp8boost.booster import Booster, MixedPrecision
    from fp8boost.fp8 import Fp8Config
    mp = MixedPrecision("bf16", fused_lm_loss=fused_lm_loss) if recipe == "bf16" else \
        MixedPrecision("fp8", Fp8Config.from_recipe(recipe, backend="emulated", min_numel=0),
                       fused_lm_loss=fused_lm_loss)
    model = _model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    booster = Booster(mixed_precision=mp, device="cpu")
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def _one_step_errors(recipes: list[str], gains: list[float], train, args) -> list[dict]:
    """The first step's FP8 error against BF16 at the same weights and batch: relative error
    of the logits and of the decoder linears' weight gradients (deterministic: no training
    noise in it)."""
    ids = _batch(train, 1, args.batch_size, args.seq_len, 0)

    def run(recipe, gain):
        # The logits are compared: a training forward with labels must return them.
        booster, model, _ = _boosted(recipe, args, fused_lm_loss=False)
        inner = booster.plugin.unwrap_model(model)
        _stress(inner, gain)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = torch.cat([p.grad.float().reshape(-1) for n, p in inner.named_parameters()
                           if ".layers." in n and p.grad is not None and p.dim() == 2])
        return out.logits.detach().float(), grads

    ref_logits, ref_grads = run("bf16", 1.0)
    rows = []
    for gain in gains:
        for recipe in recipes:
            if recipe == "bf16":
                continue
            logits, grads = run(recipe, gain)
            rows.append({"recipe": recipe, "gain": gain,
                         "logits_rel": float((logits - ref_logits).norm() / ref_logits.norm()),
                         "wgrad_rel": float((grads - ref_grads).norm() / ref_grads.norm())})
    return rows


@torch.no_grad()
def _eval(model, val, args) -> float:
    losses = [model(input_ids=(ids := _batch(val, i, args.batch_size, args.seq_len, 1)),
                    labels=ids).loss.item() for i in range(args.eval_batches)]
    return sum(losses) / len(losses)


def _plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    gains = sorted({r["gain"] for r in results})
    fig, axes = plt.subplots(1, len(gains), figsize=(5 * len(gains), 4), sharey=True)
    for ax, gain in zip([axes] if len(gains) == 1 else axes, gains):
        for r in (r for r in results if r["gain"] == gain):
            ax.plot([c["step"] for c in r["curve"]], [c["val"] for c in r["curve"]],
                    marker="o", ms=3, label=r["recipe"])
        ax.set_title(f"massive first token x{gain:g}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    (axes if len(gains) == 1 else axes[0]).set_ylabel("held-out loss")
    (axes if len(gains) == 1 else axes[0]).legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = _args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    train, val = _data(args.data)
    gains = [float(g) for g in args.gains.split(",")]
    recipes = args.recipes.split(",")
    errors = _one_step_errors(recipes, gains, train, args)
    for e in errors:
        print(f"[error] x{e['gain']:g} {e['recipe']:20s} logits {e['logits_rel']:.3e} "
              f"wgrad {e['wgrad_rel']:.3e}", flush=True)
    results = []
    for gain in gains if args.steps else ():
        for recipe in recipes:
            # BF16 runs under every gain too: the stress must leave them bit-identical
            results.append(_run(recipe, gain, train, val, args))
            r = results[-1]
            print(f"[stress] x{gain:g} {recipe:20s} val {r['final_val']:.4f} ({r['seconds']:.0f} s)",
                  flush=True)
    date = datetime.date.today().isoformat()
    out = Path(args.output or ROOT / f"bench/results/outlier_stress_{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": "cpu (emulated FP8 backend)", "torch": torch.__version__,
            "date": date, "command": " ".join(sys.argv), "args": vars(args)}
    bf16_curves = {json.dumps(r["curve"]) for r in results if r["recipe"] == "bf16"}
    meta["bf16_identical_under_every_gain"] = len(bf16_curves) == 1
    out.write_text(json.dumps({"meta": meta, "one_step_errors": errors, "results": results},
                              indent=1))
    if results:
        _plot(results, out.with_suffix(".png"))
    print(f"\nfirst-step error vs BF16 (logits / weight gradients), by gain")
    for e_gain in gains:
        cells = [f"{e['recipe']}: {e['logits_rel']:.1e} / {e['wgrad_rel']:.1e}"
                 for e in errors if e["gain"] == e_gain]
        print(f"x{e_gain:g}: " + "; ".join(cells))
    if not results:
        print(f"JSON: {out}")
        return
    bf16 = {r["gain"]: r["final_val"] for r in results if r["recipe"] == "bf16"}
    print(f"\n{'gain':>6} " + " ".join(f"{x:>20s}" for x in recipes))
    for gain in gains:
        row = [r for r in results if r["gain"] == gain]
        base = bf16.get(gain, bf16.get(1.0))
        cells = [f"{r['final_val']:.4f} ({(r['final_val'] / base - 1) * 100:+.1f}%)" for r in row]
        print(f"{gain:>6g} " + " ".join(f"{c:>20s}" for c in cells))
    print(f"BF16 bit-identical under every gain: {meta['bf16_identical_under_every_gain']}")
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
