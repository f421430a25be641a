"""One-GPU training throughput table: model shapes x modes (BF16, torchao float8, fp8boost FP8).

Each cell is one ``python bench/train.py --no-isolate --configs <config> ...`` process (so
compile caches, dynamo limits and allocator state never leak between cells; train.py's own
``--isolate`` would add a parent and a torchrun per cell), run in its own session with a time
limit; a failed, timed-out or not-compiled cell is recorded with its status and the run goes
on (torchao cells are ``skipped`` without a process when torchao is not installed). Every cell
uses fused AdamW on CUDA (``--fused-adamw``), random tokens and ``use_cache=False``.

Shapes (Llama, vocab 32000)::

    1b      h2048 ffn5632  16 layers, 16 heads (kv 16)   batch 8 x seq 2048
    7b-4l   h4096 ffn11008  4 layers, 32 heads (kv 32)   batch 4 x seq 2048
    8b-4l   h4096 ffn14336  4 layers, 32 heads, 8 kv (GQA)  batch 4 x seq 4096
    tiny    examples/presets.py's tiny, vocab 256, batch 2 x seq 256 (CPU smoke; not default)
    llama3-8b-4l  8b-4l with Llama 3's vocab 128256, batch 2 x seq 4096 (not default: the
            lm_head + loss weigh as in the real model, issue 35)
    <shape>@b<N>  that shape at batch size N (e.g. llama3-8b-4l@b6: which batch each mode
            fits, issue 35 item 4; an out-of-memory cell is recorded with status "oom")

Modes (bench/train.py config + flags)::

    bf16_eager        single_bf16               bf16_compiled     single_bf16 --compile
    torchao_compiled  single_torchao --compile  fp8_eager_default single_fp8
    fp8_eager_all     single_fp8 --fp8-min-numel 0 (every eligible decoder linear)
    fp8_compiled_all  single_fp8 --fp8-min-numel 0 --compile
    optional (--modes ... or all): torchao_eager, fp8_compiled_default,
    torchao_fsdp2_compiled (torchtitan's setup at world size 1: cross-checks the torchao
    row), fsdp2_bf16_compiled; ablations: fp8_compiled_kernelcasts (the Triton cast kernel
    as an opaque op under compile: Fp8Config(compiled_casts="kernel")), fp8_eager_noshare
    (Fp8Config(share_input_casts=False)), fp8_rowwise/blockwise_eager_noshare (the same for
    the granular recipes), bf16_eager_fusednorm, fp8_eager_all_fusednorm,
    fp8_rowwise_eager_fusednorm (--fused-norm: HF's RMSNorm through F.rms_norm, eager; not
    FP8, hence the BF16 row), bf16/torchao/fp8_compiled_twopass
    (MixedPrecision(fused_master_step=False): the two-pass master-weight step, the default
    before the one-kernel AdamW step; every other single_* mode takes the library default);
    issue 26's recipes: torchao_rowwise_compiled/_eager, fp8_rowwise/blockwise_compiled/_eager,
    fp8_rowwise_gwhp_compiled; issue 35's lm_head + loss (--fused-lm-loss; every other mode
    takes the library default, the fused loss): bf16/torchao/torchao_rowwise_compiled_hfloss
    (off: HF's lm_head + loss, full logits, as torchao users train), fp8_compiled_all_fp8head,
    fp8_rowwise_compiled_fp8head, bf16_compiled_fp8head (fp8-rowwise: the fused loss with an
    FP8 lm_head, FusedLmLossConfig(fp8_recipe="rowwise"))

A compiled cell counts only when dynamo captured graphs with no graph break: no graph is
``not_compiled``, breaks are flagged ``!<n>br`` in the table (``compile_ok: false``).

The JSON (device, versions, date, command, ``peak_bf16_tflops``; per shape the model info and
per mode bench/train.py's result plus ``vs_bf16_compiled``, ``vs_bf16_eager`` and, for FP8
modes, ``vs_torchao_compiled`` and, when that cell was run, ``vs_torchao_compiled_hfloss``) is
rewritten after every cell; a markdown table (tok/s and the ratio to ``bf16_compiled``), a
memory, an MFU and a warm-up line per shape are printed last.

Usage::

    python bench/single_gpu.py                                   # 3 shapes x 6 modes
    python bench/single_gpu.py --shapes 1b                       # one row (split a long run)
    python bench/single_gpu.py --shapes 8b-4l --modes bf16_compiled,fp8_compiled_all
    python bench/single_gpu.py --modes all --dry-run             # print the commands only
    python bench/single_gpu.py --device cpu --shapes tiny --modes bf16_eager,fp8_eager_all \\
        --warmup 1 --steps 2                                     # CPU smoke test
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "bench" / "train.py"

_LLAMA = dict(preset="7b", vocab_size=32000, seq_len=2048)  # + overrides of train.py's flags
SHAPES: dict[str, dict[str, Any]] = {
    "1b": dict(_LLAMA, hidden=2048, ffn=5632, layers=16, heads=16, kv_heads=16, batch_size=8),
    "7b-4l": dict(_LLAMA, hidden=4096, ffn=11008, layers=4, heads=32, kv_heads=32, batch_size=4),
    "8b-4l": dict(_LLAMA, hidden=4096, ffn=14336, layers=4, heads=32, kv_heads=8, batch_size=4,
                  seq_len=4096),
    # vocab 256: a 32000-word lm_head in BF16 takes ~20 s a step on a 2-core CPU
    "tiny": dict(preset="tiny", vocab_size=256, batch_size=2, seq_len=256),
    # Issue 35: Llama-3-8B's real vocabulary: its lm_head is ~1/3 of a 4-layer step's FLOPs.
    "llama3-8b-4l": dict(_LLAMA, hidden=4096, ffn=14336, layers=4, heads=32, kv_heads=8,
                         vocab_size=128256, batch_size=2, seq_len=4096),
}
DEFAULT_SHAPES = ["1b", "7b-4l", "8b-4l"]
_BATCH = re.compile(r"(?P<base>[a-z0-9-]+)@b(?P<batch>[1-9][0-9]*)")


def shape_spec(name: str) -> dict[str, Any]:
    """A shape of ``SHAPES``, or ``<shape>@b<N>``: that shape at batch size N (issue 35 item
    4: the largest batch each mode fits, e.g. ``llama3-8b-4l@b4``)."""
    m = _BATCH.fullmatch(name)
    if m is None:
        return dict(SHAPES[name])
    return dict(SHAPES[m["base"]], batch_size=int(m["batch"]))
_ALL = ["--fp8-min-numel", "0"]
MODES: dict[str, tuple[str, list[str]]] = {
    "bf16_eager": ("single_bf16", []),
    "bf16_compiled": ("single_bf16", ["--compile"]),
    "torchao_compiled": ("single_torchao", ["--compile"]),
    "fp8_eager_default": ("single_fp8", []),
    "fp8_eager_all": ("single_fp8", _ALL),
    "fp8_compiled_all": ("single_fp8", _ALL + ["--compile"]),
    "torchao_eager": ("single_torchao", []),
    "fp8_compiled_default": ("single_fp8", ["--compile"]),
    "torchao_fsdp2_compiled": ("torchao_fsdp2", ["--compile"]),
    "fsdp2_bf16_compiled": ("fsdp2_bf16", ["--compile"]),
    # Ablations: the FP8 cast kernel as an opaque op under compile; no shared input casts.
    "fp8_compiled_kernelcasts": ("single_fp8", _ALL + ["--compile", "--fp8-options",
                                                       "compiled_casts=kernel"]),
    "fp8_eager_noshare": ("single_fp8", _ALL + ["--fp8-options", "share_input_casts=False"]),
    # The two-pass master-weight step (BF16 grad -> FP32 copy, AdamW, master -> BF16 copy),
    # the library default before the fused one (MixedPrecision(fused_master_step=False)).
    "bf16_compiled_twopass": ("single_bf16", ["--compile", "--master-step", "two-pass"]),
    "torchao_compiled_twopass": ("single_torchao", ["--compile", "--master-step", "two-pass"]),
    "fp8_compiled_twopass": ("single_fp8", _ALL + ["--compile", "--master-step", "two-pass"]),
    # Issue 26: rowwise and blockwise recipes (Fp8Config.from_recipe), against torchao's rowwise.
    "torchao_rowwise_compiled": ("single_torchao", ["--compile", "--torchao-recipe", "rowwise"]),
    "fp8_rowwise_compiled": ("single_fp8", _ALL + ["--compile", "--fp8-options",
                                                   "named=rowwise"]),
    "fp8_rowwise_gwhp_compiled": ("single_fp8", _ALL + ["--compile", "--fp8-options",
                                                        "named=rowwise_with_gw_hp"]),
    "fp8_blockwise_compiled": ("single_fp8", _ALL + ["--compile", "--fp8-options",
                                                     "named=blockwise"]),
    "torchao_rowwise_eager": ("single_torchao", ["--torchao-recipe", "rowwise"]),
    "fp8_rowwise_eager": ("single_fp8", _ALL + ["--fp8-options", "named=rowwise"]),
    "fp8_blockwise_eager": ("single_fp8", _ALL + ["--fp8-options", "named=blockwise"]),
    # Each layer casting its own input (as before issue 35's eager shared granular casts).
    "fp8_rowwise_eager_noshare": ("single_fp8", _ALL + ["--fp8-options",
                                                        "named=rowwise,share_input_casts=False"]),
    "fp8_blockwise_eager_noshare": ("single_fp8", _ALL + [
        "--fp8-options", "named=blockwise,share_input_casts=False"]),
    # HF's RMSNorm through F.rms_norm in eager mode (fp8boost.norm): not FP8, so BF16 has it too.
    "bf16_eager_fusednorm": ("single_bf16", ["--fused-norm"]),
    "fp8_eager_all_fusednorm": ("single_fp8", _ALL + ["--fused-norm"]),
    "fp8_rowwise_eager_fusednorm": ("single_fp8", _ALL + ["--fused-norm", "--fp8-options",
                                                          "named=rowwise"]),
    # Issue 35: the lm_head + loss. hfloss: HF's (full logits), as torchao users train, against
    # the library's fused loss everywhere else; fp8head: the fused loss with an FP8 lm_head.
    "bf16_compiled_hfloss": ("single_bf16", ["--compile", "--fused-lm-loss", "off"]),
    "torchao_compiled_hfloss": ("single_torchao", ["--compile", "--fused-lm-loss", "off"]),
    "torchao_rowwise_compiled_hfloss": ("single_torchao", ["--compile", "--torchao-recipe",
                                                           "rowwise", "--fused-lm-loss", "off"]),
    "fp8_compiled_all_fp8head": ("single_fp8", _ALL + ["--compile", "--fused-lm-loss",
                                                       "fp8-rowwise"]),
    "fp8_rowwise_compiled_fp8head": ("single_fp8", _ALL + ["--compile", "--fp8-options",
                                                           "named=rowwise", "--fused-lm-loss",
                                                           "fp8-rowwise"]),
    # Only the head in FP8: what the FP8 lm_head alone buys over bf16_compiled.
    "bf16_compiled_fp8head": ("single_bf16", ["--compile", "--fused-lm-loss", "fp8-rowwise"]),
}
DEFAULT_MODES = list(MODES)[:6]


def _known(name: str, table: dict) -> bool:
    """A key of ``table``; for shapes also ``<shape>@b<N>`` of a known shape."""
    m = _BATCH.fullmatch(name) if table is SHAPES else None
    return name in table or (m is not None and m["base"] in table)


def _pick(value: str, table: dict, default: list[str], kind: str) -> list[str]:
    names = list(table) if value == "all" else [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if not _known(n, table)]
    if unknown or not names:
        raise ValueError(f"unknown {kind} {unknown or value!r}; choose from {list(table)} "
                         f"(default {','.join(default)}) or 'all'")
    return names


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                   help=f"of {list(SHAPES)}; <shape>@b<N>: at batch size N")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {list(MODES)}")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--output", default=None, help="JSON path (default: $OUT or bench/results)")
    p.add_argument("--config-timeout", type=int, default=420, help="seconds per cell")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="CUDA: per cell, kernel ms/step by category (bench/_profile.py)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = p.parse_args(argv)
    args.shapes = _pick(args.shapes, SHAPES, DEFAULT_SHAPES, "shape")
    args.modes = _pick(args.modes, MODES, DEFAULT_MODES, "mode")
    if args.steps < 1 or args.warmup < 0 or args.config_timeout < 1:
        raise ValueError("need --steps >= 1, --warmup >= 0 and --config-timeout >= 1")
    return args


def cell_argv(args: argparse.Namespace, shape: str, mode: str, output: str) -> list[str]:
    """bench/train.py's command line for one cell (one process, one config)."""
    config, flags = MODES[mode]
    argv = [sys.executable, str(TRAIN), "--no-isolate", "--configs", config,
            "--device", args.device]
    for key, value in shape_spec(shape).items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    if args.profile_steps:
        flags = flags + ["--profile-steps", str(args.profile_steps)]
    return argv + flags + ["--fused-adamw", "--warmup", str(args.warmup),
                           "--steps", str(args.steps), "--output", output]


def shown(argv: list[str]) -> str:
    return " ".join(["python", os.path.relpath(argv[1], ROOT)] + argv[2:])


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # nothing left in it
        pass


def run_cell(argv: list[str], timeout: int) -> dict[str, Any]:
    """Run one cell in its own session (a time-out kills compile workers too)."""
    output = argv[argv.index("--output") + 1]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, rc = proc.communicate(timeout=timeout)[0], proc.returncode
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        log, rc = proc.communicate()[0], "timeout"
    finally:  # on Ctrl-C too (it reaches only this session), and leftover compile workers
        _kill_session(proc.pid)
    child = json.loads(Path(output).read_text()) if os.path.exists(output) else None
    if child and child.get("results"):
        result = {k: v for k, v in child["results"][0].items() if not k.startswith("speedup_")}
        return dict(result, returncode=rc, _report=child)
    return dict(status="timeout" if rc == "timeout" else "crashed", returncode=rc,
                error=(log or "")[-3000:])


def check_compiled(mode: str, cell: dict[str, Any]) -> None:
    """A compiled cell counts only with graphs captured and no graph break."""
    if "--compile" not in MODES[mode][1] or cell["status"] != "ok":
        return
    ev = cell.get("compile") or {}
    if not ev.get("unique_graphs"):
        cell.update(status="not_compiled", error="--compile but no graph captured: ran eager")
    cell["compile_ok"] = bool(ev.get("unique_graphs")) and not ev.get("graph_breaks")


def add_ratios(cells: dict[str, dict[str, Any]]) -> None:
    """Each ok cell's tok/s over the BF16 cells; FP8 cells also over torchao's, and over
    torchao with HF's loss when that cell was run (None where a base is not ok)."""
    speed = {m: c["tokens_per_s_per_gpu"] for m, c in cells.items() if c["status"] == "ok"}
    # Only when run: runs without the issue-35 modes keep their keys as before.
    torchao = ["torchao_compiled"] + [m for m in ("torchao_compiled_hfloss",) if m in cells]
    for mode, cell in cells.items():
        if mode not in speed:
            continue
        bases = ["bf16_compiled", "bf16_eager"] + (torchao if mode.startswith("fp8") else [])
        for base in bases:
            cell[f"vs_{base}"] = speed[mode] / speed[base] if base in speed else None


def probe_device(device: str) -> str:
    """The GPU's name without initialising CUDA here (nvidia-smi); 'cpu' on CPU runs."""
    if device == "cpu":
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i",
                              os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                             capture_output=True, text=True, timeout=30)
        name = out.stdout.strip().splitlines()[0] if out.returncode == 0 else ""
    except (OSError, IndexError, subprocess.TimeoutExpired):
        name = ""
    return name or ("cpu" if device == "auto" else "cuda")


def output_path(args: argparse.Namespace, device_name: str) -> Path:
    if args.output:
        return Path(args.output)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower().replace("nvidia", "")).strip("-")
    return folder / f"single_gpu_{slug or 'gpu'}_{stamp}.json"


def versions() -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {}
    for pkg in ("torch", "triton", "transformers", "torchao"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _cell_text(cell: dict[str, Any]) -> str:
    if cell["status"] != "ok":
        return cell["status"]
    ratio = cell.get("vs_bf16_compiled")
    text = f"{cell['tokens_per_s_per_gpu']:.0f}" + (f" ({ratio:.2f}x)" if ratio else "")
    breaks = (cell.get("compile") or {}).get("graph_breaks")
    flags = (f" !{breaks}br" if breaks else "") + ("" if cell.get("finite", True) else " NaN!")
    return text + flags


def format_table(report: dict[str, Any]) -> str:
    modes = report["modes"]
    peak = report.get("peak_bf16_tflops")
    lines = [f"{report['device']}, {report.get('optimizer')}, median of {report['steps']} steps "
             f"after {report['warmup']} warm-up; tok/s (x vs bf16_compiled); dense BF16 peak "
             + (f"{peak:g} TFLOP/s" if peak else "unknown (no MFU)"), "",
             "| shape | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for name, shape in report["shapes"].items():
        cells = shape["cells"]
        lines.append(f"| {name} | " + " | ".join(_cell_text(cells[m]) if m in cells else "-"
                                                 for m in modes) + " |")
    lines.append("")
    for name, shape in report["shapes"].items():
        ok = {m: c for m, c in shape["cells"].items() if c["status"] == "ok"}
        lines.append(f"{name} peak memory GiB: " + (", ".join(
            f"{m} {c['peak_mem_gib']:.1f}" for m, c in ok.items()) or "-"))
        if peak:
            lines.append(f"{name} MFU: " + (", ".join(
                f"{m} {c['mfu']:.1%}" for m, c in ok.items() if c.get("mfu")) or "-"))
        lines.append(f"{name} warm-up s (first step / all {report['warmup']}): " + (", ".join(
            f"{m} {c['first_step_s']:.1f}/{c['warmup_s']:.1f}" for m, c in ok.items()) or "-"))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as exc:
        print(f"single_gpu.py: {exc}", file=sys.stderr)
        return 2
    device_name = probe_device(args.device)
    path = output_path(args, device_name)
    report: dict[str, Any] = dict(
        benchmark="single_gpu", device=device_name, versions=versions(),
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        command="python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        peak_bf16_tflops=None, warmup=args.warmup, steps=args.steps, optimizer=None,
        modes=args.modes, mode_configs={m: " ".join([MODES[m][0], *MODES[m][1]])
                                        for m in args.modes}, shapes={})
    torchao_missing = importlib.util.find_spec("torchao") is None
    with tempfile.TemporaryDirectory(prefix="fp8boost_single_") as tmp:
        for shape in args.shapes:
            entry = report["shapes"].setdefault(shape, dict(shape_spec(shape), model=None,
                                                            cells={}))
            for mode in args.modes:
                argv_cell = cell_argv(args, shape, mode, os.path.join(tmp, f"{shape}_{mode}.json"))
                print(f"[single_gpu] {shape} {mode}: {shown(argv_cell)}", flush=True)
                if args.dry_run:
                    continue
                if torchao_missing and "torchao" in MODES[mode][0]:  # as the child would say
                    cell = dict(status="skipped", error="torchao not installed")
                else:
                    cell = run_cell(argv_cell, args.config_timeout)
                child = cell.pop("_report", None)
                if child:
                    entry["model"] = entry["model"] or child.get("model")
                    report["device"] = child.get("device", report["device"])
                    report["peak_bf16_tflops"] = child.get("peak_bf16_tflops")
                    report["optimizer"] = child.get("optimizer")
                    report["versions"].update(cuda=child.get("cuda"), python=child.get("python"))
                check_compiled(mode, cell)
                entry["cells"][mode] = dict(cell, command=shown(argv_cell))
                add_ratios(entry["cells"])
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(report, indent=2, default=str))
                speed = cell.get("tokens_per_s_per_gpu")
                print(f"[single_gpu] {shape} {mode}: {cell['status']}"
                      + (f", {speed:.0f} tok/s, {cell['peak_mem_gib']:.2f} GiB, first step "
                         f"{cell['first_step_s']:.1f} s" if cell["status"] == "ok" else
                         f"\n{str(cell.get('error', ''))[-1500:]}"), flush=True)
                if cell.get("kernels"):
                    import _profile  # bench/_profile.py
                    print(_profile.format_breakdown(f"{shape} {mode}", cell["kernels"]),
                          flush=True)
    print(f"[single_gpu] dry run: JSON would go to {path}" if args.dry_run else
          f"[single_gpu] JSON written to {path}\n\n{format_table(report)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
