#!/usr/bin/env bash
# Issue 15 on one 8-GPU host (8xH200): Colossal-AI's published FP8 configs, via bench/scale.py,
# one torchrun per config (except "smoke"), every config compiled (plus FSDP2 BF16 eager).
# Each part fits one 10-minute device call; JSON goes to $OUT (default bench/results).
#
#   part        configs (world 8)                                        expected on 8xH200
#   smoke N     the whole matrix below on N GPUs, small models, 2 steps,   ~3-5 min on N=2
#               one torchrun per matrix (7B-style, 13B best-of, 35B-style)
#   7b-base     fsdp2_bf16_eager, fsdp2_bf16, torchao_fsdp2                ~4-5 min
#   7b-zero     zero2_{bf16,fp8,fp8_comm}                  (ZeRO-2, dp8)   ~4-5 min
#   7b-gemini   gemini_{bf16,fp8,fp8_comm}                 (ZeRO-3, dp8)   ~4-5 min
#   7b-tp       tp2_{bf16,fp8,fp8_comm}                    (tp2 x dp4)     ~4-5 min
#   7b-pp       pp2_{bf16,fp8,fp8_comm}                    (pp2 x dp4)     ~4-5 min
#   7b-merge    one table of the five 7B JSONs + targets (no GPU work)     seconds
#   7b          the five 7B parts, then 7b-merge                           ~25 min (5 calls)
#   13b         best 7B FP8 config's family: bf16 vs that config, 13B      ~5 min
#   35b-tp8     tp8sp_{bf16,fp8}, Command-R-35B shape, 2 seqs / replica    ~6-8 min
#   35b-tp4     tp4sp_{bf16,fp8} (tp4 x dp2), 1 seq / replica               ~6-8 min
#               (estimated ~130 GB/GPU with FP8: if it OOMs, AC=1 adds activation
#               checkpointing; MFU then still counts model FLOPs only)
#   35b         35b-tp8, 35b-tp4, then one merged table                     ~15 min (2 calls)
#
# Estimates: 2xH200 took ~50 s per compiled config of the 8-layer 7B model (BENCHMARKS 4b/4d:
# ~15 s torchrun + import, ~25 s compile, 14 steps of ~0.2 s); 32 layers reuse the same
# compiled graphs (one code object) but each step is ~4x longer and the FP32 model build
# ~4x larger: ~80-100 s per config. Per-config limit 180 s (7B) or 270 s (13B, 35B), so a
# hung config still leaves the part inside its 570 s limit.
# Settings: LLaMA2-7B/13B bs 2 x 4096 tokens per GPU (tp/pp replicas take 2 x tp x pp
# sequences), pp2 with 1-sequence micro-batches (4 per step), warm-up 4, median of 10 steps.
# Usage on the GPU machine: bash bench/run_8gpu.sh smoke 2 | 7b-zero | ... | 35b
# NPROC=4: the same parts on 4 GPUs (issue 15's 4xH200 7B rows: tp2 x dp2, pp2 x dp2), JSON
# named scale_4gpu_*. RB8 / RB4: sequences per 35B replica (default 2 / 1). AC=1: activation checkpointing (35b).
# SMOKE_EXTRA adds arguments to the smoke runs (CPU check: SMOKE_EXTRA="--device cpu
# --vocab-size 256 --seq-len 64 --no-compile" bash bench/run_8gpu.sh smoke 2).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
source "$(dirname "$0")/_torchao_wheel.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sort | uniq -c
PY="${DRY:+echo }python3"  # DRY=1: print each command instead of running it (tests)
filt() { if [ -n "${DRY:-}" ]; then cat; else grep -E "$1" | tail -"$2"; fi; }
KEEP='^\[scale\] [a-z0-9_]+: |^\[scale\] (merged|JSON)|^config|^target|^[a-z0-9_]+ +(ok|NaN|oom|error|crashed|timeout|not_|skipped)|x[0-9]+, '
S="$PY bench/scale.py"
NP=${NPROC:-8}; G="scale_${NP}gpu"
L7="--preset llama2-7b --batch-size 2 --seq-len 4096 --warmup 4 --steps 10 --nproc $NP --compile"
V="bf16 fp8 fp8_comm"
fam() { local out=""; for v in $V; do out="$out,${1}_$v"; done; echo "${out#,}"; }

part7() {  # part7 NAME CONFIGS
  timeout 570 $S $L7 --config-timeout 180 --configs "$2" --output "$OUT/${G}_7b_$1.json" \
    2>&1 | filt "$KEEP" 20
}
merge7() {
  $S --merge "$OUT"/${G}_7b_{base,zero,gemini,tp,pp}.json --scale 7b \
    --output "$OUT/${G}_7b.json" 2>&1 | filt "$KEEP|Error" 30
}
part35() {  # part35 TP REPLICA_BATCH
  timeout 570 $S --preset command-r-35b --batch-size 1 --replica-batch "$2" --seq-len 4096 \
    --warmup 3 --steps 8 --nproc $NP --compile --config-timeout 270 ${AC:+--activation-checkpointing} \
    --configs "tp${1}sp_bf16,tp${1}sp_fp8" --output "$OUT/${G}_35b_tp$1.json" \
    2>&1 | filt "$KEEP" 20
}

case "${1:-help}" in
  smoke)
    N=${2:-2}; TP35=$(( N >= 8 ? 8 : N ))
    SM="--batch-size 2 --seq-len 256 --warmup 1 --steps 2 --fp8-min-numel 0 --compile --no-isolate ${SMOKE_EXTRA:-}"
    T="timeout 360 $PY -m torch.distributed.run --standalone --nproc_per_node=$N bench/scale.py"
    C7="fsdp2_bf16_eager,fsdp2_bf16,torchao_fsdp2,$(fam zero2),$(fam gemini),$(fam tp2),$(fam pp2)"
    $T --preset small $SM --configs "$C7" --output "$OUT/scale_smoke${N}_7b.json" \
      2>&1 | filt "$KEEP|Error" 24
    $T --preset small $SM --best-of "$OUT/scale_smoke${N}_7b.json" \
      --output "$OUT/scale_smoke${N}_13b.json" 2>&1 | filt "$KEEP|Error" 6
    $T --preset command-r-small $SM --replica-batch 2 --configs "tp${TP35}sp_bf16,tp${TP35}sp_fp8" \
      --output "$OUT/scale_smoke${N}_35b.json" 2>&1 | filt "$KEEP|Error" 6 ;;
  7b-base)   part7 base "fsdp2_bf16_eager,fsdp2_bf16,torchao_fsdp2" ;;
  7b-zero)   part7 zero "$(fam zero2)" ;;
  7b-gemini) part7 gemini "$(fam gemini)" ;;
  7b-tp)     part7 tp "$(fam tp2)" ;;
  7b-pp)     part7 pp "$(fam pp2)" ;;
  7b-merge)  merge7 ;;
  7b)
    for p in base zero gemini tp pp; do bash "$0" "7b-$p"; done; merge7 ;;
  13b)
    timeout 570 $S --preset llama2-13b --batch-size 2 --seq-len 4096 --warmup 4 --steps 10 \
      --nproc $NP --compile --config-timeout 270 \
      --best-of "$OUT/${G}_7b.json" "$OUT"/${G}_7b_{zero,gemini,tp,pp}.json \
      --output "$OUT/${G}_13b.json" 2>&1 | filt "$KEEP" 12 ;;
  35b-tp8) part35 8 "${RB8:-2}" ;;
  35b-tp4) part35 4 "${RB4:-1}" ;;
  35b)
    part35 8 "${RB8:-2}"; part35 4 "${RB4:-1}"
    $S --merge "$OUT"/${G}_35b_tp{8,4}.json --scale 35b --output "$OUT/${G}_35b.json" \
      2>&1 | filt "$KEEP|Error" 12 ;;
  *) sed -n "2,/^set -u/p" "$0" | sed "$ d"; exit 2 ;;
esac
