#!/usr/bin/env bash
# Single-GPU table (issue 11) on the device machine. Usage:
#   bash bench/run_single_gpu.sh tests          # GPU tests of the FP8 core (incl. compiled casts)
#   bash bench/run_single_gpu.sh gemm           # promoted-accumulation GEMM: Triton vs cuBLAS
#   bash bench/run_single_gpu.sh table [SHAPES] [MODES]   # bench/single_gpu.py (default: all)
# PROFILE_STEPS=3 adds each cell's kernel time per step by category (bench/_profile.py).
# torchao comes from a wheel carried in .whl/ (the device has no internet).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
source "$(dirname "$0")/_torchao_wheel.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
what=${1:-table}
case "$what" in
  tests)
    # the whole log under $OUT (a failure's traceback too); ~3 min on an H100 from cold
    timeout ${TEST_TIMEOUT:-360} python3 -m pytest tests/fp8 -m gpu -q -p no:cacheprovider \
      --tb=short 2>&1 | grep -v DEBUG | tee "$OUT/gpu_tests.log" | tail -25 ;;
  gemm)
    timeout ${GEMM_TIMEOUT:-240} python3 bench/gemm_promoted.py 2>&1 | tail -30 ;;
  table)
    shapes=${2:-1b,7b-4l,8b-4l}
    modes=${3:-bf16_eager,bf16_compiled,torchao_compiled,fp8_eager_default,fp8_eager_all,fp8_compiled_all}
    timeout ${TABLE_TIMEOUT:-560} python3 bench/single_gpu.py --shapes "$shapes" --modes "$modes" \
      --profile-steps ${PROFILE_STEPS:-0} \
      --output "$OUT/single_gpu_${TAG:-run}.json" 2>&1 | grep -v "^\[bench\]\|Warning\|warn" | tail -40 ;;
esac
