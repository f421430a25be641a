#!/usr/bin/env bash
# FP8 collectives against BF16 on 2 GPUs (issue 12): NVLink, then NCCL's network transport on
# the same host (P2P and shared memory off: a stand-in for an inter-node link, not a real NIC).
#   bash bench/run_comm_2gpu.sh            # -> $OUT/comm_2gpu_{nvlink,net}.json
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-bench/results}
A="--min-mb 16 --max-mb 1024 --iters 20 --warmup 3 --ops all_gather,reduce_scatter --impls triton"
timeout 240 torchrun --standalone --nproc_per_node=2 bench/comm.py $A --out "$OUT/comm_2gpu_nvlink.json" \
  2>&1 | grep -E "bf16|fp8:|consumer|wire" | tail -24
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout 300 torchrun --standalone --nproc_per_node=2 bench/comm.py $A \
  --out "$OUT/comm_2gpu_net.json" 2>&1 | grep -E "bf16|fp8:|consumer|wire" | tail -24
