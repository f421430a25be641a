"""Suites of named training runs of ``examples/train_llama.py``: the convergence curves (dense
and MoE) and expert parallelism on 4 GPUs. Which runs is a positional argument (comma
separated), so each suite is a small function: one step per run, whose log stays in /tmp and
whose metrics or summary are copied under $OUT."""
from __future__ import annotations

import json
import re

from suites.actions import copy, grep, print_tail
from suites.core import NCCL_ENV, Ctx, Step, Suite, SuiteError

# The same 125M Llama (byte-level tokens) on .data/shakespeare.txt in every convergence run:
# same data order, seed and schedule; FP8 runs convert every decoder linear (--fp8-min-numel 0:
# the default size filter would keep a 768-wide model in BF16).
F8 = "--use-fp8 --fp8-min-numel 0"
CONV = ("examples/train_llama.py --preset 125m --data {DATA} --steps {STEPS} --seq-len 512 "
        "--lr 6e-4 --eval-every 100 --eval-batches 16 --no-progress")
CONV_KNOBS = {"DATA": ".data/shakespeare.txt", "STEPS": "2000"}


def run_names(ctx: Ctx, arg: str) -> list[str]:
    """The comma-separated run names; each becomes part of a file name and a command."""
    names = [n for n in ctx.values[arg].split(",") if n]
    for name in names:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise SuiteError(f"{ctx.suite.name}: bad run name {name!r}")
    return names


def seed_of(ctx: Ctx) -> tuple[str, str]:
    """The ``SEED`` knob and the part it adds to file names (seed 0 keeps the first runs'
    names: none)."""
    seed = ctx.values["SEED"]
    if not seed.isdigit():
        raise SuiteError(f"{ctx.suite.name}: SEED must be a non-negative integer, got {seed!r}")
    return seed, "" if seed == "0" else f"_seed{seed}"


def val_line(log: str) -> str:
    """The last validation line of a training log, cut as the scripts did."""
    found = grep(log, "val")
    return found[-1][:150] if found else ""


def conv_after(label: str, name: str, tmp: str, dest: str, tail: int = 0, cut: int = 0,
               val: bool = True):
    """``[label] name rc=N <last val line>`` (``val``), the log's last lines, its metrics under
    $OUT."""
    def after(ctx: Ctx, rc: int) -> None:
        line = f" {val_line(tmp + '.log')}" if val else ""
        print(f"[{label}] {name} rc={rc}{line}", flush=True)
        if tail:
            print_tail(tmp + ".log", tail, cut)
        copy(f"{tmp}/metrics.jsonl", f"{ctx.out}/{dest}")
    return after


# Variants of a recipe for issue 35's rowwise question (which choice costs the loss):
# name -> (recipe, --fp8-option overrides).
CONV_VARIANTS = {"rowwise_e5m2grad": ("rowwise", "fp8_format=hybrid"),
                 "rowwise_fp32scale": ("rowwise", "power_of_2_scale=false")}


def convergence_1gpu(ctx: Ctx) -> list[Step]:
    """One run per recipe (bf16 = no FP8), batch 6 x 512 (the 2-GPU suite's 2 x 3); a name
    ending in ``_fp8head`` adds the FP8 lm_head (``--fp8-head rowwise``, issue 35); a name of
    ``CONV_VARIANTS`` is a recipe with one field changed."""
    tok = ctx.values.get("TOKENIZER", "")
    if tok and not re.fullmatch(r"[A-Za-z0-9_./-]+", tok):
        raise SuiteError(f"convergence-1gpu: bad TOKENIZER {tok!r}")
    seed, seed_part = seed_of(ctx)
    # bench/make_tokenizer.py's folder: its name goes into the run's files (.data/tok128k: _tok128k)
    suffix = (f"_{tok.rstrip('/').rsplit('/', 1)[-1]}" if tok else "") + seed_part
    steps = []
    for name in run_names(ctx, "runs"):
        base = name.removesuffix("_fp8head")
        recipe, option = CONV_VARIANTS.get(base, (base, ""))
        flags = "" if recipe == "bf16" else f" {F8} --fp8-recipe {recipe}"
        flags += f" --fp8-option {option}" if option else ""
        flags += " --fp8-head rowwise" if base != name else ""
        flags += f" --tokenizer {tok}" if tok else ""
        run = f"{name}{suffix}"
        steps.append(Step(
            f"torchrun --standalone --nproc_per_node=1 {CONV} --batch-size 6 --log-every 100"
            f" --seed {seed}{flags} --out-dir /tmp/conv1_{run}", timeout="{RUN_TIMEOUT}",
            log=f"/tmp/conv1_{run}.log", show=False,
            after=conv_after("conv", run, f"/tmp/conv1_{run}",
                             f"convergence_1gpu_{run}.jsonl"),
            note=f"cp /tmp/conv1_{run}/metrics.jsonl {{OUT}}/convergence_1gpu_{run}.jsonl"))
    return steps


CONVERGENCE_1GPU = Suite(
    "convergence-1gpu", "run_convergence_1gpu.sh",
    "2000-step loss curves of the FP8 recipes on one GPU (125M Llama, shakespeare; carry .data)",
    gpus="1", time="~2.5 min/run", build=convergence_1gpu,
    knobs={**CONV_KNOBS, "RUN_TIMEOUT": "150", "TOKENIZER": "", "SEED": "0"},
    args=(("runs", "bf16,tensorwise,rowwise,blockwise"),),
    usage="runs: comma-separated recipes (bf16 = no FP8; <recipe>_fp8head adds the FP8 "
          "lm_head; rowwise_e5m2grad / rowwise_fp32scale: rowwise with e5m2 gradients / FP32 "
          "scales); SEED: other than 0 adds _seed<SEED> to the files; TOKENIZER: a local "
          "tokenizer folder (bench/make_tokenizer.py, e.g. "
          ".data/tok128k: Llama 3's vocabulary size) instead of bytes; JSONL per run -> "
          "$OUT/convergence_1gpu_<run>[_<tokenizer>].jsonl; plot with bench/plot_convergence.py")

# zero2: bf16, tensorwise, delayed, tensorwise + FP8 comm; any other plugin: bf16, tensorwise,
# tensorwise + FP8 comm (issue 36: FP8 communication against FP8 compute alone).
CONV_2GPU_RUNS = {
    "zero2": (("bf16", ""), ("fp8_tensorwise", F8), ("fp8_delayed", F8 + " --fp8-recipe delayed"),
              ("fp8_tensorwise_comm", F8 + " --fp8-comm")),
    "": (("bf16", ""), ("fp8_tensorwise", F8), ("fp8_tensorwise_comm", F8 + " --fp8-comm")),
}


def convergence_2gpu(ctx: Ctx) -> list[Step]:
    """2000 steps x 2 GPUs x 3 x 512 = 6.1M byte tokens (~1.2 epochs): val loss still falls.

    ``runs`` picks some of the plugin's runs (default: all); ``SIDE_BY_SIDE=1`` starts them all
    at once on the two GPUs (the 125M step is launch-bound: two Gemini FP8 runs side by side
    each ran 0.24-0.25 s/step on 2xH200, as alone, 2026-11-30).
    """
    plugin = ctx.values["plugin"]
    if not re.fullmatch(r"[a-z0-9_]+", plugin):
        raise SuiteError(f"convergence-2gpu: bad plugin {plugin!r}")
    known = dict(CONV_2GPU_RUNS.get(plugin, CONV_2GPU_RUNS[""]))
    wanted = list(known) if ctx.values["runs"] == "all" else run_names(ctx, "runs")
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SuiteError(f"convergence-2gpu: unknown run(s) {unknown} for {plugin}: use "
                         f"{', '.join(known)} or all")
    if ctx.values["SIDE_BY_SIDE"] not in ("0", "1"):
        raise SuiteError("convergence-2gpu: SIDE_BY_SIDE must be 0 or 1")
    side = ctx.values["SIDE_BY_SIDE"] == "1"
    # The example refuses an --out-dir that holds a run (a warm machine keeps /tmp); all at
    # once here, since a foreground step waits for the background runs before it.
    steps = [Step("rm -rf " + " ".join(f"/tmp/conv_{name}" for name in wanted), check=False)]
    for name in wanted:
        steps.append(Step(
            f"torchrun --standalone --nproc_per_node=2 {CONV} --batch-size 3 --log-every 50 "
            f"--plugin {plugin} --out-dir /tmp/conv_{name} {known[name]}",
            timeout="{RUN_TIMEOUT}", log=f"/tmp/conv_{name}.log", show=False, background=side,
            after=conv_after("conv", f"{plugin} {name}", f"/tmp/conv_{name}",
                             f"convergence_{plugin}_{name}.jsonl", tail=2, val=False),
            note=f"tail -2 the log; cp /tmp/conv_{name}/metrics.jsonl "
                 f"{{OUT}}/convergence_{plugin}_{name}.jsonl"))
    return steps


CONVERGENCE_2GPU = Suite(
    "convergence-2gpu", "run_convergence_2gpu.sh",
    "2000-step loss curves on 2 GPUs: zero2 (bf16, tensorwise, delayed, + FP8 comm) or gemini "
    "(bf16, tensorwise, + FP8 comm)",
    gpus="2", time="~5-9 min/run", build=convergence_2gpu,
    env={"PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"},
    # 570: Gemini FP8 at 125M ran 0.24-0.25 s/step on 2xH200 (2026-11-29/30): ~530 s in all
    knobs={**CONV_KNOBS, "RUN_TIMEOUT": "570", "SIDE_BY_SIDE": "0"},
    args=(("plugin", "zero2"), ("runs", "all")),
    usage="plugin: zero2 | gemini; runs: comma-separated names of the plugin's runs, or all; "
          "SIDE_BY_SIDE=1 starts them all at once; JSONL per run -> "
          "$OUT/convergence_<plugin>_<run>.jsonl; "
          "plot: python bench/plot_convergence.py bench/results/convergence_*.jsonl")

MOE_FLAGS = {"fp8": F8, "fp8gwhp": F8 + " --fp8-recipe rowwise_with_gw_hp"}


def convergence_moe(ctx: Ctx) -> list[Step]:
    """A 125M-class Mixtral, each decoder block compiled; fp8gwhp keeps weight gradients BF16."""
    seed, suffix = seed_of(ctx)
    steps = []
    for name in run_names(ctx, "runs"):
        flags = MOE_FLAGS.get(name, "")
        tmp = f"/tmp/convmoe_{name}{suffix}"
        steps.append(Step(
            "torchrun --standalone --nproc_per_node=1 examples/train_llama.py --model mixtral "
            "--preset 125m --data {DATA} --steps {STEPS} --batch-size 6 --seq-len 512 --lr 6e-4 "
            "--eval-every 100 --eval-batches 16 --log-every 100 --no-progress --compile "
            f"--seed {seed}{flags and ' ' + flags} --out-dir {tmp}", timeout="{RUN_TIMEOUT}",
            log=f"{tmp}.log", show=False,
            after=conv_after("conv-moe", name + suffix, tmp,
                             f"convergence_moe_1gpu_{name}{suffix}.jsonl", tail=3, cut=300),
            note=f"tail -3 the log; cp {tmp}/metrics.jsonl "
                 f"{{OUT}}/convergence_moe_1gpu_{name}{suffix}.jsonl"))
    return steps


CONVERGENCE_MOE = Suite(
    "convergence-moe", "run_convergence_moe_1gpu.sh",
    "2000-step loss curves of FP8 experts on one GPU (125M-class Mixtral, compiled; carry .data)",
    gpus="1", time="~4-9 min/run", build=convergence_moe,
    knobs={**CONV_KNOBS, "RUN_TIMEOUT": "280", "SEED": "0"}, args=(("runs", "bf16,fp8"),),
    usage="runs: bf16 | fp8 | fp8gwhp (rowwise_with_gw_hp); JSONL per run -> "
          "$OUT/convergence_moe_1gpu_<run>.jsonl (<run>_seed<SEED> for SEED other than 0)")

# FP8 runs convert every layer, experts included (FP8=--use-fp8 keeps the default size filter).
MOE4_RUNS = {"fsdp_bf16": "--plugin fsdp", "ep4_bf16": "--plugin moe --ep 4",
             "ep4_fp8": "--plugin moe --ep 4 {FP8}",
             "ep4_fp8comm": "--plugin moe --ep 4 {FP8} --fp8-comm",
             "ep2dp2_bf16": "--plugin moe --ep 2", "ep2dp2_fp8comm": "--plugin moe --ep 2 {FP8} --fp8-comm"}
# A failed run's own errors, not torchrun's wrapper traceback.
RANK_ERRORS = r"Error|error:|Exception|Traceback|OutOfMemory"
WRAPPER = re.compile(r"elastic|ChildFailedError|SignalException")


def moe4_after(name: str):
    """Copy the log and summary under $OUT; print tokens/s/GPU, or the ranks' errors."""
    def after(ctx: Ctx, rc: int) -> None:
        copy(f"/tmp/moe4_{name}.log", f"{ctx.out}/moe_4gpu_{name}.log")
        try:
            with open(f"/tmp/moe4_{name}/summary.json") as f:
                s = json.load(f)
            rate = f"{round(s['tokens_per_s_per_device'])} tok/s/GPU {s.get('compile', '')}"
        except (OSError, ValueError, KeyError):
            rate = ""
        print(f"[moe-4gpu] {name} rc={rc} {rate}", flush=True)
        if rc != 0:
            errors = [ln for ln in grep(f"/tmp/moe4_{name}.log", RANK_ERRORS)
                      if not WRAPPER.search(ln)]
            for line in errors[:8]:
                print(line[:300], flush=True)
        copy(f"/tmp/moe4_{name}/summary.json", f"{ctx.out}/moe_4gpu_{name}.json")
    return after


def moe_4gpu(ctx: Ctx) -> list[Step]:
    """One torchrun per run; ``_compiled`` adds --compile (blocks compiled around the exchange)."""
    steps = []
    for name in run_names(ctx, "runs"):
        base = name[:-len("_compiled")] if name.endswith("_compiled") else name
        if base not in MOE4_RUNS:
            steps.append(Step("", after=lambda c, rc, n=name: print(f"unknown run {n}"),
                              note=f"print: unknown run {name}"))
            continue
        flags = MOE4_RUNS[base] + (" --compile" if name != base else "")
        steps += [Step(f"rm -rf /tmp/moe4_{name}", check=False),  # the example refuses a used dir
                  Step("torchrun --standalone --nproc_per_node=4 examples/train_llama.py --model "
                       "mixtral --preset {PRESET} --steps {STEPS} --batch-size 2 --seq-len 4096 "
                       "--eval-every 0 --val-fraction 0 --log-every 1 --no-progress "
                       f"{flags} --out-dir /tmp/moe4_{name}", timeout="{RUN_TIMEOUT}",
                       log=f"/tmp/moe4_{name}.log", show=False, after=moe4_after(name),
                       note=f"cp the log and summary.json to {{OUT}}/moe_4gpu_{name}.{{{{log,json}}}}; "
                            "print tok/s/GPU, or the ranks' errors")]
    return steps


MOE_4GPU = Suite(
    "moe-4gpu", "run_moe_4gpu.sh",
    "expert parallelism on 4 GPUs (Mixtral-8x7B layout, 8 layers): FSDP2 BF16 vs ep4 / ep2 x "
    "dp2, BF16/FP8/FP8 dispatch", gpus="4", time="~2 min/run", build=moe_4gpu,
    env={"PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": NCCL_ENV["NCCL_NVLS_ENABLE"]},
    knobs={"STEPS": "12", "RUN_TIMEOUT": "240", "PRESET": "mistral-8l", "FP8": F8},
    args=(("runs", "fsdp_bf16,ep4_bf16,ep4_fp8,ep4_fp8comm"),),
    usage="runs: " + ", ".join(MOE4_RUNS) + " (each also as <run>_compiled); PRESET=7b-8l "
          "gives the earlier 11008/MHA layout; summary per run -> $OUT/moe_4gpu_<run>.json")

SUITES = (CONVERGENCE_1GPU, CONVERGENCE_2GPU, CONVERGENCE_MOE, MOE_4GPU)
