#!/usr/bin/env bash
# 2xH200: HybridParallelPlugin (tp2, tp2 + sequence parallel) against FSDP2 BF16 and ZeRO-1 (dp2),
# the 7B-8-layer bench model, bs 2 x 4096 per GPU (a tp2 replica takes 4 sequences), one torchrun
# per config. Parts: "smoke" (tiny model, NCCL, 2 steps per config: catches errors cheaply),
# "compiled", "eager" (~8 min each), "zero" (ZeRO-2 FP8 comm with the direct FP8 weight path).
# Usage on the GPU machine: bash bench/run_hybrid_2gpu.sh smoke|compiled|eager|zero
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T="--preset 7b-8l --batch-size 2 --seq-len 4096 --warmup 4 --steps 10 --nproc 2 --config-timeout 150"
KEEP='^\[bench\] [a-z0-9_]+: |^config|^[a-z0-9_]+ +(ok|oom|error|crashed|timeout|not_)'
TP=tp2_bf16,tp2_fp8,tp2sp_bf16,tp2sp_fp8,tp2sp_fp8_comm
case "${1:-compiled}" in
  smoke)
    timeout 300 python3 bench/train.py --preset small --batch-size 2 --seq-len 256 --warmup 1 \
      --steps 2 --nproc 2 --fp8-min-numel 0 --configs tp2sp_fp8_comm,tp2_fp8 --compile \
      --output "$OUT/hybrid_2gpu_smoke.json" 2>&1 | grep -E "$KEEP|Error|error" | tail -20 ;;
  compiled)
    timeout 570 python3 bench/train.py $T --compile --configs fsdp2_bf16,$TP,zero1_fp8 \
      --output "$OUT/hybrid_2gpu_compiled.json" 2>&1 | grep -E "$KEEP" | tail -30 ;;
  eager)
    timeout 570 python3 bench/train.py $T --configs fsdp2_bf16,$TP,zero1_bf16,zero1_fp8 \
      --output "$OUT/hybrid_2gpu_eager.json" 2>&1 | grep -E "$KEEP" | tail -30 ;;
  zero)
    timeout 570 python3 bench/train.py $T --compile --configs zero2_bf16,zero2_fp8,zero2_fp8_comm \
      --output "$OUT/zero_direct_2gpu_compiled.json" 2>&1 | grep -E "$KEEP" | tail -30 ;;
esac
