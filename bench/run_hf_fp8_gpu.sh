#!/usr/bin/env bash
# GPU, one test: the block FP8 export through transformers' own FP8 path (issue 28): FP8Linear
# layers holding our float8_e4m3fn weights, their forward on the finegrained-fp8 Triton GEMM
# kernel, held-back loss within 1% of the BF16 export's; prints one "HF_FP8 {...}" line each
# for llama and qwen2.
#
# transformers gets that kernel from the Hugging Face hub, which the GPU machine cannot reach,
# so first, on a machine with the kernels-community mirror (this one):
#   bash bench/hub_kernel_offline.sh        # -> .hubkernels/finegrained_fp8 (gitignored)
# then on the GPU machine, run with carry=[".hubkernels"]:
#   TAG=h100 bash bench/run_hf_fp8_gpu.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}; TAG=${TAG:-run}
source "$(dirname "$0")/_torchao_wheel.sh"  # a no-op unless .whl/ was carried too
src=.hubkernels/finegrained_fp8/SOURCE.json
if [ -f "$src" ]; then echo "kernel: $(tr -d "\n" < "$src")"
else echo "no $src (carry=[\".hubkernels\"]?): the test skips unless the hub is reachable"; fi
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch, triton, transformers as t; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', t.__version__)"
log="$OUT/hf_fp8_gpu_$TAG.log"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu -rA -s \
  tests/export/test_export_gpu.py -k loads_in_transformers_fp8 2>&1 | grep -v DEBUG > "$log"
grep -o 'HF_FP8 {.*}' "$log"
grep -E "^(FAILED|ERROR|SKIPPED)|^E " "$log" | cut -c1-300
echo "[hf_fp8] $(tail -1 "$log") (log: $log)"
