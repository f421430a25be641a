#!/usr/bin/env bash
# One call for the new work's GPU checks (issues 26, 27, 28) on one GPU:
#   1. gpu tests: rowwise/blockwise (incl. compiled, no graph breaks), FP8 MoE experts
#      (torch._scaled_grouped_mm vs emulated), the block export loaded by transformers on CUDA;
#   2. bench/moe_gemm.py --quick (FP8 vs BF16 grouped GEMMs at Qwen3-30B-A3B / Mixtral shapes);
#   3. the one-GPU training table of the new recipes at SHAPE (run with carry=[".whl"]).
#   The transformers-FP8 export test needs .hubkernels/ (bench/hub_kernel_offline.sh, run here
#   first; carry=[".whl", ".hubkernels"]), else it skips: the hub is unreachable there.
#   TAG=h100 bash bench/run_new_gpu_checks.sh [tests|moe|table|all]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}; TAG=${TAG:-run}; SHAPE=${SHAPE:-8b-4l}; what=${1:-all}
source "$(dirname "$0")/_torchao_wheel.sh"
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu -rA -s \
    tests/fp8/test_granular_gpu.py tests/fp8/test_moe_gpu.py tests/export/test_export_gpu.py \
    2>&1 | grep -v DEBUG > "$OUT/new_gpu_tests_$TAG.log"
  echo "[tests] rc=$? $(tail -1 "$OUT/new_gpu_tests_$TAG.log")"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/new_gpu_tests_$TAG.log" | cut -c1-200
  grep -o 'HF_FP8 {.*}' "$OUT/new_gpu_tests_$TAG.log"  # transformers' FP8 forward: both losses
fi
if [ "$what" = all ] || [ "$what" = moe ]; then
  OUT=$OUT timeout ${MOE_TIMEOUT:-150} python3 bench/moe_gemm.py --quick 2>&1 | tail -12
fi
if [ "$what" = all ] || [ "$what" = table ]; then
  modes=${MODES:-bf16_compiled,torchao_rowwise_compiled,fp8_rowwise_compiled,fp8_blockwise_compiled}
  timeout ${TABLE_TIMEOUT:-400} python3 bench/single_gpu.py --shapes "$SHAPE" --modes "$modes" \
    --output "$OUT/single_gpu_recipes_${TAG}.json" 2>&1 | grep -v "^\[bench\]\|Warning\|warn" | tail -9
fi
