#!/usr/bin/env bash
# Issue 34 on one GPU (nvidia-h100-x1), one device call of under 10 minutes:
#   bash bench/run_moe_step_1gpu.sh            # MoE GPU tests, then the compiled step table
#   bash bench/run_moe_step_1gpu.sh table [SHAPES] [MODES]
#   bash bench/run_moe_step_1gpu.sh gemm       # bench/moe_gemm.py --quick (GEMMs, casts GB/s)
# The table's modes: BF16 compiled (transformers' grouped_mm experts), fp8boost FP8 compiled,
# and two ablations (fast accumulation in every GEMM; the experts' weight gradient in BF16),
# each cell one process with a 2-step kernel profile (bench/_moe_profile.py). CELL_TIMEOUT
# (100 s): fp8default cells time the experts' precision and tune the kernels first (~2 min cold).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
what=${1:-all}
if [ "$what" = gemm ]; then
  timeout ${GEMM_TIMEOUT:-500} python3 bench/moe_gemm.py --quick ${GEMM_ARGS:-} 2>&1 | grep -v "^{" | tail -40
  exit
fi
if [ "$what" = all ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --tb=short \
    tests/fp8/test_moe_gpu.py tests/fp8/test_moe_cast_kernels.py -m gpu 2>&1 \
    | grep -v DEBUG | tee "$OUT/moe_gpu_tests.log" | tail -8
fi
shapes=${2:-mixtral,qwen3}
modes=${3:-bf16_compiled,fp8_compiled,fp8fast_compiled,fp8hpw_compiled,fp8default_compiled}
timeout ${TABLE_TIMEOUT:-430} python3 bench/moe_step.py --shapes "$shapes" --modes "$modes" \
  --warmup 3 --steps 6 --profile-steps 2 --cell-timeout ${CELL_TIMEOUT:-100} \
  --output "$OUT/moe_step_${TAG:-run}.json" 2>&1 | grep -v "^|---" | tail -40
