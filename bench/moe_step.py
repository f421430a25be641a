"""One-GPU MoE training-step table: BF16 (transformers' grouped_mm experts) against fp8boost FP8.

Each cell is one ``python bench/_moe_cell.py SHAPE MODE`` process (compile caches, dynamo
limits and allocator state never leak between cells), with a time limit; a failed or timed-out
cell is recorded with its status and the run goes on. Shapes (vocab 32000, random init, BF16
parameters, fused AdamW, the same learnable token stream in every cell)::

    mixtral  Mixtral-8x7B blocks x 2: h4096, 8 experts x 14336, top-2, GQA 32/8, 2 x 4096
    qwen3    Qwen3-30B-A3B blocks x 4: h2048, 128 experts x 768, top-8, GQA 32/4, 4 x 4096
    tiny     CPU smoke shape

Modes: bf16_eager, bf16_compiled, fp8_eager, fp8_compiled (every expert module and linear in
FP8: ``Fp8Config(min_numel=0)``), fp8default_eager/_compiled (``Fp8Config()``'s own choice).
A compiled cell counts only with graphs captured and no graph break (``compile_ok``).

The JSON (device, versions, date, command; per cell the step times, tokens/s, losses, peak
memory, FP8 coverage, dynamo's counters and, with ``--profile-steps``, the step's kernel time
by category from bench/_moe_profile.py) is rewritten after every cell; a markdown table with
the ratio to ``bf16_compiled`` is printed last.

Usage::

    python bench/moe_step.py                                    # 2 shapes x 4 modes
    python bench/moe_step.py --shapes qwen3 --modes bf16_compiled,fp8_compiled --profile-steps 2
    python bench/moe_step.py --shapes tiny --modes bf16_eager,fp8_eager --steps 2   # CPU smoke
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from _moe_cell import MODES, SHAPES, is_compiled  # noqa: E402

DEFAULT_MODES = ["bf16_eager", "bf16_compiled", "fp8_eager", "fp8_compiled"]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="mixtral,qwen3", help=f"of {list(SHAPES)}")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {list(MODES)}")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--profile-steps", type=int, default=0)
    p.add_argument("--cell-timeout", type=int, default=300)
    p.add_argument("--output", default=None, help="JSON path (default: $OUT or bench/results)")
    a = p.parse_args(argv)
    a.shapes, a.modes = a.shapes.split(","), a.modes.split(",")
    bad = [s for s in a.shapes if s not in SHAPES] + [m for m in a.modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown shape/mode {bad}: shapes {list(SHAPES)}, modes {list(MODES)}")
    return a


def run_cell(shape: str, mode: str, a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cell.json"
        cmd = [sys.executable, str(BENCH / "_moe_cell.py"), shape, mode, str(out),
               "--warmup", str(a.warmup), "--steps", str(a.steps),
               "--profile-steps", str(a.profile_steps)]
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=a.cell_timeout)
        except subprocess.TimeoutExpired as e:
            return dict(shape=shape, mode=mode, status="timeout",
                        tail=(e.stdout or b"")[-2000:].decode(errors="replace")
                        if isinstance(e.stdout, bytes) else (e.stdout or "")[-2000:])
        if proc.returncode or not out.exists():
            return dict(shape=shape, mode=mode, status="failed", tail=proc.stdout[-3000:])
        cell = json.loads(out.read_text())
    cell["status"] = "ok"
    if is_compiled(mode):
        ev = cell.get("compile") or {}
        cell["compile_ok"] = bool(ev.get("unique_graphs")) and not ev.get("graph_breaks")
    return cell


def table(cells: list[dict[str, Any]]) -> str:
    lines = ["| shape | mode | tok/s | x bf16_compiled | step ms | peak GiB | final loss | "
             "compiled |", "|---|---|---|---|---|---|---|---|"]
    base = {c["shape"]: c["tokens_per_s"] for c in cells
            if c["mode"] == "bf16_compiled" and c["status"] == "ok"}
    for c in cells:
        if c["status"] != "ok":
            lines.append(f"| {c['shape']} | {c['mode']} | {c['status']} | | | | | |")
            continue
        ratio = c["tokens_per_s"] / base[c["shape"]] if c["shape"] in base else float("nan")
        comp = ""
        if "compile" in c:
            ev = c["compile"]
            comp = f"{ev['unique_graphs']}g/{ev['graph_breaks']}br"
        lines.append(f"| {c['shape']} | {c['mode']} | {c['tokens_per_s']:,.0f} | {ratio:.3f} | "
                     f"{c['step_ms_median']:.1f} | {c.get('peak_memory_gib', 0):.1f} | "
                     f"{c['final_loss']:.4f} | {comp} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    a = parse_args(argv)
    import torch

    if torch.cuda.is_available():
        from _common import env_info
        payload: dict[str, Any] = env_info(sys.argv)
    else:
        payload = dict(device="cpu", torch=torch.__version__, command=" ".join(sys.argv))
    payload["cells"] = cells = []
    path = None
    for shape in a.shapes:
        for mode in a.modes:
            cell = run_cell(shape, mode, a)
            cells.append(cell)
            print(f"[moe-step] {shape} {mode}: {cell['status']} "
                  f"{cell.get('tokens_per_s', 0):,.0f} tok/s", flush=True)
            if "profile" in cell:
                prof = cell["profile"]
                print(f"  {prof['total_ms_per_step']:.1f} ms/step: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in prof["by_category_ms"].items()), flush=True)
            if a.output:
                path = a.output
                Path(path).write_text(json.dumps(payload, indent=1, default=str))
            else:
                from _common import write_json
                path = write_json("moe_step", payload)
    print(table(cells))
    print(f"[moe-step] JSON: {path}")


if __name__ == "__main__":
    main()
