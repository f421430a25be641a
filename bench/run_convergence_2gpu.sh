#!/usr/bin/env bash
# Convergence evidence (issue 12, item 5) on 2 GPUs: a 125M Llama (byte-level tokens) trained
# for 2000 steps on ../shared/data/shakespeare.txt (carried as .data/shakespeare.txt), every
# run with the same data order, seed and schedule; FP8 runs convert every decoder linear
# (--fp8-min-numel 0: the default size filter would keep a 768-wide model in BF16).
#   bash bench/run_convergence_2gpu.sh zero2    # bf16, tensorwise, delayed, tensorwise + FP8 comm
#   bash bench/run_convergence_2gpu.sh gemini   # bf16, tensorwise + FP8 comm
# Tokens seen: 2000 steps x 2 GPUs x 3 x 512 = 6.1M byte tokens, about 1.2 epochs of the 95%
# training split (5.2 MB): short of overfitting, so validation loss still falls at the end.
# JSONL per run -> $OUT/convergence_<plugin>_<run>.jsonl; plot locally with
#   python bench/plot_convergence.py bench/results/convergence_*.jsonl
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-bench/results}
DATA=${DATA:-.data/shakespeare.txt}
STEPS=${STEPS:-2000}
plugin=${1:-zero2}
C="examples/train_llama.py --preset 125m --data $DATA --steps $STEPS --batch-size 3 --seq-len 512
   --lr 6e-4 --eval-every 100 --eval-batches 16 --log-every 50 --no-progress --plugin $plugin"
run() {  # name, extra flags
  local name=$1; shift
  timeout ${RUN_TIMEOUT:-280} torchrun --standalone --nproc_per_node=2 $C --out-dir /tmp/conv_$name "$@" \
    > /tmp/conv_$name.log 2>&1
  echo "[conv] $plugin $name rc=$?"; tail -2 /tmp/conv_$name.log
  cp /tmp/conv_$name/metrics.jsonl "$OUT/convergence_${plugin}_${name}.jsonl" 2>/dev/null
}
F8="--use-fp8 --fp8-min-numel 0"
if [ "$plugin" = zero2 ]; then
  run bf16
  run fp8_tensorwise $F8
  run fp8_delayed $F8 --fp8-recipe delayed
  run fp8_tensorwise_comm $F8 --fp8-comm
else
  run bf16
  run fp8_tensorwise_comm $F8 --fp8-comm
fi
