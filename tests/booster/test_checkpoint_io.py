"""Single-process checkpoint tests: HF layout, from_pretrained, atomic saves, error cases.

Multi-rank saves, re-sharding into other world sizes and resume parity are in
tests/plugins/test_plugins_distributed.py (scenarios in tests/plugins/checkpoint_cases.py).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fp8boost.booster import Booster
from fp8boost.checkpoint_io import tensor_files as cio
from tests.plugins import helpers as H

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny_llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


def _train_llama(booster, model, opt, steps=2):
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        booster.backward(model(input_ids=ids, labels=ids).loss, opt)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("tie", [False, True])
def test_sharded_save_is_hf_loadable(tmp_path, tie):
    from transformers import LlamaForCausalLM
    booster = Booster(mixed_precision="bf16", device="cpu")
    raw = _tiny_llama(tie)
    model, opt, *_ = booster.boost(raw, torch.optim.AdamW(raw.parameters(), lr=1e-3))
    _train_llama(booster, model, opt)
    path = tmp_path / "ckpt"
    booster.save_model(model, str(path), size_per_shard_mb=0.05)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(glob.glob(str(path / "model-*.safetensors"))) == [str(path / s) for s in shards]
    assert (path / "config.json").exists()
    assert ("lm_head.weight" in index["weight_map"]) == (not tie)  # tied: written once
    loaded = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    ref = raw.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, ref[k]), k
    if tie:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_train_save_load_resume_bit_exact(tmp_path):
    """bf16 O2 without a plugin: weights, FP32 masters, Adam state and loss scale round-trip."""
    for prec in ("bf16", "fp16"):
        def boost(seed):
            b = Booster(mixed_precision=prec, device="cpu")
            m = H.make_mlp(seed)
            m, o, *_ = b.boost(m, torch.optim.AdamW(m.parameters(), lr=1e-2))
            return b, m, o
        b1, m1, o1 = boost(0)
        H.train(b1, m1, o1, 0, 1, 3)
        b1.save_model(m1, str(tmp_path / prec / "m"), shard=False)
        b1.save_optimizer(o1, str(tmp_path / prec / "o"))
        o1_scaler = o1.loss_scaler.state_dict() if prec == "fp16" else None
        # One weights file; its checksum beside it (no JSON index to hold it when unsharded).
        assert sorted(os.listdir(tmp_path / prec / "m")) == ["fp8boost_checksums.json",
                                                             "model.safetensors"]
        cont = H.train(b1, m1, o1, 0, 1, 2, start=3)
        b2, m2, o2 = boost(1)
        b2.load_model(m2, str(tmp_path / prec / "m"))
        b2.load_optimizer(o2, str(tmp_path / prec / "o"))
        if prec == "fp16":
            assert o2.loss_scaler.state_dict() == o1_scaler
        assert H.train(b2, m2, o2, 0, 1, 2, start=3) == cont
        assert all(torch.equal(a, b) for a, b in zip(o1.masters, o2.masters))
        assert all(torch.equal(a, b) for a, b in zip(m1.unwrap().parameters(),
                                                     m2.unwrap().parameters()))


def test_lr_scheduler_round_trip(tmp_path):
    booster = Booster(device="cpu")
    model = H.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    booster.save_lr_scheduler(sched, str(tmp_path / "s.pt"))
    sched2 = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1.0), 1, 0.5)
    booster.load_lr_scheduler(sched2, str(tmp_path / "s.pt"))
    assert sched2.state_dict() == sched.state_dict()


def _saved_weights(path):
    from safetensors.torch import load_file
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    booster = Booster(device="cpu")
    model = H.make_mlp()
    path = str(tmp_path / "ckpt")
    booster.save_model(model, path, size_per_shard_mb=0.01)
    before = _saved_weights(path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real, calls = cio.save_file, []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("injected failure: disk full")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(cio, "save_file", failing)
    with pytest.raises(OSError, match="injected"):
        booster.save_model(model, path, size_per_shard_mb=0.01)
    assert os.listdir(tmp_path) == ["ckpt"]  # the temp dir is gone
    after = _saved_weights(path)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    fresh = H.make_mlp(seed=5)
    booster.load_model(fresh, path)
    assert all(torch.equal(fresh.state_dict()[k], before[k]) for k in before)


def test_process_killed_mid_save_keeps_previous_checkpoint(tmp_path):
    """A hard death (os._exit after the first shard file) leaves only a temp dir behind."""
    path = str(tmp_path / "ckpt")
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {REPO!r})
        from fp8boost.booster import Booster
        from fp8boost.checkpoint_io import tensor_files as cio
        from tests.plugins.helpers import make_mlp
        booster = Booster(device="cpu")
        model = make_mlp()
        booster.save_model(model, {path!r}, size_per_shard_mb=0.01)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        real = cio.save_file
        def dying(tensors, filename, metadata=None):
            real(tensors, filename, metadata=metadata)
            os._exit(3)
        cio.save_file = dying
        booster.save_model(model, {path!r}, size_per_shard_mb=0.01)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 3, proc.stderr
    leftovers = [d for d in os.listdir(tmp_path) if d != "ckpt"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".ckpt.tmp-"), leftovers
    model = H.make_mlp(seed=5)
    Booster(device="cpu").load_model(model, path)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), H.make_mlp().parameters()))


def test_refuses_to_replace_non_checkpoint_directory(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    (tmp_path / "file").write_text("x")
    booster = Booster(device="cpu")
    with pytest.raises(ValueError, match="not a checkpoint"):
        booster.save_model(H.make_mlp(), str(tmp_path / "data"))
    with pytest.raises(ValueError, match="is a file"):
        booster.save_model(H.make_mlp(), str(tmp_path / "file"))
    assert (tmp_path / "data" / "precious.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="size_per_shard_mb"):
        booster.save_model(H.make_mlp(), str(tmp_path / "m"), size_per_shard_mb=0)


def test_load_errors_are_clear(tmp_path):
    booster = Booster(mixed_precision="bf16", device="cpu")
    model = H.make_mlp()
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    H.train(booster, model, opt, 0, 1, 1)
    booster.save_model(model, str(tmp_path / "m"))
    booster.save_optimizer(opt, str(tmp_path / "o"))
    with pytest.raises(FileNotFoundError, match="no model checkpoint"):
        booster.load_model(model, str(tmp_path / "missing"))
    other = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(RuntimeError, match="does not match the model"):
        Booster(device="cpu").load_model(other, str(tmp_path / "m"))
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))  # untouched
    b2 = Booster(mixed_precision="bf16", device="cpu")
    other, o2, *_ = b2.boost(other, torch.optim.AdamW(other.parameters(), lr=1e-3))
    with pytest.raises(ValueError, match="same model and param groups"):
        b2.load_optimizer(o2, str(tmp_path / "o"))
    with pytest.raises(TypeError, match="returned by booster.boost"):
        booster.save_optimizer(torch.optim.SGD(H.make_mlp().parameters(), lr=0.1), str(tmp_path / "x"))


def test_save_checkpoint_resumes_bit_exact_and_names_format(tmp_path):
    """Booster.save_checkpoint: model + optimizer + scheduler + extra in one atomic directory."""
    def boost(seed):
        b = Booster(mixed_precision="bf16", device="cpu")
        m = H.make_mlp(seed)
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        s = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9)
        m, o, _, _, s = b.boost(m, o, lr_scheduler=s)
        return b, m, o, s

    b1, m1, o1, s1 = boost(0)
    H.train(b1, m1, o1, 0, 1, 3)
    s1.step()
    path = tmp_path / "state"
    b1.save_checkpoint(str(path), m1, o1, s1, extra={"step": 3, "data": [1, 2]})
    assert sorted(os.listdir(path)) == ["fp8boost_checkpoint.json", "lr_scheduler.pt", "model",
                                        "optimizer"]
    b1.save_checkpoint(str(path), m1, o1, s1, extra={"step": 3, "data": [1, 2]})  # overwrite
    cont = H.train(b1, m1, o1, 0, 1, 2, start=3)
    b2, m2, o2, s2 = boost(1)
    assert b2.load_checkpoint(str(path), m2, o2, s2) == {"step": 3, "data": [1, 2]}
    assert s2.last_epoch == s1.last_epoch == 1 and s2.get_last_lr() == s1.get_last_lr()
    assert H.train(b2, m2, o2, 0, 1, 2, start=3) == cont
    with pytest.raises(TypeError):
        b1.save_checkpoint(str(tmp_path / "bad"), m1, o1, extra={"x": object()})
    assert not (tmp_path / "bad").exists()
    meta = json.loads((path / "fp8boost_checkpoint.json").read_text())
    (path / "fp8boost_checkpoint.json").write_text(json.dumps(dict(meta, format="other-v9")))
    with pytest.raises(ValueError, match="format 'other-v9'"):
        b2.load_checkpoint(str(path), m2, o2)
    with pytest.raises(FileNotFoundError, match="no resumable checkpoint"):
        b2.load_checkpoint(str(tmp_path / "nothing"), m2, o2)
