#!/usr/bin/env bash
# Probe on one GPU: torchao imports beside this torch, and compiled rows prove they compiled
# (one config per process). Usage on the GPU machine: bash bench/run_probe_1gpu.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
source "$(dirname "$0")/_torchao_wheel.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, torchao, triton; print('torch', torch.__version__, 'torchao', torchao.__version__, 'triton', triton.__version__)"
T="--preset 7b-8l --layers 4 --batch-size 2 --seq-len 4096 --warmup 4 --steps 10 --nproc 1"
timeout 420 python3 bench/train.py $T --compile --configs single_bf16,single_fp8,fsdp2_bf16,torchao_fsdp2 \
  --config-timeout 150 --output "$OUT/probe_1gpu_compiled.json" 2>&1 | grep -E "^\[bench\]|config|ok|not_compiled|error|Error" | tail -30
