#!/usr/bin/env bash
# Issue 26 on one GPU: the rowwise/blockwise GPU tests, then the one-GPU training table of the
# new recipes against BF16 compiled and torchao (tensorwise, rowwise) at one shape.
#   TAG=h100 SHAPE=8b-4l bash bench/run_granular_gpu.sh     (run with carry=[".whl"])
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}; TAG=${TAG:-run}; SHAPE=${SHAPE:-8b-4l}
source "$(dirname "$0")/_torchao_wheel.sh"
nvidia-smi --query-gpu=name --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu -rf \
    tests/fp8/test_granular_gpu.py tests/fp8/test_granular_linear.py 2>&1 | grep -v DEBUG \
    > "$OUT/granular_gpu_tests_$TAG.log"
  echo "[tests] rc=$? $(tail -1 "$OUT/granular_gpu_tests_$TAG.log")"
fi
modes=${MODES:-bf16_compiled,torchao_compiled,torchao_rowwise_compiled,fp8_compiled_all,fp8_rowwise_compiled,fp8_blockwise_compiled}
timeout ${TABLE_TIMEOUT:-540} python3 bench/single_gpu.py --shapes "$SHAPE" --modes "$modes" \
  --output "$OUT/single_gpu_granular_${TAG}.json" 2>&1 | grep -v "^\[bench\]\|Warning\|warn" | tail -20
