"""One-GPU suites: the single-GPU table, the rowwise/blockwise recipes, the MoE step table,
the FP8 layer threshold, the torchao probe and transformers' FP8 loading of our export. Each
was one ``bench/run_*.sh`` script; the steps, limits, output names and filters are its own."""
from __future__ import annotations

import os

from suites.actions import (GPU_NAME, GPU_NAME_MEM, HF_FP8, NOT_PASSED, log_report,
                            report_note, versions)
from suites.core import Ctx, Step, Suite

# bench/single_gpu.py's progress lines and library warnings (the table is what matters).
NOISE = r"^\[bench\]|Warning|warn"
# The transformers FP8 kernel copied by bench/hub_kernel_offline.sh (carry=[".hubkernels"]).
HUB_SOURCE = ".hubkernels/finegrained_fp8/SOURCE.json"

SINGLE_GPU = Suite(
    "single-gpu", "run_single_gpu.sh",
    "the single-GPU table (BF16 / torchao / fp8boost modes by shape), FP8 core GPU tests, or "
    "the promoted GEMM", gpus="1", time="~9 min/part", torchao=True,
    header=(GPU_NAME_MEM,),
    knobs={"TAG": "run", "TEST_TIMEOUT": "360", "GEMM_TIMEOUT": "240", "TABLE_TIMEOUT": "560",
           "PROFILE_STEPS": "0"},
    args=(("what", "table"), ("shapes", "1b,7b-4l,8b-4l"),
          ("modes", "bf16_eager,bf16_compiled,torchao_compiled,fp8_eager_default,fp8_eager_all,"
                    "fp8_compiled_all")),
    usage="single-gpu tests | gemm | table [SHAPES] [MODES]; PROFILE_STEPS=3 adds each cell's "
          "kernel time per step by category (bench/_profile.py); JSON: single_gpu_$TAG.json",
    parts={
        # the whole log under $OUT (a failure's traceback too); ~3 min on an H100 from cold
        "tests": (Step("python3 -m pytest tests/fp8 -m gpu -q -p no:cacheprovider --tb=short",
                       timeout="{TEST_TIMEOUT}", drop="DEBUG", log="{OUT}/gpu_tests.log",
                       tail=25),),
        "gemm": (Step("python3 bench/gemm_promoted.py", timeout="{GEMM_TIMEOUT}", tail=30),),
        "table": (Step("python3 bench/single_gpu.py --shapes {shapes} --modes {modes} "
                       "--profile-steps {PROFILE_STEPS} --output {OUT}/single_gpu_{TAG}.json",
                       timeout="{TABLE_TIMEOUT}", drop=NOISE, tail=40),),
    })


def threshold_run(preset: str, configs: str, min_numel: int, out: str) -> Step:
    """One row group of the threshold table (bs 4 x seq 2048, 3 warm-up + 8 steps)."""
    return Step(f"torchrun --nproc_per_node=1 bench/train.py --warmup 3 --steps 8 --seq-len 2048 "
                f"--batch-size 4 --preset {preset} --configs {configs} --fp8-min-numel "
                f"{min_numel} --output {{OUT}}/{out}", timeout=100, keep=r"^single|^config|x1,")


BF16_FP8 = "single_bf16,single_fp8"
THRESHOLD = Suite(
    "threshold", "run_threshold.sh",
    "where an FP8 linear stops paying: whole-model step time, BF16 vs FP8 (all layers or the "
    "larger ones)", gpus="1", time="~6 min",
    parts={"": (threshold_run("125m", BF16_FP8, 0, "thr_125m_all.json"),
                threshold_run("1b", BF16_FP8, 0, "thr_1b_all.json"),
                threshold_run("1b", "single_fp8", 8000000, "thr_1b_8m.json"),
                threshold_run("7b-8l", BF16_FP8, 0, "thr_7b8l_all.json"),
                threshold_run("7b-8l", "single_fp8", 20000000, "thr_7b8l_20m.json"))})

PROBE = Suite(
    "probe", "run_probe_1gpu.sh",
    "torchao imports beside this torch, and compiled rows prove they compiled (7B-8L, 4 layers)",
    gpus="1", time="~7 min", torchao=True,
    header=(GPU_NAME_MEM, versions("torch", "torchao", "triton")),
    parts={"": (Step("python3 bench/train.py --preset 7b-8l --layers 4 --batch-size 2 "
                     "--seq-len 4096 --warmup 4 --steps 10 --nproc 1 --compile --configs "
                     "single_bf16,single_fp8,fsdp2_bf16,torchao_fsdp2 --config-timeout 150 "
                     "--output {OUT}/probe_1gpu_compiled.json", timeout=420,
                     keep=r"^\[bench\]|config|ok|not_compiled|error|Error", tail=30),)})


def granular_gpu(ctx: Ctx) -> list[Step]:
    """The rowwise/blockwise GPU tests (unless SKIP_TESTS is set), then the recipes' table."""
    log = "{OUT}/granular_gpu_tests_{TAG}.log"
    tests = [Step("python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu -rf "
                  "tests/fp8/test_granular_gpu.py tests/fp8/test_granular_linear.py",
                  timeout=200, drop="DEBUG", log=log, show=False,
                  after=log_report("tests", log), note=report_note("tests"))]
    table = Step("python3 bench/single_gpu.py --shapes {SHAPE} --modes {MODES} "
                 "--output {OUT}/single_gpu_granular_{TAG}.json", timeout="{TABLE_TIMEOUT}",
                 drop=NOISE, tail=20)
    return ([] if ctx.values["SKIP_TESTS"] else tests) + [table]


GRANULAR_GPU = Suite(
    "granular-gpu", "run_granular_gpu.sh",
    "rowwise/blockwise GPU tests, then the recipes' one-GPU table vs BF16 and torchao at SHAPE",
    gpus="1", time="~9 min", torchao=True, header=(GPU_NAME,), build=granular_gpu,
    knobs={"TAG": "run", "SHAPE": "8b-4l", "SKIP_TESTS": "", "TABLE_TIMEOUT": "540",
           "MODES": "bf16_compiled,torchao_compiled,torchao_rowwise_compiled,fp8_compiled_all,"
                    "fp8_rowwise_compiled,fp8_blockwise_compiled"},
    usage="TAG=h100 SHAPE=8b-4l (carry .whl); SKIP_TESTS=1 runs the table only")

KERNELS_LOG = "{OUT}/granular_kernels_gpu_tests.log"
GRANULAR_KERNELS_GPU = Suite(
    "granular-kernels-gpu", "run_granular_kernels_gpu.sh",
    "Triton rowwise/blockwise quantizer tests, their bandwidth bench, the recipes' eager rows "
    "at 8B-4L", gpus="1", time="~10 min", torchao=True,
    env={"PYTHONPATH": "{ROOT}", "PYTHONUNBUFFERED": "1"},
    parts={"": (
        Step("python3 -m pytest -q -p no:cacheprovider -m gpu -rA -s "
             "tests/fp8/test_granular_kernels.py tests/fp8/test_granular_gpu.py", timeout=200,
             drop="DEBUG", log=KERNELS_LOG, show=False,
             after=log_report("tests", KERNELS_LOG, [(r"^(FAILED|ERROR)", False, 200)],
                              with_rc=False), note=report_note("tests", [("^(FAILED|ERROR)",
                                                                          False, 200)])),
        # --quick: 2 shapes x 5 layouts, each compiled three ways (cast, norm + cast, norm);
        # --graph: kernel time (CUDA graph replays), as eager launches measure the host
        Step("python3 bench/cast_granular.py --quick --graph", timeout=300, tail=15),
        # the JSON name says h100: the one GPU these rows were first measured on (BENCHMARKS 4h)
        Step("python3 bench/single_gpu.py --shapes 8b-4l --modes bf16_eager,fp8_eager_all,"
             "fp8_rowwise_eager,fp8_blockwise_eager --output "
             "{OUT}/single_gpu_recipes_eager_h100.json", timeout=220, drop=NOISE, tail=7),
    )})

NEW_LOG = "{OUT}/new_gpu_tests_{TAG}.log"
NEW_GREPS = ((NOT_PASSED, False, 200), (HF_FP8, True, 0))
NEW_GPU_CHECKS = Suite(
    "new-gpu-checks", "run_new_gpu_checks.sh",
    "GPU tests of issues 26-28 (granular, FP8 MoE, export), the MoE GEMM bench, the new "
    "recipes' table", gpus="1", time="~10 min", torchao=True, header=(GPU_NAME,),
    knobs={"TAG": "run", "SHAPE": "8b-4l", "TEST_TIMEOUT": "240", "MOE_TIMEOUT": "150",
           "TABLE_TIMEOUT": "400",
           "MODES": "bf16_compiled,torchao_rowwise_compiled,fp8_rowwise_compiled,"
                    "fp8_blockwise_compiled"},
    args=(("part", "all"),),
    usage="parts: tests | moe | table | all; the export test needs .hubkernels/ "
          "(bash bench/hub_kernel_offline.sh here first; carry .whl and .hubkernels)",
    parts={
        "tests": (Step("python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu -rA -s "
                       "tests/fp8/test_granular_gpu.py tests/fp8/test_moe_gpu.py "
                       "tests/export/test_export_gpu.py", timeout="{TEST_TIMEOUT}",
                       drop="DEBUG", log=NEW_LOG, show=False,
                       after=log_report("tests", NEW_LOG, NEW_GREPS),
                       note=report_note("tests", NEW_GREPS)),),
        "moe": (Step("python3 bench/moe_gemm.py --quick", timeout="{MOE_TIMEOUT}",
                     env={"OUT": "{OUT}"}, tail=12),),
        "table": (Step("python3 bench/single_gpu.py --shapes {SHAPE} --modes {MODES} "
                       "--output {OUT}/single_gpu_recipes_{TAG}.json",
                       timeout="{TABLE_TIMEOUT}", drop=NOISE, tail=9),),
        "all": ("tests", "moe", "table"),
    })


def hub_source(ctx: Ctx, rc: int) -> None:
    """Which hub kernel the export test will load, or why it will skip."""
    if os.path.isfile(HUB_SOURCE):
        with open(HUB_SOURCE) as f:
            print("kernel: " + f.read().replace("\n", ""), flush=True)
    else:
        print(f'no {HUB_SOURCE} (carry=[".hubkernels"]?): the test skips unless the hub is '
              "reachable", flush=True)


HF_LOG = "{OUT}/hf_fp8_gpu_{TAG}.log"
HF_GREPS = ((HF_FP8, True, 0), (r"^(FAILED|ERROR|SKIPPED)|^E ", False, 300))
HF_FP8_GPU = Suite(
    "hf-fp8-gpu", "run_hf_fp8_gpu.sh",
    "the block FP8 export through transformers' own FP8 path (hub kernel): one HF_FP8 line "
    "each for llama and qwen2", gpus="1", time="~3 min", torchao=True,
    knobs={"TAG": "run", "TEST_TIMEOUT": "300"},
    header=(Step("", after=hub_source, note=f"print {HUB_SOURCE}, or that it is missing"),
            GPU_NAME, versions("torch", "triton", "transformers")),
    usage="first, where the kernels-community mirror is: bash bench/hub_kernel_offline.sh; "
          'then on the GPU machine with carry=[".hubkernels"]: TAG=h100 python bench/suite.py '
          "hf-fp8-gpu",
    parts={"": (Step("python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu -rA -s "
                     "tests/export/test_export_gpu.py -k loads_in_transformers_fp8",
                     timeout="{TEST_TIMEOUT}", drop="DEBUG", log=HF_LOG, show=False,
                     after=log_report("hf_fp8", HF_LOG, HF_GREPS, with_rc=False,
                                      suffix=" (log: " + HF_LOG + ")", summary_last=True),
                     note=report_note("hf_fp8", HF_GREPS)),)})

MOE_STEP = Suite(
    "moe-step", "run_moe_step_1gpu.sh",
    "MoE GPU tests, then the compiled MoE step table (BF16 grouped_mm vs FP8 + ablations), or "
    "the MoE GEMM bench", gpus="1", time="~9 min", header=(GPU_NAME_MEM,),
    knobs={"TAG": "run", "TEST_TIMEOUT": "150", "TABLE_TIMEOUT": "430", "CELL_TIMEOUT": "100",
           "GEMM_TIMEOUT": "500", "GEMM_ARGS": ""},
    args=(("what", "all"), ("shapes", "mixtral,qwen3"),
          ("modes", "bf16_compiled,fp8_compiled,fp8fast_compiled,fp8hpw_compiled,"
                    "fp8default_compiled")),
    usage="moe-step [all | table [SHAPES] [MODES] | tests | gemm]; CELL_TIMEOUT (100 s): "
          "fp8default cells time the experts' precision and tune kernels first (~2 min cold)",
    parts={
        "gemm": (Step("python3 bench/moe_gemm.py --quick {GEMM_ARGS}", timeout="{GEMM_TIMEOUT}",
                      drop=r"^\{", tail=40),),
        "tests": (Step("python3 -m pytest -q -p no:cacheprovider --tb=short "
                       "tests/fp8/test_moe_gpu.py tests/fp8/test_moe_cast_kernels.py -m gpu",
                       timeout="{TEST_TIMEOUT}", drop="DEBUG", log="{OUT}/moe_gpu_tests.log",
                       tail=8),),
        "table": (Step("python3 bench/moe_step.py --shapes {shapes} --modes {modes} --warmup 3 "
                       "--steps 6 --profile-steps 2 --cell-timeout {CELL_TIMEOUT} "
                       "--output {OUT}/moe_step_{TAG}.json", timeout="{TABLE_TIMEOUT}",
                       drop=r"^\|---", tail=40),),
        "all": ("tests", "table"),
    })

SUITES = (SINGLE_GPU, THRESHOLD, PROBE, GRANULAR_GPU, GRANULAR_KERNELS_GPU, NEW_GPU_CHECKS,
          HF_FP8_GPU, MOE_STEP)
