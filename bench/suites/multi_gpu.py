"""Two-GPU throughput suites (2xH200, NVLink): training configs, FP8 collectives, the FSDP,
hybrid and pipeline plugins. Each was one ``bench/run_*_2gpu.sh`` script; the steps, limits,
output names and filters are the scripts' own."""
from __future__ import annotations

from suites.actions import GPU_NAME_MEM, copy, print_tail
from suites.core import NCCL_ENV, Ctx, Step, Suite

ENV = {"PYTHONUNBUFFERED": "1", **NCCL_ENV}
# A config's result lines from bench/train.py / bench/scale.py (the rest is compile noise).
ROWS = r"^config|^[a-z0-9_]+ +(ok|oom|error|crashed|timeout|not_)"
BENCH_ROWS = r"^\[bench\] [a-z0-9_]+: |" + ROWS
NOISE = r"^\[bench\]|Warning|warn"
# The 7B-8-layer bench model, bs 2 x 4096 per GPU, one torchrun per config.
M7B8L = "--preset 7b-8l --batch-size 2 --seq-len 4096 --warmup 4 --steps 10 --nproc 2"

TRAIN_2GPU = Suite(
    "2gpu", "run_2gpu.sh", "training throughput on 2 GPUs and 1 GPU, and the FP8 collectives",
    gpus="2", time="~8 min", env=ENV, torchao=True,
    header=(GPU_NAME_MEM, Step("nvidia-smi topo -m", check=False, head=4)),
    parts={"": (
        Step("torchrun --nproc_per_node=2 bench/train.py --warmup 3 --steps 8 --configs "
             "fsdp2_bf16,torchao_fsdp2,zero2_bf16,zero2_fp8,zero2_fp8_comm,zero1_fp8_comm,"
             "ddp_bf16,ddp_fp8,ddp_fp8_comm --output {OUT}/train_2gpu.json",
             timeout=270, drop=r"^\s*$|Warning|warn", tail=30),
        Step("torchrun --nproc_per_node=2 bench/comm.py --max-mb 1024 --iters 8 --warmup 2 "
             "--ops all_gather,reduce_scatter,all_reduce --out {OUT}/comm_2gpu.json",
             timeout=130, tail=30),
        Step("torchrun --nproc_per_node=1 bench/train.py --warmup 3 --steps 8 "
             "--configs single_bf16,single_fp8 --output {OUT}/train_1gpu.json",
             timeout=100, env={"CUDA_VISIBLE_DEVICES": "0"}, tail=12),
    )})

COMM_ARGS = ("--min-mb 16 --max-mb 1024 --iters 20 --warmup 3 --ops all_gather,reduce_scatter "
             "--impls triton")
COMM_2GPU = Suite(
    "comm-2gpu", "run_comm_2gpu.sh",
    "FP8 vs BF16 collectives on 2 GPUs: NVLink, then NCCL's network transport (P2P/SHM off)",
    gpus="2", time="~5 min", env={"PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0",
                                  "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"},
    parts={"": (
        Step(f"torchrun --standalone --nproc_per_node=2 bench/comm.py {COMM_ARGS} "
             "--out {OUT}/comm_2gpu_nvlink.json", timeout=240,
             keep="bf16|fp8:|consumer|wire", tail=24),
        Step(f"torchrun --standalone --nproc_per_node=2 bench/comm.py {COMM_ARGS} "
             "--out {OUT}/comm_2gpu_net.json", timeout=300,
             env={"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
             keep="bf16|fp8:|consumer|wire", tail=24),
    )})


def final_curves(ctx: Ctx, rc: int) -> None:
    """After the two loss-curve runs: their metrics under $OUT, the last lines of each log."""
    copy("/tmp/conv_bf16/metrics.jsonl", f"{ctx.out}/conv_bf16.jsonl")
    copy("/tmp/conv_fp8/metrics.jsonl", f"{ctx.out}/conv_fp8.jsonl")
    for log in ("/tmp/conv_bf16.log", "/tmp/conv_fp8.log"):
        print(f"==> {log} <==", flush=True)
        print_tail(log, 3)


CURVE = ("python3 examples/train_llama.py --preset 125m --data {DATA} --steps 400 --batch-size 16 "
         "--seq-len 512 --no-progress --log-every 50")
FINAL = Suite(
    "final", "run_final.sh",
    "BF16-vs-FP8 loss curves (one GPU each, in parallel), FP8 core GPU tests, the example on "
    "NCCL, one-stage FP8 collectives, ZeRO FP8-comm buckets", gpus="2", time="~9 min", env=ENV,
    knobs={"DATA": ".data/shakespeare.txt"},
    parts={"": (
        Step(CURVE + " --out-dir /tmp/conv_bf16", timeout=200, background=True,
             env={"CUDA_VISIBLE_DEVICES": "0"}, log="/tmp/conv_bf16.log", show=False),
        Step(CURVE + " --use-fp8 --out-dir /tmp/conv_fp8", timeout=200, background=True,
             env={"CUDA_VISIBLE_DEVICES": "1"}, log="/tmp/conv_fp8.log", show=False,
             after=final_curves,
             note="cp /tmp/conv_{{bf16,fp8}}/metrics.jsonl {OUT}/conv_{{bf16,fp8}}.jsonl; "
                  "tail -3 both logs"),
        Step("python3 -m pytest tests/fp8/test_backends_gpu.py -q -p no:cacheprovider",
             timeout=150, tail=4),
        Step("torchrun --nproc_per_node=2 examples/train_llama.py --preset small --data {DATA} "
             "--plugin zero2 --use-fp8 --fp8-comm --steps 40 --no-progress --log-every 20 "
             "--out-dir /tmp/ex_zero2", timeout=90, tail=4),
        Step("torchrun --nproc_per_node=2 bench/comm.py --min-mb 16 --max-mb 1024 --iters 8 "
             "--warmup 2 --ops all_gather,reduce_scatter --impls triton "
             "--out {OUT}/comm_2gpu_1stage.json", timeout=90, keep="fp8:triton|bf16|wire",
             tail=16),
        Step("torchrun --nproc_per_node=2 bench/train.py --warmup 3 --steps 8 --bucket-m 64 "
             "--configs zero2_bf16,zero2_fp8,zero2_fp8_comm --output "
             "{OUT}/train_2gpu_bucket64.json", timeout=150, tail=6),
    )})

FSDP_CONFIGS = "fsdp2_bf16,torchao_fsdp2,gemini_bf16,gemini_fp8,gemini_fp8_comm"
FSDP_2GPU = Suite(
    "fsdp-2gpu", "run_fsdp_2gpu.sh",
    "GeminiPlugin / TorchFSDPPlugin vs FSDP2 BF16 and torchao + FSDP2 (7B-8L), or their NCCL "
    "checks", gpus="2", time="~8 min/part", env=ENV, torchao=True, header=(GPU_NAME_MEM,),
    args=(("part", "compiled"),),
    usage="parts: compiled | eager (the 7B-8-layer bench model, one torchrun per config) | "
          "checks (NCCL tests of the FSDP plugins, meta-device sharded load's peak memory)",
    parts={
        "compiled": (Step(f"python3 bench/train.py {M7B8L} --config-timeout 170 --compile "
                          f"--configs {FSDP_CONFIGS} --output {{OUT}}/fsdp_2gpu_compiled.json",
                          timeout=560, keep=BENCH_ROWS, tail=30),),
        "eager": (Step(f"python3 bench/train.py {M7B8L} --config-timeout 170 --configs "
                       f"{FSDP_CONFIGS},torchfsdp_fp8_comm --output {{OUT}}/fsdp_2gpu_eager.json",
                       timeout=560, keep=BENCH_ROWS, tail=30),),
        "checks": (
            Step("python3 -m pytest -q -p no:cacheprovider tests/parallel/test_nccl.py",
                 timeout=200, tail=5),
            Step("python3 bench/load_memory.py make --preset 7b-8l --path /tmp/ckpt_7b8l",
                 timeout=120, tail=2),
            Step("torchrun --nproc_per_node=2 bench/load_memory.py load --path /tmp/ckpt_7b8l "
                 "--plugin gemini --output {OUT}/load_memory_2gpu.json", timeout=200,
                 keep=r"^\[load\]"),
        )})

FSDP_DIRECT_2GPU = Suite(
    "fsdp-direct-2gpu", "run_fsdp_direct_2gpu.sh",
    "NCCL tests of the FSDP plugins, then Gemini BF16/FP8/FP8-comm compiled (direct FP8 "
    "all-gather)", gpus="2", time="~9 min", env=ENV,
    parts={"": (
        Step("python3 -m pytest -q -p no:cacheprovider tests/parallel/test_nccl.py",
             timeout=150, tail=3),
        Step(f"python3 bench/train.py {M7B8L} --config-timeout 170 --compile --configs "
             "gemini_bf16,gemini_fp8,gemini_fp8_comm --output "
             "{OUT}/fsdp_direct_2gpu_compiled.json", timeout=400, keep=ROWS, tail=8),
    )})

HYBRID_T = f"{M7B8L} --config-timeout 150"
HYBRID_TP = "tp2_bf16,tp2_fp8,tp2sp_bf16,tp2sp_fp8,tp2sp_fp8_comm"
HYBRID_2GPU = Suite(
    "hybrid-2gpu", "run_hybrid_2gpu.sh",
    "HybridParallelPlugin tp2 / tp2+SP vs FSDP2 BF16 and ZeRO (7B-8L), or ZeRO-2's direct FP8 "
    "path", gpus="2", time="~8 min/part", env=ENV, header=(GPU_NAME_MEM,),
    args=(("part", "compiled"),),
    usage="parts: smoke (tiny model, 2 steps per config) | compiled | eager | zero (ZeRO-2 "
          "FP8 comm with the direct FP8 weight path)",
    parts={
        "smoke": (Step("python3 bench/train.py --preset small --batch-size 2 --seq-len 256 "
                       "--warmup 1 --steps 2 --nproc 2 --fp8-min-numel 0 --configs "
                       "tp2sp_fp8_comm,tp2_fp8 --compile --output {OUT}/hybrid_2gpu_smoke.json",
                       timeout=300, keep=BENCH_ROWS + "|Error|error", tail=20),),
        "compiled": (Step(f"python3 bench/train.py {HYBRID_T} --compile --configs "
                          f"fsdp2_bf16,{HYBRID_TP},zero1_fp8 --output "
                          "{OUT}/hybrid_2gpu_compiled.json", timeout=570, keep=BENCH_ROWS,
                          tail=30),),
        "eager": (Step(f"python3 bench/train.py {HYBRID_T} --configs "
                       f"fsdp2_bf16,{HYBRID_TP},zero1_bf16,zero1_fp8 --output "
                       "{OUT}/hybrid_2gpu_eager.json", timeout=570, keep=BENCH_ROWS, tail=30),),
        "zero": (Step(f"python3 bench/train.py {HYBRID_T} --compile --configs "
                      "zero2_bf16,zero2_fp8,zero2_fp8_comm --output "
                      "{OUT}/zero_direct_2gpu_compiled.json", timeout=570, keep=BENCH_ROWS,
                      tail=30),),
    })

PIPE_KEEP = r"^\[(scale|bench)\] [a-z0-9_]+: |" + ROWS + "|Error"


def _schedule(style: str, configs: str, timeout: int) -> Step:
    """pp2 with ``style`` at 8 one-sequence micro-batches (4 x 4096 tokens per GPU)."""
    return Step(f"python3 bench/scale.py {M7B8L.replace('--batch-size 2', '--batch-size 4')} "
                f"--compile --config-timeout 110 --configs {configs} --pp-style {style} "
                f"--output {{OUT}}/pipeline_2gpu_{style}_mb8_compiled.json", timeout=timeout,
                keep=PIPE_KEEP, tail=12)

PIPELINE_2GPU = Suite(
    "pipeline-2gpu", "run_pipeline_2gpu.sh",
    "pp2 (1F1B) BF16/FP8/FP8 stage boundaries compiled, ZeRO-2 fused direct path, NCCL/GPU tests",
    gpus="2", time="~9 min", env=ENV, args=(("part", "all"),),
    usage="parts: bench (pp2, bench/scale.py) | zero (ZeRO-2 FP8 vs FP8 + FP8 comm) | tests "
          "(pipeline, hybrid, ZeRO, HF Trainer, accelerate FSDP2) | schedules (pp2 BF16 and "
          "FP8, 1f1b and interleaved, 8 micro-batches: parts 1f1b, with FSDP2 BF16, and "
          "interleaved) | all",
    parts={
        "bench": (Step(f"python3 bench/scale.py {M7B8L} --compile --config-timeout 120 "
                       "--configs pp2_bf16,pp2_fp8,pp2_fp8_comm --output "
                       "{OUT}/pipeline_2gpu_compiled.json", timeout=270, keep=PIPE_KEEP,
                       tail=8),),
        "zero": (Step(f"python3 bench/train.py {M7B8L} --compile --config-timeout 100 "
                      "--configs zero2_fp8,zero2_fp8_comm --output "
                      "{OUT}/zero_direct_fused_2gpu_compiled.json", timeout=150, keep=PIPE_KEEP,
                      tail=3),),
        "tests": (Step('python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" '
                       "tests/parallel/test_nccl.py tests/test_new_user_hf_tools.py",
                       timeout=150, tail=15),),
        # issue 36 item 3: the schedules a user would pick, 8 one-sequence micro-batches; the
        # 1F1B call also runs FSDP2 BF16 at the same tokens per GPU (a row to beat)
        "schedules": ("1f1b", "interleaved"),
        "1f1b": (_schedule("1f1b", "fsdp2_bf16,pp2_bf16,pp2_fp8", 340),),
        "interleaved": (_schedule("interleaved", "pp2_bf16,pp2_fp8", 280),),
        "all": ("bench", "zero", "tests"),
    })

SUITES = (TRAIN_2GPU, COMM_2GPU, FINAL, FSDP_2GPU, FSDP_DIRECT_2GPU, HYBRID_2GPU, PIPELINE_2GPU)
