"""A Colossal-AI script, edited only in its imports, trains under a 2-rank torchrun (gloo, CPU).

colossal_script.py uses Colossal-AI's API only (launch_from_torch, DistCoordinator,
get_dist_logger, HybridAdam, CosineAnnealingWarmupLR, Booster + LowLevelZeroPlugin(stage=2,
use_fp8=True)) on a tiny HF Llama for 3 steps, FP8 emulated on the CPU. 10-19 s on 2 shared CPU
cores, nearly all of it importing torch and transformers in two processes.
"""
from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("colossal_script.py")


def test_script_imports_only_colossal_paths():
    """The script is a Colossal-AI script after the mechanical edit: undoing the edit
    (fp8boost.colossal -> colossalai) leaves no fp8boost import behind."""
    tree = ast.parse(SCRIPT.read_text())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    ours = [m for m in modules if m.startswith("fp8boost")]
    assert ours and all(m == "fp8boost.colossal" or m.startswith("fp8boost.colossal.")
                        for m in ours), ours


def test_colossal_script_trains_under_torchrun_with_fp8():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(SCRIPT)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"step"')]
    assert [r["step"] for r in rows] == [1, 2, 3], out[-4000:]  # the master's lines only
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert rows[0]["loss"] == pytest.approx(math.log(256), abs=0.3)  # untrained byte model
    # warm-up 1 of 3 steps: base, then cosine from base over the 2 remaining steps
    assert [r["lr"] for r in rows] == pytest.approx([3e-3, 3e-3, 1.5e-3])
    assert "world size: 2, backend: gloo" in out
    assert "'emulated' backend" in out  # use_fp8=True built FP8 linears (emulated on the CPU)
    assert out.count("colossal script done") == 1
