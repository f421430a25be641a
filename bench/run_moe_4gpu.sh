#!/usr/bin/env bash
# Expert parallelism on 4 GPUs over NCCL (issue 34, item 4): examples/train_llama.py with a
# Mixtral-8x7B-layout model, 8 layers (--model mixtral --preset mistral-8l: h4096, 8 experts x
# 14336, top-2, GQA 32/8; PRESET=7b-8l gives the earlier 11008/MHA layout), batch 2 x 4096
# per rank, 12 steps (the summary's median step skips step 1), one torchrun per run:
#   fsdp_bf16       TorchFSDPPlugin, BF16 (the baseline: FSDP2 BF16 of the same model)
#   ep4_bf16        MoeHybridParallelPlugin ep4, BF16, BF16 dispatch
#   ep4_fp8         ep4, FP8 GEMMs, BF16 dispatch
#   ep4_fp8comm     ep4, FP8 GEMMs, FP8 dispatch (--fp8-comm)
#   ep2dp2_bf16 / ep2dp2_fp8comm   ep2 x moe-dp 2
#   *_compiled      the same with --compile (blocks compiled around the expert exchange)
#   bash bench/run_moe_4gpu.sh [run,run,...]      (default: the first four; ~2 min each)
# summary.json per run -> $OUT/moe_4gpu_<run>.json (tokens_per_s_per_device, peak memory).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-bench/results}; STEPS=${STEPS:-12}
runs=${1:-fsdp_bf16,ep4_bf16,ep4_fp8,ep4_fp8comm}
C="examples/train_llama.py --model mixtral --preset ${PRESET:-mistral-8l} --steps $STEPS --batch-size 2
   --seq-len 4096 --eval-every 0 --val-fraction 0 --log-every 1 --no-progress"
# FP8 runs convert every layer, experts included (--fp8-min-numel 0): without it the default
# config may keep an expert shape in BF16 where FP8 measured slower (FP8=--use-fp8 to see that).
FP8=${FP8:---use-fp8 --fp8-min-numel 0}
for name in ${runs//,/ }; do
  base=${name%_compiled}; flags=""
  case "$base" in
    fsdp_bf16) flags="--plugin fsdp" ;;
    ep4_bf16) flags="--plugin moe --ep 4" ;;
    ep4_fp8) flags="--plugin moe --ep 4 $FP8" ;;
    ep4_fp8comm) flags="--plugin moe --ep 4 $FP8 --fp8-comm" ;;
    ep2dp2_bf16) flags="--plugin moe --ep 2" ;;
    ep2dp2_fp8comm) flags="--plugin moe --ep 2 $FP8 --fp8-comm" ;;
    *) echo "unknown run $name"; continue ;;
  esac
  [ "$name" != "$base" ] && flags="$flags --compile"
  rm -rf /tmp/moe4_$name  # a new run each time (the example refuses a used --out-dir)
  timeout ${RUN_TIMEOUT:-240} torchrun --standalone --nproc_per_node=4 $C $flags \
    --out-dir /tmp/moe4_$name > /tmp/moe4_$name.log 2>&1
  rc=$?
  cp /tmp/moe4_$name.log "$OUT/moe_4gpu_${name}.log" 2>/dev/null
  echo "[moe-4gpu] $name rc=$rc $(python3 -c "import json;s=json.load(open('/tmp/moe4_$name/summary.json'));print(round(s['tokens_per_s_per_device']), 'tok/s/GPU', s.get('compile',''))" 2>/dev/null)"
  # the ranks' own errors, not torchrun's wrapper traceback
  [ $rc != 0 ] && grep -E "Error|error:|Exception|Traceback|OutOfMemory" /tmp/moe4_$name.log \
    | grep -v -E "elastic|ChildFailedError|SignalException" | head -8 | cut -c1-300
  cp /tmp/moe4_$name/summary.json "$OUT/moe_4gpu_${name}.json" 2>/dev/null
done
