#!/usr/bin/env bash
# Issue 25 on one GPU: the Colossal-AI-style script (tests/colossal/colossal_script.py, imports
# from fp8boost.colossal only) at a Llama-7B layer shape (2 layers, h4096, ffn 11008, seq 2048,
# batch 2) with each plugin and --use-fp8, plus ZeRO-2 without FP8 for the step-time ratio;
# then the gpu-marked tests of the rowwise/blockwise core (tests/fp8/test_granular_gpu.py).
#   TAG=h100 bash bench/run_colossal_gpu.sh
# Writes $OUT/colossal_gpu_$TAG.log (every run's output) and $OUT/colossal_gpu_$TAG.json.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-bench/results}; TAG=${TAG:-run}
LOG="$OUT/colossal_gpu_$TAG.log"; : > "$LOG"
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$LOG"
run() {  # name, script flags...
  local name=$1; shift
  echo "===== $name: $*" >> "$LOG"
  timeout ${RUN_TIMEOUT:-120} torchrun --standalone --nproc_per_node=1 \
    tests/colossal/colossal_script.py -c 7b-2l -l 2048 -b 2 -s 10 "$@" > /tmp/c_$name.log 2>&1
  echo "rc=$?" >> /tmp/c_$name.log
  cat /tmp/c_$name.log >> "$LOG"
}
run zero2_fp8 -p zero2 --lazy --use-fp8
run zero2_bf16 -p zero2 --lazy
run gemini_fp8 -p gemini --lazy --use-fp8
run ddp_fp8 -p ddp --use-fp8
run fsdp_fp8 -p fsdp --use-fp8
run hybrid_fp8_ckpt -p 3d --zero 1 -g --lazy --use-fp8
run zero2_lora_fp8 -p zero2 --lora --use-fp8
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu -rA \
  tests/fp8/test_granular_gpu.py > "$OUT/granular_gpu_$TAG.log" 2>&1
echo "[granular gpu tests] rc=$? $(tail -1 "$OUT/granular_gpu_$TAG.log")"
python3 - "$LOG" "$OUT/colossal_gpu_$TAG.json" <<'PY'
import json, re, statistics, sys, datetime, torch
log, out = sys.argv[1], sys.argv[2]
runs, name = {}, None
for line in open(log):
    m = re.match(r"===== (\S+): (.*)", line)
    if m:
        name = m.group(1); runs[name] = {"flags": m.group(2), "steps": [], "rc": None}
    elif name and line.startswith('{"plugin"'):
        row = json.loads(line)
        (runs[name]["steps"].append(row) if "step" in row else runs[name].update(row))
    elif name and line.startswith("rc="):
        runs[name]["rc"] = int(line[3:])
print(f"{'run':18} {'rc':>3} {'fp8/linear':>10} {'loss1':>7} {'lossN':>7} {'s/step':>7} {'tok/s':>8}")
for n, r in runs.items():
    secs = [s["sec"] for s in r["steps"][3:]]
    r["median_step_s"] = statistics.median(secs) if secs else None
    r["tokens_per_s"] = 2 * 2048 / r["median_step_s"] if secs else None
    l = [s["loss"] for s in r["steps"]]
    print(f"{n:18} {r['rc']!s:>3} {str(r.get('fp8_layers'))+'/'+str(r.get('linear_layers')):>10} "
          f"{(l or [0])[0]:7.3f} {(l or [0])[-1]:7.3f} {r['median_step_s'] or 0:7.3f} {r['tokens_per_s'] or 0:8.0f}")
json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "date": datetime.date.today().isoformat(),
           "command": "TAG=... bash bench/run_colossal_gpu.sh", "runs": runs}, open(out, "w"), indent=1)
PY
