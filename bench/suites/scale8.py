"""Issue 15 on one 8-GPU host (8xH200): Colossal-AI's published FP8 configs through
bench/scale.py, one torchrun per config (except ``smoke``), every config compiled (plus FSDP2
BF16 eager). Each part fits one 10-minute device call.

Estimates: 2xH200 took ~50 s per compiled config of the 8-layer 7B model (BENCHMARKS 4b/4d);
32 layers reuse the same compiled graphs but each step is ~4x longer: ~80-100 s per config.
Per-config limit 180 s (7B) or 270 s (13B, 35B), so a hung config still leaves the part inside
its 570 s limit. Settings: LLaMA2-7B/13B bs 2 x 4096 tokens per GPU (tp/pp replicas take
2 x tp x pp sequences), pp2 with 1-sequence micro-batches, warm-up 4, median of 10 steps.
"""
from __future__ import annotations

from suites.actions import GPU_NAME_MEM
from suites.core import NCCL_ENV, Ctx, Step, Suite, SuiteError

# bench/scale.py's result lines (per config, merged tables, targets).
KEEP = (r"^\[scale\] [a-z0-9_]+: |^\[scale\] (merged|JSON)|^config|^target|"
        r"^[a-z0-9_]+ +(ok|NaN|oom|error|crashed|timeout|not_|skipped)|x[0-9]+, ")
G = "{OUT}/scale_{NPROC}gpu"
L7 = ("--preset llama2-7b --batch-size 2 --seq-len 4096 --warmup 4 --steps 10 --nproc {NPROC} "
      "--compile")
SEVEN_B = ("base", "zero", "gemini", "tp", "pp")


def fam(family: str) -> str:
    """A plugin family in BF16, use_fp8 and use_fp8 + fp8_communication."""
    return ",".join(f"{family}_{v}" for v in ("bf16", "fp8", "fp8_comm"))


PART7_CONFIGS = {"base": "fsdp2_bf16_eager,fsdp2_bf16,torchao_fsdp2", "zero": fam("zero2"),
                 "gemini": fam("gemini"), "tp": fam("tp2"), "pp": fam("pp2")}


def part7(name: str) -> Step:
    return Step(f"python3 bench/scale.py {L7} --config-timeout 180 --configs "
                f"{PART7_CONFIGS[name]} --output {G}_7b_{name}.json", timeout=570, keep=KEEP,
                tail=20)


def merge(scale: str, inputs: str, tail: int) -> Step:
    """One table of several parts' JSONs, with issue 15's targets checked (no GPU work)."""
    return Step(f"python3 bench/scale.py --merge {inputs} --scale {scale} "
                f"--output {G}_{scale}.json", keep=KEEP + "|Error", tail=tail)


MERGE7 = merge("7b", " ".join(f"{G}_7b_{p}.json" for p in SEVEN_B), 30)


def part35(ctx: Ctx, tp: int) -> Step:
    """Command-R-35B shape, tp{tp} + SP; RB8 / RB4 sequences per replica; AC=1: checkpointing."""
    ac = " --activation-checkpointing" if ctx.values["AC"] else ""
    rb = "{RB8}" if tp == 8 else "{RB4}"
    return Step(f"python3 bench/scale.py --preset command-r-35b --batch-size 1 --replica-batch {rb} "
                f"--seq-len 4096 --warmup 3 --steps 8 --nproc {{NPROC}} --compile "
                f"--config-timeout 270{ac} --configs tp{tp}sp_bf16,tp{tp}sp_fp8 "
                f"--output {G}_35b_tp{tp}.json", timeout=570, keep=KEEP, tail=20)


def smoke(n: int) -> list[Step]:
    """The whole matrix on n GPUs, small models, 2 steps, one torchrun per matrix."""
    tp35 = 8 if n >= 8 else n
    sm = ("--batch-size 2 --seq-len 256 --warmup 1 --steps 2 --fp8-min-numel 0 --compile "
          "--no-isolate {SMOKE_EXTRA}")
    run = f"python3 -m torch.distributed.run --standalone --nproc_per_node={n} bench/scale.py"
    c7 = ",".join(["fsdp2_bf16_eager,fsdp2_bf16,torchao_fsdp2"]
                  + [fam(f) for f in ("zero2", "gemini", "tp2", "pp2")])
    out = f"{{OUT}}/scale_smoke{n}"
    return [
        Step(f"{run} --preset small {sm} --configs {c7} --output {out}_7b.json", timeout=360,
             keep=KEEP + "|Error", tail=24),
        Step(f"{run} --preset small {sm} --best-of {out}_7b.json --output {out}_13b.json",
             timeout=360, keep=KEEP + "|Error", tail=6),
        Step(f"{run} --preset command-r-small {sm} --replica-batch 2 --configs "
             f"tp{tp35}sp_bf16,tp{tp35}sp_fp8 --output {out}_35b.json", timeout=360,
             keep=KEEP + "|Error", tail=6),
    ]


def scale_8gpu(ctx: Ctx) -> list[Step]:
    """The steps of one part (``7b`` and ``35b`` run their sub-parts, then merge)."""
    part = ctx.values["part"]
    if part == "smoke":
        if not ctx.values["n"].isdigit():
            raise SuiteError(f"8gpu smoke: N must be a GPU count, not {ctx.values['n']!r}")
        return smoke(int(ctx.values["n"]))
    if part.startswith("7b-") and part[3:] in SEVEN_B:
        return [part7(part[3:])]
    parts = {
        "7b-merge": [MERGE7],
        "7b": [part7(p) for p in SEVEN_B] + [MERGE7],
        "13b": [Step("python3 bench/scale.py --preset llama2-13b --batch-size 2 --seq-len 4096 "
                     "--warmup 4 --steps 10 --nproc {NPROC} --compile --config-timeout 270 "
                     f"--best-of {G}_7b.json " + " ".join(f"{G}_7b_{p}.json" for p in SEVEN_B[1:])
                     + f" --output {G}_13b.json", timeout=570, keep=KEEP, tail=12)],
        "35b-tp8": [part35(ctx, 8)],
        "35b-tp4": [part35(ctx, 4)],
        "35b": [part35(ctx, 8), part35(ctx, 4),
                merge("35b", f"{G}_35b_tp8.json {G}_35b_tp4.json", 12)],
    }
    if part not in parts:
        raise SuiteError(f"8gpu: unknown part {part!r}; parts: {', '.join(PARTS)}")
    return parts[part]


PARTS = ("smoke", *(f"7b-{p}" for p in SEVEN_B), "7b-merge", "7b", "13b", "35b-tp8", "35b-tp4",
         "35b")
SCALE_8GPU = Suite(
    "8gpu", "run_8gpu.sh",
    "issue 15 at scale: LLaMA2-7B/13B and a Command-R-35B shape, Colossal-AI's FP8 configs "
    "(bench/scale.py)", gpus="8", time="~5 min/part",
    env={"PYTHONUNBUFFERED": "1", **NCCL_ENV}, torchao=True, build=scale_8gpu,
    header=(Step(GPU_NAME_MEM.cmd, check=False, count=True),),
    knobs={"NPROC": "8", "RB8": "2", "RB4": "1", "AC": "", "SMOKE_EXTRA": ""},
    args=(("part", "help"), ("n", "2")),
    usage="parts: smoke N (the matrix on N GPUs, small models) | 7b-base | 7b-zero | "
          "7b-gemini | 7b-tp | 7b-pp | 7b-merge | 7b | 13b | 35b-tp8 | 35b-tp4 | 35b. NPROC=4: "
          "the same on 4 GPUs (JSON scale_4gpu_*); RB8/RB4: sequences per 35B replica; AC=1: "
          "activation checkpointing (35b); SMOKE_EXTRA adds arguments to the smoke runs (CPU "
          'check: SMOKE_EXTRA="--device cpu --vocab-size 256 --seq-len 64 --no-compile")')

SUITES = (SCALE_8GPU,)
