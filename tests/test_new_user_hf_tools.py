"""Issue 13: a model converted with ``convert_to_fp8`` trains under the HF tools people already
use: ``transformers.Trainer`` (in process) and accelerate's ``Accelerator.prepare`` (2 processes,
DDP on gloo), and the saved folder loads with ``from_pretrained``. The README recipe is what
runs here. CPU: the FP8 GEMMs are emulated (exact FP8 numerics)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _readme_recipe(marker: str) -> str:
    """The ``py`` block of the README's HF section that contains ``marker``."""
    blocks = re.findall(r"```py\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return next(b for b in blocks if marker in b)


def test_trainer_trains_a_converted_model_and_saves_a_loadable_folder(tmp_path):
    code = _readme_recipe("Trainer(").replace("/tmp/fp8boost_trainer", str(tmp_path))
    scope: dict = {}
    exec(compile(code, "README-trainer", "exec"), scope)
    from fp8boost.fp8 import Fp8Linear
    assert any(isinstance(m, Fp8Linear) for m in scope["model"].modules())
    losses = [r["loss"] for r in scope["trainer"].state.log_history if "loss" in r]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    trained = scope["model"].state_dict()
    for key, value in loaded.state_dict().items():  # same keys, same (trained) values
        torch.testing.assert_close(value, trained[key].to(value.dtype), rtol=0, atol=0)


def test_accelerate_ddp_two_processes_trains_and_saves(tmp_path):
    script = tmp_path / "acc.py"
    script.write_text(_readme_recipe("Accelerator(").replace("/tmp/fp8boost_accelerate",
                                                             str(tmp_path)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(script)], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("distributed_type=MULTI_CPU num_processes=2") == 1, proc.stdout
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert loaded.config.num_hidden_layers == 2
