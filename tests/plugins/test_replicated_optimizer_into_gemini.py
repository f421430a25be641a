"""A replicated/ZeRO optimizer checkpoint (``optimizer.index.json``) loads into ``GeminiPlugin``'s
optimizer (FSDP2 shards): the second half of Colossal-AI's ``test_gemini_torch_compability.py``
(``exam_gemini_load_from_torch``), which failed on 2xH200 with "this plugin reads DCP optimizer
checkpoints".

On 2 gloo ranks, FP32, Adam:
- TorchDDP -> Gemini: Gemini's gathered ``state_dict()`` equals the DDP optimizer's, bit for
  bit, and one more step from it gives DDP's next weights (rel 1e-6: reduction order).
- LowLevelZero (stage 2, FP32 master shards) -> Gemini: the same, with the ZeRO checkpoint's
  ``master_param`` pieces loaded into Gemini's weights (exact).
- The param groups' hyperparameters as saved, types included (Adam's betas a tuple: torch's
  full-state-dict load turned it into a list, and Colossal-AI's test compares with ==).
- An optimizer over fewer parameters refuses the directory, naming the counts.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.plugins import helpers as H


def _step(booster, model, opt, step: int, rank: int, world: int) -> None:
    x, y = H.global_batch(step)
    loss = F.mse_loss(model(H.local_part(x, rank, world)).float(), H.local_part(y, rank, world))
    booster.backward(loss, opt)
    opt.step()
    opt.zero_grad()


def _source(kind: str):
    from fp8boost.plugins import LowLevelZeroPlugin, TorchDDPPlugin

    return TorchDDPPlugin() if kind == "ddp" else LowLevelZeroPlugin(stage=2, precision="fp32")


def _into_gemini(kind: str, rank: int, world: int, root: str) -> None:
    from fp8boost.booster import Booster
    from fp8boost.plugins import GeminiPlugin

    src = Booster(plugin=_source(kind))
    model = H.make_mlp()
    model, opt, *_ = src.boost(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    for step in range(2):
        _step(src, model, opt, step, rank, world)
    path = f"{root}/optim_{kind}"
    src.save_optimizer(opt, path)
    want = copy.deepcopy(opt.state_dict())  # full tensors by index; "step" is live
    weights = [w.detach().clone() for w in H.true_weights(model, opt)]
    _step(src, model, opt, 2, rank, world)
    after = [w.detach().clone() for w in H.true_weights(model, opt)]

    gemini = Booster(plugin=GeminiPlugin(precision="fp32"))
    other = H.make_mlp(seed=1)  # other weights: the checkpoint's must win
    if kind == "ddp":  # DDP's checkpoint has no weights: load them as a user does (load_model)
        with torch.no_grad():
            for p, w in zip(other.parameters(), weights):
                p.copy_(w)
    other, other_opt, *_ = gemini.boost(other, torch.optim.Adam(other.parameters(), lr=1e-3))
    gemini.load_optimizer(other_opt, path)
    got = other_opt.state_dict()
    # Colossal-AI's check: these hyperparameters, and the parameters' indices, as saved
    for saved, loaded in zip(want["param_groups"], got["param_groups"]):
        for key in ("params", "lr", "betas", "eps", "weight_decay"):
            assert saved[key] == loaded[key], (kind, key, saved[key], loaded[key])
    assert sorted(got["state"]) == sorted(want["state"])
    for i, entry in want["state"].items():
        for key, value in entry.items():
            if key == "master_param":
                continue
            assert torch.equal(got["state"][i][key].cpu(), value.cpu()), (kind, i, key)
    for w, p in zip(weights, other.unwrap().parameters()):
        assert torch.equal(p.full_tensor(), w), kind  # ZeRO: the exact master weights
    _step(gemini, other, other_opt, 2, rank, world)
    for a, p in zip(after, other.unwrap().parameters()):
        b = p.full_tensor()
        assert (a - b).abs().max().item() <= 1e-6 * a.abs().max().item(), (kind, a, b)

    short = H.make_mlp()
    short, short_opt, *_ = Booster(plugin=GeminiPlugin(precision="fp32")).boost(
        short, torch.optim.Adam(list(short.parameters())[:2]))
    with pytest.raises(ValueError, match="holds 6 parameters .*this optimizer has 2"):
        gemini.load_optimizer(short_opt, path)


def _both(rank: int, world: int, root: str) -> None:
    _into_gemini("ddp", rank, world, root)
    _into_gemini("zero", rank, world, root)


def test_replicated_and_zero_optimizer_checkpoints_load_into_gemini(tmp_path):
    run_distributed(_both, 2, str(tmp_path))
