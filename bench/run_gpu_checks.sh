#!/usr/bin/env bash
# Correctness checks on the device machine (one GPU or 2xH200): the GPU suite (tests/gpu_suite.py),
# then examples/train_llama.py under torchrun with FP8 + activation checkpointing + --compile on
# several plugins (NCCL), counting dynamo recompile messages (there must be none).
#   TAG=h200x2_session4 bash bench/run_gpu_checks.sh [tests|examples|all]
# Writes $OUT/gpu_suite_<part>.{log,json} and $OUT/examples_$TAG.log; prints a short table last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-bench/results}
TAG=${TAG:-run}
what=${1:-all}
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ "$what" != examples ]; then  # the GPU suite (CONTRIBUTING.md): every gpu/multigpu test
  part=one; [ "$NGPU" -ge 2 ] && part=all
  python3 tests/gpu_suite.py "$part" --out "$OUT"
fi
[ "$what" = tests ] && exit 0
LOG="$OUT/examples_$TAG.log"; : > "$LOG"
ex() {  # name, nproc, flags...
  local name=$1 n=$2; shift 2
  echo "===== $name: $*" >> "$LOG"
  timeout ${EX_TIMEOUT:-150} torchrun --standalone --nproc_per_node=$n examples/train_llama.py \
    --preset 125m --use-fp8 --fp8-min-numel 0 --steps 12 --log-every 4 --no-progress \
    --out-dir /tmp/ex_$name "$@" > /tmp/ex_$name.log 2>&1
  local rc=$?
  cat /tmp/ex_$name.log >> "$LOG"
  printf '[ex] %-26s rc=%s recompile_lines=%s last: %s\n' "$name" "$rc" \
    "$(grep -ci 'recompil' /tmp/ex_$name.log)" "$(grep -E '\[train\] done' /tmp/ex_$name.log | tail -1 | cut -c14-110)"
}
ex single_compile_ac 1 --compile --activation-checkpointing
if [ "$NGPU" -ge 2 ]; then
  ex zero2_compile_ac 2 --plugin zero2 --fp8-comm --compile --activation-checkpointing
  ex gemini_compile_ac 2 --plugin gemini --fp8-comm --compile --activation-checkpointing
  ex hybrid_tp2_compile_ac 2 --plugin hybrid --tp 2 --sp --compile --activation-checkpointing
  ex hybrid_pp2_ac 2 --plugin hybrid --pp 2 --activation-checkpointing
fi
