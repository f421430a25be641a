#!/usr/bin/env bash
# One H200: where does an FP8 linear layer stop paying? Whole-model step time, BF16 vs FP8 with
# every linear layer converted (min_numel 0) or only the larger ones.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
T="--warmup 3 --steps 8 --seq-len 2048 --batch-size 4"
b() { timeout 100 torchrun --nproc_per_node=1 bench/train.py $T "$@" 2>&1 | grep -E "^single|^config|x1," ; }
b --preset 125m --configs single_bf16,single_fp8 --fp8-min-numel 0 --output "$OUT/thr_125m_all.json"
b --preset 1b --configs single_bf16,single_fp8 --fp8-min-numel 0 --output "$OUT/thr_1b_all.json"
b --preset 1b --configs single_fp8 --fp8-min-numel 8000000 --output "$OUT/thr_1b_8m.json"
b --preset 7b-8l --configs single_bf16,single_fp8 --fp8-min-numel 0 --output "$OUT/thr_7b8l_all.json"
b --preset 7b-8l --configs single_fp8 --fp8-min-numel 20000000 --output "$OUT/thr_7b8l_20m.json"
