#!/usr/bin/env bash
# One device call on 2xH200: training throughput (2 GPUs and 1 GPU) and FP8 collectives.
# Usage on the GPU machine: bash bench/run_2gpu.sh   (writes JSON under $OUT or bench/results)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}
source "$(dirname "$0")/_torchao_wheel.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -4
T="--warmup 3 --steps 8"
timeout 270 torchrun --nproc_per_node=2 bench/train.py $T \
  --configs fsdp2_bf16,torchao_fsdp2,zero2_bf16,zero2_fp8,zero2_fp8_comm,zero1_fp8_comm,ddp_bf16,ddp_fp8,ddp_fp8_comm \
  --output "$OUT/train_2gpu.json" 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -30
timeout 130 torchrun --nproc_per_node=2 bench/comm.py --max-mb 1024 --iters 8 --warmup 2 \
  --ops all_gather,reduce_scatter,all_reduce --out "$OUT/comm_2gpu.json" 2>&1 | tail -30
CUDA_VISIBLE_DEVICES=0 timeout 100 torchrun --nproc_per_node=1 bench/train.py $T \
  --configs single_bf16,single_fp8 --output "$OUT/train_1gpu.json" 2>&1 | tail -12
