"""Issue 13 ("the first hour of a new user") for examples/train_llama.py: any HF causal-LM
family, --compile, --activation-checkpointing, the --device cuda check, and what a run prints.
Each test failed before its fix. Runs are a few steps of tiny models on short sequences; the
2-rank run groups its assertions (a spawned group costs ~10 s)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from tests.examples.example_env import ROOT, SCRIPT, SHORT, example_modules


@pytest.fixture(scope="module")
def tl():
    with example_modules("train_llama") as (train_llama,):
        yield train_llama


def _run(cmd: list[str], threads: int) -> str:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}"
    return proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_device_cuda_without_cuda_is_a_clear_error_before_set_device(tl):
    # Was: AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'.
    with pytest.raises(ValueError, match="--device cuda but no CUDA device.*--device cpu"):
        tl.rank_and_device("cuda")


def test_hybrid_flags_are_validated(tl):
    args = tl.parse_args(["--tp", "2"])
    with pytest.raises(ValueError, match="--tp is an option of --plugin hybrid"):
        tl.validate_args(args, 1)
    args = tl.parse_args(["--plugin", "hybrid", "--tp", "3"])
    with pytest.raises(ValueError, match="--tp 3 must be >= 1 and divide"):
        tl.validate_args(args, 4)
    args = tl.parse_args(["--plugin", "hybrid", "--sp"])
    with pytest.raises(ValueError, match="--sp .* needs --tp >= 2"):
        tl.validate_args(args, 2)
    with pytest.raises(SystemExit):
        tl.parse_args(["--model", "gpt2", "--model-path", str(ROOT)])


def test_every_model_family_builds_at_preset_size(tl):
    for family, cls in [("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                        ("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM")]:
        args = tl.parse_args(["--model", family])
        model = tl.build_model(args, 256, 128, torch.device("meta"))
        assert type(model).__name__ == cls
        assert model.config.num_hidden_layers == 4 and model.config.hidden_size == 128
        assert len(tl.decoder_blocks(model)) == 4


def test_model_path_takes_any_causal_lm_folder(tl, tmp_path):
    args = tl.parse_args(["--model", "gpt2"])
    tl.build_model(args, 256, 64, torch.device("cpu")).save_pretrained(tmp_path)
    # --seq-len within the 64 positions the folder's model was built with (a longer one is
    # refused: tests/examples/test_first_ten_minutes.py)
    args = tl.parse_args(["--model-path", str(tmp_path), "--seq-len", "64"])
    tl.validate_args(args, 1)  # was: "this example trains LlamaForCausalLM only"
    assert type(tl.build_model(args, 256, 64, torch.device("cpu"))).__name__ == "GPT2LMHeadModel"


def test_compile_compiles_each_fp8_block_without_graph_breaks(tl):
    from torch._dynamo.utils import counters

    from fp8boost.booster import Booster
    from fp8boost.booster.mixed_precision import MixedPrecision
    from fp8boost.fp8 import Fp8Config
    from fp8boost.fp8.convert import Fp8Conv1D
    args = tl.parse_args(["--model", "gpt2", "--compile", "--compile-backend", "aot_eager"])
    model = tl.build_model(args, 256, 64, torch.device("cpu"))
    model.transformer.h = model.transformer.h[:1]  # one block: compile time is per block
    model.config.n_layer = 1
    assert tl.prepare_model(model, args) == 1
    opt = torch.optim.AdamW(model.parameters())
    booster = Booster(mixed_precision=MixedPrecision("fp8", Fp8Config(backend="emulated",
                                                                      min_numel=0)), device="cpu")
    model, opt, *_ = booster.boost(model, opt)
    assert sum(isinstance(m, Fp8Conv1D) for m in model.modules()) == 4
    counters.clear()
    ids = torch.randint(0, 256, (2, 16))
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]


def test_two_ranks_gpt2_fp8_run_prints_checkpoints_summary_and_one_warning(tmp_path):
    # One spawned run for three regressions: the emulated-backend warning came once per rank,
    # checkpoint saves printed nothing, and short runs printed "loss a -> a" (overlapping
    # first/last windows). GPT-2 + activation checkpointing also exercise --model on 2 ranks.
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", str(SCRIPT), *SHORT, "--steps", "4", "--plugin", "ddp",
                "--use-fp8", "--model", "gpt2", "--activation-checkpointing",
                "--save-every", "2", "--out-dir", str(tmp_path)], threads=1)
    assert out.count("FP8 tensor cores unavailable") == 1, out
    assert out.count("saved checkpoint") == 2 and f"--resume {tmp_path}" in out
    assert "(mean of first/last 2 steps)" in out
    line = next(x for x in out.splitlines() if "done: loss" in x)
    first, last = line.split("done: loss ")[1].split(" (")[0].split(" -> ")
    assert first != last


def test_readme_commands_work_from_a_fresh_clone(tl):
    # Was: the scale-out command read ../shared/data/shakespeare.txt, absent from a clone.
    # The README's commands and those of docs/training.md, where it sends people next.
    readme = (ROOT / "README.md").read_text() + (ROOT / "docs" / "training.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    commands = [c for b in blocks for c in b.replace("\\\n", " ").splitlines()
                if "examples/train_llama.py" in c]
    assert len(commands) >= 3
    for command in commands:
        words = shlex.split(command.split("#")[0])
        assert not any(w.startswith("..") for w in words), command  # nothing outside the clone
        nproc = [int(w.split("=")[1]) for w in words if w.startswith("--nproc_per_node=")]
        argv = words[words.index("examples/train_llama.py") + 1:]
        tl.validate_args(tl.parse_args(argv), nproc[0] if nproc else 1)
    assert "GPU job" in readme  # the 7b-8l preset is said to need GPUs
