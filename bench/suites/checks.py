"""Correctness suites on the device machine: the GPU test suite plus the training example
under torchrun (``gpu-checks``), and a Colossal-AI-style script with each plugin
(``colossal-gpu``). Both append every run's full output to one log under $OUT and print a
short line per run; colossal-gpu also writes its JSON summary."""
from __future__ import annotations

import datetime
import json
import re
import statistics
import subprocess

from suites.actions import GPU_NAME, grep, log_report, read_lines, report_note, versions
from suites.core import Ctx, Step, Suite, SuiteError

ENV = {"PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def truncate(path: str) -> Step:
    """``: > path``: a fresh combined log for this call."""
    def after(ctx: Ctx, rc: int) -> None:
        open(ctx.raw(path), "w").close()
    return Step("", after=after, note=f": > {path}")


def append_run(combined: str, name: str, flags: str, log: str, rc_line: bool = False):
    """Append ``===== name: flags`` and the run's own log to the combined log."""
    def after(ctx: Ctx, rc: int) -> None:
        lines = read_lines(log) + ([f"rc={rc}"] if rc_line else [])
        with open(ctx.raw(combined), "a") as f:
            f.write(f"===== {name}: {flags}\n" + "".join(ln + "\n" for ln in lines))
    return after


def gpu_count(ctx: Ctx) -> int:
    """GPUs on this machine (``nvidia-smi -L``); NGPU overrides it (for --dry-run elsewhere)."""
    if ctx.values["NGPU"]:
        return int(ctx.values["NGPU"])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except OSError:
        return 0
    return len(out.splitlines())


# (name, processes, flags): FP8 + activation checkpointing (+ compile) on several plugins.
EXAMPLES = (
    ("single_compile_ac", 1, "--compile --activation-checkpointing"),
    ("zero2_compile_ac", 2, "--plugin zero2 --fp8-comm --compile --activation-checkpointing"),
    ("gemini_compile_ac", 2, "--plugin gemini --fp8-comm --compile --activation-checkpointing"),
    ("hybrid_tp2_compile_ac", 2, "--plugin hybrid --tp 2 --sp --compile "
                                 "--activation-checkpointing"),
    ("hybrid_pp2_ac", 2, "--plugin hybrid --pp 2 --activation-checkpointing"),
)
EX_LOG = "{OUT}/examples_{TAG}.log"


def example_step(name: str, n: int, flags: str) -> Step:
    """One run of the example; its line counts dynamo's recompile messages (there must be none)."""
    log = f"/tmp/ex_{name}.log"
    append = append_run(EX_LOG, name, flags, log)

    def after(ctx: Ctx, rc: int) -> None:
        append(ctx, rc)
        recompiles = len(grep(log, "(?i)recompil"))
        done = grep(log, r"\[train\] done")
        print(f"[ex] {name:<26} rc={rc} recompile_lines={recompiles} last: "
              f"{done[-1][13:110] if done else ''}", flush=True)
    return Step(f"torchrun --standalone --nproc_per_node={n} examples/train_llama.py --preset "
                "125m --use-fp8 --fp8-min-numel 0 --steps 12 --log-every 4 --no-progress "
                f"--out-dir /tmp/ex_{name} {flags}", timeout="{EX_TIMEOUT}", log=log, show=False,
                after=after, note=f"append the log to {EX_LOG}; print rc and recompile lines")


def gpu_checks(ctx: Ctx) -> list[Step]:
    """The GPU suite (every gpu/multigpu test), then the examples (multi-GPU ones on 2+ GPUs)."""
    what, ngpu = ctx.values["what"], gpu_count(ctx)
    if what not in ("tests", "examples", "all"):
        raise SuiteError(f"gpu-checks: unknown part {what!r}; parts: tests, examples, all")
    steps = []
    if what != "examples":  # the GPU suite (CONTRIBUTING.md): every gpu/multigpu test
        part = "all" if ngpu >= 2 else "one"
        steps.append(Step(f"python3 tests/gpu_suite.py {part} --out {{OUT}}"))
    if what == "tests":
        return steps
    steps.append(truncate(EX_LOG))
    return steps + [example_step(*ex) for ex in EXAMPLES if ex[1] == 1 or ngpu >= 2]


GPU_CHECKS = Suite(
    "gpu-checks", "run_gpu_checks.sh",
    "the GPU test suite (tests/gpu_suite.py), then the example with FP8 + AC + compile on "
    "several plugins (no recompiles)", gpus="1-2", time="~10 min", env=ENV,
    build=gpu_checks, header=(GPU_NAME, versions("torch", "triton", "transformers")),
    knobs={"TAG": "run", "EX_TIMEOUT": "150", "NGPU": ""}, args=(("what", "all"),),
    usage="parts: tests | examples | all; writes $OUT/gpu_suite_<part>.{log,json} and "
          "$OUT/examples_$TAG.log; NGPU overrides the GPU count nvidia-smi reports")

# tests/colossal/colossal_script.py at a Llama-7B layer shape: 2 layers, seq 2048, batch 2.
COLOSSAL = ("torchrun --standalone --nproc_per_node=1 tests/colossal/colossal_script.py -c 7b-2l "
            "-l 2048 -b 2 -s 10")
COLOSSAL_RUNS = (
    ("zero2_fp8", "-p zero2 --lazy --use-fp8"), ("zero2_bf16", "-p zero2 --lazy"),
    ("gemini_fp8", "-p gemini --lazy --use-fp8"), ("ddp_fp8", "-p ddp --use-fp8"),
    ("fsdp_fp8", "-p fsdp --use-fp8"), ("hybrid_fp8_ckpt", "-p 3d --zero 1 -g --lazy --use-fp8"),
    ("zero2_lora_fp8", "-p zero2 --lora --use-fp8"))
C_LOG = "{OUT}/colossal_gpu_{TAG}.log"


def parse_colossal_log(path: str) -> dict:
    """Each run's flags, JSON step rows, final row and exit status from the combined log."""
    runs, name = {}, None
    for line in read_lines(path):
        m = re.match(r"===== (\S+): (.*)", line)
        if m:
            name = m.group(1)
            runs[name] = {"flags": m.group(2), "steps": [], "rc": None}
        elif name and line.startswith('{"plugin"'):
            row = json.loads(line)
            (runs[name]["steps"].append(row) if "step" in row else runs[name].update(row))
        elif name and line.startswith("rc="):
            runs[name]["rc"] = int(line[3:])
    return runs


def colossal_summary(ctx: Ctx, rc: int) -> None:
    """The step-time table (median after 3 warm-up steps) and $OUT/colossal_gpu_$TAG.json."""
    import torch  # only here: the device name for the JSON (the runner itself stays light)

    runs = parse_colossal_log(ctx.raw(C_LOG))
    print(f"{'run':18} {'rc':>3} {'fp8/linear':>10} {'loss1':>7} {'lossN':>7} {'s/step':>7} "
          f"{'tok/s':>8}")
    for n, r in runs.items():
        secs = [s["sec"] for s in r["steps"][3:]]
        r["median_step_s"] = statistics.median(secs) if secs else None
        r["tokens_per_s"] = 2 * 2048 / r["median_step_s"] if secs else None
        losses = [s["loss"] for s in r["steps"]] or [0]
        layers = f"{r.get('fp8_layers')}/{r.get('linear_layers')}"
        print(f"{n:18} {r['rc']!s:>3} {layers:>10} {losses[0]:7.3f} {losses[-1]:7.3f} "
              f"{r['median_step_s'] or 0:7.3f} {r['tokens_per_s'] or 0:8.0f}")
    with open(ctx.raw("{OUT}/colossal_gpu_{TAG}.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "date": datetime.date.today().isoformat(),
                   "command": "TAG=... python bench/suite.py colossal-gpu", "runs": runs},
                  f, indent=1)


def colossal_gpu(ctx: Ctx) -> list[Step]:
    """Each plugin with --use-fp8 (and ZeRO-2 BF16), the granular GPU tests, the summary."""
    steps = []
    for name, flags in COLOSSAL_RUNS:
        log = f"/tmp/c_{name}.log"
        steps.append(Step(f"{COLOSSAL} {flags}", timeout="{RUN_TIMEOUT}", log=log, show=False,
                          after=append_run(C_LOG, name, flags, log, rc_line=True),
                          note=f"append '===== {name}: {flags}', the log and rc= to {C_LOG}"))
    g_log = "{OUT}/granular_gpu_{TAG}.log"
    steps.append(Step("python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu -rA "
                      "tests/fp8/test_granular_gpu.py", timeout=150, log=g_log, show=False,
                      after=log_report("granular gpu tests", g_log),
                      note=report_note("granular gpu tests")))
    steps.append(Step("", after=colossal_summary,
                      note="table of each run; write {OUT}/colossal_gpu_{TAG}.json"))
    return steps


COLOSSAL_GPU = Suite(
    "colossal-gpu", "run_colossal_gpu.sh",
    "a Colossal-AI-style script (fp8boost.colossal imports only) with each plugin and "
    "--use-fp8 at a Llama-7B layer shape", gpus="1", time="~10 min",
    env={"PYTHONPATH": "{ROOT}", **ENV}, build=colossal_gpu,
    header=(truncate(C_LOG), Step(GPU_NAME.cmd, check=False, log=C_LOG, append=True),
            Step(versions("torch", "triton", "transformers", "peft").cmd, check=False,
                 log=C_LOG, append=True)),
    knobs={"TAG": "run", "RUN_TIMEOUT": "120"},
    usage="TAG=h100; writes $OUT/colossal_gpu_$TAG.{log,json} and $OUT/granular_gpu_$TAG.log")

SUITES = (GPU_CHECKS, COLOSSAL_GPU)
