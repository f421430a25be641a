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
    """The ``py`` block of docs/api.md's HF section that contains ``marker``."""
    blocks = re.findall(r"```py\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)
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


# ---------------------------------------------------------------- GPU (the device machine)
import pytest  # noqa: E402


@pytest.mark.gpu
def test_trainer_on_a_gpu_runs_real_fp8_in_bf16(tmp_path):
    """The documented Trainer recipe (docs/api.md) with ``bf16=True`` on an FP8 GPU: FP8 GEMMs on a real
    backend (not emulated), loss falls, the folder loads."""
    code = _readme_recipe("Trainer(").replace("/tmp/fp8boost_trainer", str(tmp_path))
    code = code.replace('save_strategy="no")', 'save_strategy="no", bf16=True)')
    assert "bf16=True" in code
    scope: dict = {}
    exec(compile(code, "README-trainer-gpu", "exec"), scope)
    from fp8boost.fp8 import Fp8Linear
    layers = [m for m in scope["model"].modules() if isinstance(m, Fp8Linear)]
    assert layers and all(m.weight.is_cuda for m in layers)
    # With several GPUs visible the Trainer runs nn.DataParallel, whose per-forward replicas
    # (not these modules) resolve the backend: ask what ``auto`` resolves to on this GPU.
    from fp8boost.fp8.backends import get_backend
    assert get_backend(layers[0].fp8_config.backend, layers[0].weight.device).name != "emulated"
    losses = [r["loss"] for r in scope["trainer"].state.log_history if "loss" in r]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "final").config.num_hidden_layers == 2


_FSDP2_SCRIPT = '''
import faulthandler
faulthandler.dump_traceback_later(150, exit=True)  # a hang: every rank's stack, then exit
import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM
from fp8boost.fp8 import Fp8Config, Fp8Linear, convert_to_fp8

accelerator = Accelerator()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=768,
                                     num_hidden_layers=2, num_attention_heads=4, vocab_size=256))
convert_to_fp8(model, Fp8Config(min_numel=0))  # before prepare: FSDP2 shards the FP8 layers
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0)).cuda()
losses = []
for step in range(6):
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
n_fp8 = sum(isinstance(m, Fp8Linear) for m in model.modules())
accelerator.print(f"distributed_type={accelerator.distributed_type.value} "
                  f"fsdp_version={getattr(accelerator.state.fsdp_plugin, 'fsdp_version', None)} "
                  f"fp8_layers={n_fp8} first={losses[0]:.3f} last={losses[-1]:.3f}")
state = accelerator.get_state_dict(model)  # gathered full state dict on the main process
accelerator.unwrap_model(model).save_pretrained(OUT, state_dict=state,
                                                is_main_process=accelerator.is_main_process,
                                                save_function=accelerator.save)
'''


@pytest.mark.multigpu
def test_accelerate_fsdp2_config_trains_converted_model_on_two_gpus(tmp_path):
    """accelerate's FSDP2 (``FSDP_VERSION=2``, per-decoder-layer wrap, bf16) on a model
    converted with ``convert_to_fp8``: 2 GPUs train, loss falls, the gathered folder loads."""
    script = tmp_path / "fsdp2.py"
    script.write_text(_FSDP2_SCRIPT.replace("OUT", repr(str(tmp_path / "final"))))
    env = dict(os.environ, PYTHONPATH=str(ROOT), ACCELERATE_USE_FSDP="true", FSDP_VERSION="2",
               FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
               FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaDecoderLayer",
               FSDP_STATE_DICT_TYPE="FULL_STATE_DICT", FSDP_RESHARD_AFTER_FORWARD="true",
               ACCELERATE_MIXED_PRECISION="bf16")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(script)], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-8000:]
    line = next(x for x in proc.stdout.splitlines() if "distributed_type=" in x)
    assert "distributed_type=FSDP" in line and "fsdp_version=2" in line, line
    assert "fp8_layers=14" in line, line
    first, last = (float(x.split("=")[1]) for x in line.split()[-2:])
    assert last < first, line
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert loaded.model.layers[0].mlp.gate_proj.weight.shape == (768, 256)
