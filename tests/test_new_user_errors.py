"""Issue 13 ("the first hour of a new user"): mistakes a new user makes get errors that say what
to do. Each test failed before its fix."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from fp8boost.booster import Booster


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_backward_before_boost_says_to_boost_first():
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    booster = Booster(mixed_precision="bf16", device="cpu")
    loss = model(torch.randn(2, 8)).sum()
    with pytest.raises(TypeError, match=r"AdamW.*booster\.boost\(model, optimizer\)"):
        booster.backward(loss, opt)  # was: AttributeError 'AdamW' object has no attribute ...


def test_truncated_safetensors_on_load_names_the_file(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    booster = Booster(mixed_precision="bf16", device="cpu")
    model, opt, *_ = booster.boost(model, opt)
    booster.backward(model(torch.randn(2, 16)).float().sum(), opt)
    opt.step()
    booster.save_model(model, tmp_path / "model", shard=False)
    booster.save_optimizer(opt, tmp_path / "optim")
    bad_model = tmp_path / "model" / "model.safetensors"
    _truncate(bad_model)
    with pytest.raises(ValueError, match=rf"{bad_model}.*truncated or corrupt"):
        booster.load_model(model, tmp_path / "model")
    shards = [p for p in (tmp_path / "optim").iterdir() if p.suffix == ".safetensors"]
    for shard in shards:
        _truncate(shard)
    with pytest.raises(ValueError, match=r"optim.*\.safetensors is unreadable"):
        booster.load_optimizer(opt, tmp_path / "optim")
