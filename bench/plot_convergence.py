"""Loss curves of several training runs on one plot, and the final-validation-loss table.

Reads the example's ``metrics.jsonl`` files (``python bench/suite.py convergence-2gpu`` writes them as
``convergence_<plugin>_<run>.jsonl``), draws validation loss (markers) and smoothed train loss
(thin lines) per run, and prints, per plugin, each run's last validation loss, its gap to the
BF16 run of the same plugin at that step (``bf16`` or ``bf16_<tag>``), the tokens seen and
whether any loss was non-finite. The issue-12 target: tensorwise FP8 within 0.5% of BF16.

    python bench/plot_convergence.py bench/results/convergence_*.jsonl \\
        --png bench/results/convergence_2gpu.png --json bench/results/convergence_2gpu.json
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

TARGET_GAP = 0.005  # tensorwise FP8 vs BF16, final validation loss


def load(path: Path) -> dict[str, Any]:
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    train = dict(sorted({r["step"]: r["loss"] for r in records if r.get("kind") == "train"}
                        .items()))
    val = dict(sorted({r["step"]: r["val_loss"] for r in records if r.get("kind") == "eval"}
                      .items()))
    tokens = max((r.get("tokens", 0) for r in records if r.get("kind") == "train"), default=0)
    m = re.match(r"convergence_([a-z0-9]+)_(.+)\.jsonl$", path.name)
    plugin, run = (m.group(1), m.group(2)) if m else ("run", path.stem)
    finite = all(math.isfinite(v) for v in [*train.values(), *val.values()])
    return dict(path=str(path), plugin=plugin, run=run, train=train, val=val, tokens=tokens,
                finite=finite, final_val=list(val.values())[-1] if val else None,
                val_still_falling=len(val) >= 2 and list(val.values())[-1] < list(val.values())[-2])


def bf16_base(runs: list[dict[str, Any]], plugin: str) -> dict[str, Any] | None:
    """The plugin's BF16 run: named ``bf16`` or ``bf16_<tag>`` (``bf16_h200x2_<date>``), the
    shortest such name where there are several."""
    found = [b for b in runs if b["plugin"] == plugin and b["run"].split("_")[0] == "bf16"]
    return min(found, key=lambda b: len(b["run"])) if found else None


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: its last validation loss and its gap to the BF16 run's validation loss at the
    same step (a run stopped early is compared where it stopped, not with BF16's end)."""
    rows = []
    for r in runs:
        base = bf16_base(runs, r["plugin"])
        step = list(r["val"])[-1] if r["val"] else None
        ref = base["val"].get(step) if base and step is not None else None
        gap = None if not ref or r["final_val"] is None else (r["final_val"] - ref) / ref
        row = {k: r[k] for k in ("plugin", "run", "final_val", "tokens", "finite",
                                 "val_still_falling")}
        row["step"], row["gap_vs_bf16"] = step, gap
        if r["run"].startswith("fp8_tensorwise") and gap is not None:
            row["target_met"] = abs(gap) <= TARGET_GAP
        rows.append(row)
    return rows


def plot(runs: list[dict[str, Any]], png: Path, title: str = "125M Llama") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, r in enumerate(runs):
        color = f"C{i}"
        steps, losses = list(r["train"]), list(r["train"].values())
        k = 20  # moving average over 20 logged points
        smooth = [sum(losses[max(0, j - k + 1): j + 1]) / len(losses[max(0, j - k + 1): j + 1])
                  for j in range(len(losses))]
        ax.plot(steps, smooth, color=color, linewidth=0.7, alpha=0.6)
        ax.plot(list(r["val"]), list(r["val"].values()), "o-", color=color, markersize=3,
                label=f"{r['plugin']} {r['run']} (val {r['final_val']:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(f"{title} on shakespeare.txt: validation (markers), train (lines, smoothed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("jsonl", nargs="+", type=Path)
    p.add_argument("--png", type=Path, default=Path("bench/results/convergence_2gpu.png"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--title", default="125M Llama", help="the model, as the plot names it")
    args = p.parse_args(argv)
    runs = [load(f) for f in args.jsonl]
    rows = summarize(runs)
    plot(runs, args.png, args.title)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.png}\n| plugin | run | step | last val loss | vs BF16 at that step | "
          f"tokens | finite | val still falling |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        gap = "-" if r["gap_vs_bf16"] is None else f"{100 * r['gap_vs_bf16']:+.2f}%"
        val = "-" if r["final_val"] is None else f"{r['final_val']:.4f}"
        print(f"| {r['plugin']} | {r['run']} | {r['step']} | {val} | {gap} | {r['tokens']:,} | "
              f"{r['finite']} | {r['val_still_falling']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
