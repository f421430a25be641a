#!/usr/bin/env bash
# 2xH200: GeminiPlugin / TorchFSDPPlugin against FSDP2 BF16 and torchao float8 + FSDP2.
# Part "compiled" or "eager" (one device call each, ~8 min): the 7B-8-layer bench model,
# bs 2 x 4096 per GPU, one torchrun per config. Part "checks": NCCL tests of the FSDP plugins
# and the meta-device sharded load (peak memory per rank).
# Usage on the GPU machine: bash bench/run_fsdp_2gpu.sh compiled|eager|checks
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}
source "$(dirname "$0")/_torchao_wheel.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T="--preset 7b-8l --batch-size 2 --seq-len 4096 --warmup 4 --steps 10 --nproc 2 --config-timeout 170"
CONFIGS=fsdp2_bf16,torchao_fsdp2,gemini_bf16,gemini_fp8,gemini_fp8_comm
case "${1:-compiled}" in
  compiled)
    timeout 560 python3 bench/train.py $T --compile --configs $CONFIGS \
      --output "$OUT/fsdp_2gpu_compiled.json" 2>&1 | grep -E "^\[bench\] [a-z0-9_]+: |^config|^[a-z0-9_]+ +(ok|oom|error|crashed|timeout|not_)" | tail -30 ;;
  eager)
    timeout 560 python3 bench/train.py $T --configs $CONFIGS,torchfsdp_fp8_comm \
      --output "$OUT/fsdp_2gpu_eager.json" 2>&1 | grep -E "^\[bench\] [a-z0-9_]+: |^config|^[a-z0-9_]+ +(ok|oom|error|crashed|timeout|not_)" | tail -30 ;;
  checks)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_nccl.py 2>&1 | tail -5
    timeout 120 python3 bench/load_memory.py make --preset 7b-8l --path /tmp/ckpt_7b8l 2>&1 | tail -2
    timeout 200 torchrun --nproc_per_node=2 bench/load_memory.py load --path /tmp/ckpt_7b8l \
      --plugin gemini --output "$OUT/load_memory_2gpu.json" 2>&1 | grep "^\[load\]" ;;
esac
