#!/usr/bin/env bash
# Issue 26 item 2 on one GPU: the Triton rowwise/blockwise quantizer tests, its bandwidth bench,
# and the eager rows of the recipes at 8B-4L.  OUT=... bash bench/run_granular_kernels_gpu.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rA -s tests/fp8/test_granular_kernels.py tests/fp8/test_granular_gpu.py 2>&1 | grep -v DEBUG > $OUT/granular_kernels_gpu_tests.log; echo "[tests] $(tail -1 $OUT/granular_kernels_gpu_tests.log)"; grep -E "^(FAILED|ERROR)" $OUT/granular_kernels_gpu_tests.log | cut -c1-200
timeout 150 python3 bench/cast_granular.py 2>&1 | tail -15
source bench/_torchao_wheel.sh
timeout 220 python3 bench/single_gpu.py --shapes 8b-4l --modes bf16_eager,fp8_eager_all,fp8_rowwise_eager,fp8_blockwise_eager --output $OUT/single_gpu_recipes_eager_h100.json 2>&1 | grep -v "^\[bench\]\|Warning\|warn" | tail -7
