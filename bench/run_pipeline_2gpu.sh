#!/usr/bin/env bash
# 2xH200: pipeline parallelism (HybridParallelPlugin pp2, 1F1B, 4 one-sequence micro-batches per
# step) on the 7B-8-layer bench model in BF16, use_fp8 and use_fp8 + FP8 stage boundaries,
# compiled, one torchrun per config (bench/scale.py); ZeRO-2 FP8 vs FP8 + FP8 comm after the
# fused direct path; then the NCCL/GPU tests (pipeline, hybrid, ZeRO, HF Trainer, accelerate FSDP2).
# Usage on the GPU machine: bash bench/run_pipeline_2gpu.sh [bench|zero|tests|all]
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}
KEEP='^\[(scale|bench)\] [a-z0-9_]+: |^config|^[a-z0-9_]+ +(ok|oom|error|crashed|timeout|not_)|Error'
T="--preset 7b-8l --batch-size 2 --seq-len 4096 --warmup 4 --steps 10 --nproc 2 --compile"
part="${1:-all}"
if [ "$part" = bench ] || [ "$part" = all ]; then
  timeout 270 python3 bench/scale.py $T --config-timeout 120 \
    --configs pp2_bf16,pp2_fp8,pp2_fp8_comm --output "$OUT/pipeline_2gpu_compiled.json" \
    2>&1 | grep -E "$KEEP" | tail -8
fi
if [ "$part" = zero ] || [ "$part" = all ]; then
  timeout 150 python3 bench/train.py $T --config-timeout 100 --configs zero2_fp8,zero2_fp8_comm \
    --output "$OUT/zero_direct_fused_2gpu_compiled.json" 2>&1 | grep -E "$KEEP" | tail -3
fi
if [ "$part" = tests ] || [ "$part" = all ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
    tests/parallel/test_nccl.py tests/test_new_user_hf_tools.py 2>&1 | tail -15
fi
