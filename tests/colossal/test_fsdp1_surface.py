"""The Colossal-AI-facing ``TorchFSDPPlugin`` answers as Colossal-AI's FSDP1 one does.

Colossal-AI's ``test_torch_fsdp_checkpoint_io.py`` compares ``model.state_dict()``,
``model.unwrap().state_dict()`` and ``FSDP.full_optim_state_dict(opt.unwrap_model().unwrap(),
optim=opt)`` as plain tensors (``fp8boost/colossal/booster/plugin/fsdp1_surface.py``). On 2
gloo ranks, after a step of SGD with momentum:

* both state dicts hold plain tensors at full shapes, equal to the gathered parameters, the
  same on both ranks; ``keep_vars=True`` and :func:`sharded_state_dicts` still give FSDP2's
  DTensors; ``load_state_dict`` of full tensors (the boosted model's and the user model's)
  puts the right shards back;
* ``FSDP.full_optim_state_dict`` gives rank 0 the state keyed by parameter name, on the CPU,
  equal to the boosted optimizer's ``state_dict()`` (``{}`` on rank 1; both with
  ``rank0_only=False``), from the boosted or the raw torch optimizer;
* ``booster.save_model`` / ``save_optimizer`` (shards, DCP) and their loads still round-trip;
* fp8boost's own ``TorchFSDPPlugin`` keeps FSDP2's DTensor state dict.
"""
from __future__ import annotations

import io
import tempfile

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.plugins import helpers as H


def _boost(plugin_cls, rank: int, world: int):
    from fp8boost.colossal.booster import Booster

    booster = Booster(plugin=plugin_cls(precision="fp32"))
    model = H.make_mlp()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                          momentum=0.9))
    x, y = H.global_batch(0)
    booster.backward(F.mse_loss(model(H.local_part(x, rank, world)),
                                H.local_part(y, rank, world)), opt)
    opt.step(), opt.zero_grad()
    return booster, model, opt


def _check_state_dicts(model) -> None:
    from torch.distributed.tensor import DTensor

    from fp8boost.parallel.fsdp.full_state_dict import sharded_state_dicts

    full = {n: p.full_tensor() for n, p in model.unwrap().named_parameters()}
    for sd, prefix in ((model.state_dict(), "module."), (model.unwrap().state_dict(), "")):
        for name, value in full.items():
            got = sd[prefix + name]
            assert type(got) is torch.Tensor and torch.equal(got, value), name
    assert all(isinstance(v, DTensor) for k, v in model.unwrap().state_dict(keep_vars=True)
               .items() if k in full)
    with sharded_state_dicts():
        assert all(isinstance(model.unwrap().state_dict()[k], DTensor) for k in full)
    # load: full tensors in, shards out (through the wrapper and the user model)
    changed = {k: v + 1.0 for k, v in model.unwrap().state_dict().items()}
    model.unwrap().load_state_dict(changed)
    assert all(torch.equal(p.full_tensor(), changed[n])
               for n, p in model.unwrap().named_parameters())
    model.load_state_dict({f"module.{k}": v for k, v in full.items()})
    assert all(isinstance(p, DTensor) and torch.equal(p.full_tensor(), full[n])
               for n, p in model.unwrap().named_parameters())


def _check_full_optim_state_dict(opt, rank: int) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    module = opt.unwrap_model().unwrap()
    names = [n for n, _ in module.named_parameters()]
    plain = opt.state_dict()
    for optim in (opt, opt.optim):
        osd = FSDP.full_optim_state_dict(module, optim=optim)
        if rank != 0:
            assert osd == {}
            continue
        assert osd["param_groups"][0]["params"] == names
        assert osd["param_groups"][0]["lr"] == 0.1
        for i, name in enumerate(names):
            buf = osd["state"][name]["momentum_buffer"]
            assert type(buf) is torch.Tensor and buf.device.type == "cpu"
            assert torch.equal(buf, plain["state"][i]["momentum_buffer"].cpu()), name
    both = FSDP.full_optim_state_dict(module, optim=opt, rank0_only=False)
    assert sorted(both["state"]) == sorted(names)
    with pytest.raises(ValueError, match="optim_input"):
        FSDP.full_optim_state_dict(module, optim=opt, optim_input=list(module.parameters()))


def _check_booster_round_trip(booster, model, opt, rank: int, world: int) -> None:
    import torch.distributed as dist

    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    tmp = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(tmp)
    booster.save_model(model, f"{tmp[0]}/model", shard=True)
    booster.save_optimizer(opt, f"{tmp[0]}/optim", shard=True)
    x, y = H.global_batch(1)
    booster.backward(F.mse_loss(model(H.local_part(x, rank, world)),
                                H.local_part(y, rank, world)), opt)
    opt.step(), opt.zero_grad()
    booster.load_model(model, f"{tmp[0]}/model")
    booster.load_optimizer(opt, f"{tmp[0]}/optim")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved_model.items())
    restored = opt.state_dict()["state"]
    assert all(torch.equal(v["momentum_buffer"], restored[i]["momentum_buffer"])
               for i, v in saved_opt["state"].items())


def _run(rank: int, world: int) -> bytes:
    from torch.distributed.tensor import DTensor

    from fp8boost.colossal.booster.plugin import TorchFSDPPlugin
    from fp8boost.plugins import TorchFSDPPlugin as NativeTorchFSDPPlugin

    booster, model, opt = _boost(TorchFSDPPlugin, rank, world)
    _check_state_dicts(model)
    _check_full_optim_state_dict(opt, rank)
    _check_booster_round_trip(booster, model, opt, rank, world)
    _, native, _ = _boost(NativeTorchFSDPPlugin, rank, world)
    assert isinstance(native.unwrap().state_dict()["0.weight"], DTensor)
    buf = io.BytesIO()  # bytes: tensors do not outlive the rank's process through the queue
    torch.save(model.state_dict(), buf)
    return buf.getvalue()


def test_torch_fsdp_plugin_answers_as_fsdp1():
    first, second = run_distributed(_run, 2)
    assert first == second  # every rank holds the same full tensors


def test_install_keeps_torchs_function_once():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from fp8boost.colossal.booster.plugin import fsdp1_surface

    fsdp1_surface.install_full_optim_state_dict()
    fsdp1_surface.install_full_optim_state_dict()
    assert FSDP.full_optim_state_dict is fsdp1_surface.full_optim_state_dict
    assert fsdp1_surface._TORCH_FULL_OPTIM_STATE_DICT is not fsdp1_surface.full_optim_state_dict
