"""An optimizer checkpoint of ``GeminiPlugin`` (DCP, each rank writing its shards) loads into
``TorchDDPPlugin``'s optimizer, which steps the full parameters: what Colossal-AI's
``test_gemini_torch_compability.py`` does (it failed on 2xH200 with "missing
optimizer.index.json" before).

On 2 gloo ranks, FP32, Adam: after the load the DDP optimizer's state equals, bit for bit, the
Gemini optimizer's gathered state (``state_dict()``: full tensors by parameter index), and a
step from it on the same weights gives the same parameters as the Gemini run's next step
(rel 1e-6: the gradient all-reduce and reduce-scatter sum in different orders). A ZeRO
optimizer (flat master shards) refuses the directory with a ValueError naming the plugins that
read it; so does an optimizer with another parameter count. Then Colossal-AI's own check of
that file under fp16 (``fp8boost.colossal``, ``check_state_dict_equal`` of the two optimizers'
``state_dict()``), which failed on 2xH200 on the loss scale's extra key, and its last line: the
DDP optimizer saved over the Gemini checkpoint at the same path.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.plugins import helpers as H


def _backward(booster, model, opt, step: int, rank: int, world: int) -> None:
    x, y = H.global_batch(step)
    loss = F.mse_loss(model(H.local_part(x, rank, world)).float(), H.local_part(y, rank, world))
    booster.backward(loss, opt)


def _worker(rank: int, world: int, root: str) -> None:
    from fp8boost.booster import Booster
    from fp8boost.plugins import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin

    gemini = Booster(plugin=GeminiPlugin(precision="fp32"))
    model = H.make_mlp()
    model, opt, *_ = gemini.boost(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    for step in range(2):
        _backward(gemini, model, opt, step, rank, world)
        opt.step(), opt.zero_grad()
    path = f"{root}/optim"
    gemini.save_optimizer(opt, path)
    want = copy.deepcopy(opt.state_dict())  # gathered: full tensors by index ("step" is live)
    weights = {k: v.clone() for k, v in model.state_dict(only_rank_0=False).items()}  # full
    _backward(gemini, model, opt, 2, rank, world)
    opt.step(), opt.zero_grad()
    after = [p.full_tensor() for p in model.unwrap().parameters()]

    ddp = Booster(plugin=TorchDDPPlugin())
    plain = H.make_mlp()
    plain.load_state_dict(weights)
    plain, plain_opt, *_ = ddp.boost(plain, torch.optim.Adam(plain.parameters(), lr=1e-3))
    ddp.load_optimizer(plain_opt, path)
    got = plain_opt.optim.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"]) == list(range(len(after)))
    for i, entry in want["state"].items():
        assert sorted(got["state"][i]) == sorted(entry)
        for key, value in entry.items():
            assert torch.equal(got["state"][i][key], value), (i, key)
    _backward(ddp, plain, plain_opt, 2, rank, world)
    plain_opt.step(), plain_opt.zero_grad()
    for a, b in zip(after, plain.unwrap().parameters()):
        assert (a - b).abs().max().item() <= 1e-6 * a.abs().max().item(), (a, b)

    zero = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32"))
    other = H.make_mlp()
    other, other_opt, *_ = zero.boost(other, torch.optim.Adam(other.parameters(), lr=1e-3))
    with pytest.raises(ValueError, match="GeminiPlugin or TorchFSDPPlugin"):
        zero.load_optimizer(other_opt, path)
    short = H.make_mlp()
    short, short_opt, *_ = ddp.boost(short, torch.optim.Adam(list(short.parameters())[:2]))
    with pytest.raises(ValueError, match="parameters saved, this optimizer has 2"):
        ddp.load_optimizer(short_opt, path)


def _colossal_fp16(rank: int, world: int, root: str) -> None:
    """Colossal-AI's own check, under its fp16 Gemini: the Gemini optimizer's
    ``state_dict(only_rank_0=False)`` equals the loaded DDP optimizer's ``state_dict()``, key
    count included (fp16's loss scale is not in Colossal-AI's two keys)."""
    from fp8boost.colossal.booster import Booster
    from fp8boost.colossal.booster.plugin import GeminiPlugin, TorchDDPPlugin
    from fp8boost.colossal.testing import check_state_dict_equal

    gemini = Booster(plugin=GeminiPlugin(precision="fp16", initial_scale=2 ** 14))
    model = H.make_mlp()
    model, opt, *_ = gemini.boost(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    _backward(gemini, model, opt, 0, rank, world)
    opt.step(), opt.zero_grad()
    path = f"{root}/optim16"
    gemini.save_optimizer(opt, path)
    ddp = Booster(plugin=TorchDDPPlugin())
    plain = H.make_mlp()
    plain, plain_opt, *_ = ddp.boost(plain, torch.optim.Adam(plain.parameters(), lr=1e-3))
    ddp.load_optimizer(plain_opt, path)
    check_state_dict_equal(opt.state_dict(only_rank_0=False), plain_opt.state_dict(),
                           ignore_device=False)
    # The file's last line: the DDP optimizer saved over the Gemini one at the same path (it was
    # refused as "not a checkpoint of this kind" on 2xH200). What is read back is DDP's state.
    _backward(ddp, plain, plain_opt, 1, rank, world)
    plain_opt.step(), plain_opt.zero_grad()
    ddp.save_optimizer(plain_opt, path)
    again = H.make_mlp()
    again, again_opt, *_ = ddp.boost(again, torch.optim.Adam(again.parameters(), lr=1e-3))
    ddp.load_optimizer(again_opt, path)
    check_state_dict_equal(plain_opt.state_dict(), again_opt.state_dict(), ignore_device=False)
    # Directories that are no optimizer checkpoint are still never replaced.
    foreign = f"{root}/foreign"
    if rank == 0:
        os.makedirs(foreign)
        with open(f"{foreign}/notes.txt", "w") as f:
            f.write("a user's file")
    torch.distributed.barrier()
    with pytest.raises(ValueError, match="not a checkpoint of this kind"):
        ddp.save_optimizer(plain_opt, foreign)
    with pytest.raises(ValueError, match="not a checkpoint of this kind"):
        ddp.save_model(plain, path)  # a model save over an optimizer checkpoint
    assert os.path.exists(f"{foreign}/notes.txt")


def _both(rank: int, world: int, root: str) -> None:
    _worker(rank, world, root)
    _colossal_fp16(rank, world, root)


def test_gemini_optimizer_checkpoint_loads_into_torch_ddp(tmp_path):
    run_distributed(_both, 2, str(tmp_path))
