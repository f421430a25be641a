#!/usr/bin/env bash
# Convergence of FP8 experts (issue 34, item 5) on one GPU: a 125M-class Mixtral (byte-level
# tokens, --model mixtral --preset 125m) for 2000 steps on ../shared/data/shakespeare.txt
# (carried as .data/shakespeare.txt: run with carry=[".data"]); the same data order, seed and
# schedule in every run; each decoder block compiled. fp8 converts every linear and expert
# module (--fp8-min-numel 0); fp8gwhp: rowwise_with_gw_hp (weight gradients in BF16, experts too).
#   bash bench/run_convergence_moe_1gpu.sh [bf16,fp8,fp8gwhp]
# JSONL per run -> $OUT/convergence_moe_1gpu_<run>.jsonl; plot with bench/plot_convergence.py.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}; DATA=${DATA:-.data/shakespeare.txt}; STEPS=${STEPS:-2000}
runs=${1:-bf16,fp8}
C="examples/train_llama.py --model mixtral --preset 125m --data $DATA --steps $STEPS
   --batch-size 6 --seq-len 512 --lr 6e-4 --eval-every 100 --eval-batches 16 --log-every 100
   --no-progress --compile"
for name in ${runs//,/ }; do
  flags=""
  [ "$name" = fp8 ] && flags="--use-fp8 --fp8-min-numel 0"
  [ "$name" = fp8gwhp ] && flags="--use-fp8 --fp8-min-numel 0 --fp8-recipe rowwise_with_gw_hp"
  timeout ${RUN_TIMEOUT:-280} torchrun --standalone --nproc_per_node=1 $C $flags \
    --out-dir /tmp/convmoe_$name > /tmp/convmoe_$name.log 2>&1
  echo "[conv-moe] $name rc=$? $(grep -E 'val' /tmp/convmoe_$name.log | tail -1 | cut -c1-150)"
  tail -3 /tmp/convmoe_$name.log | cut -c1-300
  cp /tmp/convmoe_$name/metrics.jsonl "$OUT/convergence_moe_1gpu_${name}.jsonl" 2>/dev/null
done
