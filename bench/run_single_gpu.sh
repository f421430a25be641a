#!/usr/bin/env bash
# Single-GPU table (issue 11) on the device machine. Usage:
#   bash bench/run_single_gpu.sh tests          # GPU tests of the FP8 core (incl. compiled casts)
#   bash bench/run_single_gpu.sh gemm           # promoted-accumulation GEMM: Triton vs cuBLAS
#   bash bench/run_single_gpu.sh table [SHAPES] [MODES]   # bench/single_gpu.py (default: all)
# torchao comes from a wheel carried in .whl/ (the device has no internet).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
what=${1:-table}
case "$what" in
  tests)
    timeout ${TEST_TIMEOUT:-240} python3 -m pytest tests/fp8 -m gpu -q -x -p no:cacheprovider 2>&1 | tail -25 ;;
  gemm)
    timeout ${GEMM_TIMEOUT:-240} python3 bench/gemm_promoted.py 2>&1 | tail -30 ;;
  table)
    shapes=${2:-1b,7b-4l,8b-4l}
    modes=${3:-bf16_eager,bf16_compiled,torchao_compiled,fp8_eager_default,fp8_eager_all,fp8_compiled_all}
    timeout ${TABLE_TIMEOUT:-560} python3 bench/single_gpu.py --shapes "$shapes" --modes "$modes" \
      --output "$OUT/single_gpu_${TAG:-run}.json" 2>&1 | grep -v "^\[bench\]\|Warning\|warn" | tail -40 ;;
esac
