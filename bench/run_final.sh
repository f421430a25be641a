#!/usr/bin/env bash
# Device call on 2xH200: GPU tests, FP8 collectives (one-stage default), ZeRO FP8-comm bucket
# sizes, an NCCL run of the example, and a BF16-vs-FP8 loss-curve run (one GPU each, in parallel).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}
DATA=${DATA:-.data/shakespeare.txt}
# 1. loss curves, BF16 on GPU0 and FP8 on GPU1 at the same time (background)
C="examples/train_llama.py --preset 125m --data $DATA --steps 400 --batch-size 16 --seq-len 512 --no-progress --log-every 50"
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 $C --out-dir /tmp/conv_bf16 > /tmp/conv_bf16.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 200 python3 $C --use-fp8 --out-dir /tmp/conv_fp8 > /tmp/conv_fp8.log 2>&1 &
wait
cp /tmp/conv_bf16/metrics.jsonl "$OUT/conv_bf16.jsonl"; cp /tmp/conv_fp8/metrics.jsonl "$OUT/conv_fp8.jsonl"
tail -3 /tmp/conv_bf16.log /tmp/conv_fp8.log
# 2. GPU tests of the FP8 core (cuBLAS/Triton vs emulated)
timeout 150 python3 -m pytest tests/fp8/test_backends_gpu.py -q -p no:cacheprovider 2>&1 | tail -4
# 3. the example under torchrun on NCCL: ZeRO-2 + FP8 + FP8 comm
timeout 90 torchrun --nproc_per_node=2 examples/train_llama.py --preset small --data $DATA --plugin zero2 \
  --use-fp8 --fp8-comm --steps 40 --no-progress --log-every 20 --out-dir /tmp/ex_zero2 2>&1 | tail -4
# 4. FP8 collectives, one stage (the new default) vs BF16
timeout 90 torchrun --nproc_per_node=2 bench/comm.py --min-mb 16 --max-mb 1024 --iters 8 --warmup 2 \
  --ops all_gather,reduce_scatter --impls triton --out "$OUT/comm_2gpu_1stage.json" 2>&1 | grep -E "fp8:triton|bf16|wire" | tail -16
# 5. ZeRO FP8 communication with bigger buckets
timeout 150 torchrun --nproc_per_node=2 bench/train.py --warmup 3 --steps 8 --bucket-m 64 \
  --configs zero2_bf16,zero2_fp8,zero2_fp8_comm --output "$OUT/train_2gpu_bucket64.json" 2>&1 | tail -6
