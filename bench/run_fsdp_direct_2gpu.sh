#!/usr/bin/env bash
# 2xH200: NCCL tests of the FSDP plugins (Triton FP8, direct FP8 all-gather path), then Gemini
# use_fp8 with and without fp8_communication, compiled, one torchrun each (same run, same tree).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_nccl.py 2>&1 | tail -3
T="--preset 7b-8l --batch-size 2 --seq-len 4096 --warmup 4 --steps 10 --nproc 2 --config-timeout 170"
timeout 400 python3 bench/train.py $T --compile --configs gemini_bf16,gemini_fp8,gemini_fp8_comm \
  --output "$OUT/fsdp_direct_2gpu_compiled.json" 2>&1 | grep -E "^config|^[a-z0-9_]+ +(ok|oom|error|crashed|timeout|not_)" | tail -8
