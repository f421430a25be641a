#!/usr/bin/env bash
# Convergence of the FP8 recipes (issue 26, item 5) on one GPU: a 125M Llama (byte-level
# tokens) for 2000 steps on ../shared/data/shakespeare.txt (carried as .data/shakespeare.txt:
# run with carry=[".data"]), the same data order, seed and schedule in every run; FP8 runs
# convert every decoder linear (--fp8-min-numel 0). Batch 6 x 512 (the 2-GPU script's 2 x 3).
#   bash bench/run_convergence_1gpu.sh [bf16,tensorwise,rowwise,blockwise]
# JSONL per run -> $OUT/convergence_1gpu_<run>.jsonl; plot with bench/plot_convergence.py.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}; DATA=${DATA:-.data/shakespeare.txt}; STEPS=${STEPS:-2000}
runs=${1:-bf16,tensorwise,rowwise,blockwise}
C="examples/train_llama.py --preset 125m --data $DATA --steps $STEPS --batch-size 6 --seq-len 512
   --lr 6e-4 --eval-every 100 --eval-batches 16 --log-every 100 --no-progress"
for name in ${runs//,/ }; do
  flags=""
  [ "$name" != bf16 ] && flags="--use-fp8 --fp8-min-numel 0 --fp8-recipe $name"
  timeout ${RUN_TIMEOUT:-150} torchrun --standalone --nproc_per_node=1 $C $flags \
    --out-dir /tmp/conv1_$name > /tmp/conv1_$name.log 2>&1
  echo "[conv] $name rc=$? $(grep -E 'val' /tmp/conv1_$name.log | tail -1 | cut -c1-150)"
  cp /tmp/conv1_$name/metrics.jsonl "$OUT/convergence_1gpu_${name}.jsonl" 2>/dev/null
done
