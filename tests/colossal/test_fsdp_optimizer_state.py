"""The FSDP2 plugins' boosted optimizer gives plain full-size tensors from ``state_dict()``.

Colossal-AI's scripts and tests compare and ``torch.save`` what ``optimizer.state_dict()``
returns as plain tensors (``test_torch_fsdp_checkpoint_io.py`` compares them with ``!=`` when
their type is not exactly ``torch.Tensor``; Colossal-AI's FSDP1 gives flat local shards, its
Gemini full tensors). FSDP2's torch optimizer holds DTensor shards, so ``FsdpOptimizer`` (under
``TorchFSDPPlugin`` and ``GeminiPlugin``) gathers them to the parameters' full shapes, as ZeRO
does, and cuts them back on load.

On 2 gloo ranks, for both plugins, with Adam against a one-process torch reference:

* every state tensor of ``state_dict()`` is exactly a ``torch.Tensor`` at its parameter's full
  shape, equal to the gathered DTensor of the torch optimizer's own state and close (1e-6) to
  the reference's moments; both ranks return the same bytes;
* Colossal-AI's ``GeminiDDP.state_dict(only_rank_0=..., prefix=...)`` and
  ``GeminiOptimizer.state_dict(only_rank_0=...)`` calls give the whole model under the user's
  keys (plain tensors) and, with ``only_rank_0=True``, nothing on rank 1;
* under fp16, ``state_dict()`` also holds ``"loss_scaler"`` (its load restores the scale);
  Colossal-AI's call, with ``only_rank_0`` given, holds its two keys only;
* ``load_state_dict`` of it puts DTensor shards back (no communication) and a step redone from
  it is bit-identical; the state loads into a one-process torch Adam too.
"""
from __future__ import annotations

import copy
import io

import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.plugins import helpers as H

TOL = 1e-6


def _backward(booster, model, opt, step: int, rank: int, world: int) -> None:
    x, y = H.global_batch(step)
    loss = F.mse_loss(model(H.local_part(x, rank, world)).float(), H.local_part(y, rank, world))
    booster.backward(loss, opt)


def _weights(model) -> list[torch.Tensor]:
    return [p.full_tensor().clone() for p in model.unwrap().parameters()]


def _check(kind: str, rank: int, world: int) -> bytes:
    from torch.distributed.tensor import DTensor

    from fp8boost.colossal.booster import Booster
    from fp8boost.colossal.booster.plugin import GeminiPlugin, TorchFSDPPlugin

    plugin = {"torchfsdp": TorchFSDPPlugin, "gemini": GeminiPlugin}[kind](precision="fp32")
    booster = Booster(plugin=plugin)
    model = H.make_mlp()
    model, opt, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    ref = H.make_mlp()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    for step in range(2):
        _backward(booster, model, opt, step, rank, world)
        opt.step(), opt.zero_grad()
        x, y = H.global_batch(step)
        F.mse_loss(ref(x), y).backward()
        ref_opt.step(), ref_opt.zero_grad()

    raw = opt.optim.state_dict()["state"]
    assert isinstance(raw[0]["exp_avg"], DTensor)  # what the gather replaces
    state = opt.state_dict()
    ref_state = ref_opt.state_dict()["state"]
    assert state["param_groups"] == ref_opt.state_dict()["param_groups"]
    for i, p in enumerate(ref.parameters()):
        assert sorted(state["state"][i]) == sorted(ref_state[i]) == ["exp_avg", "exp_avg_sq",
                                                                     "step"]
        for key in ("exp_avg", "exp_avg_sq"):
            got = state["state"][i][key]
            assert type(got) is torch.Tensor and got.shape == p.shape, (kind, i, key, type(got))
            assert torch.equal(got, raw[i][key].full_tensor())
            assert (got - ref_state[i][key]).abs().max().item() <= TOL, (kind, i, key)
        assert torch.equal(state["state"][i]["step"], ref_state[i]["step"])

    # Colossal-AI's GeminiDDP / GeminiOptimizer calls (test_gemini_torch_compability.py,
    # test_plugins_huggingface_compatibility.py): the whole model under the user's keys after
    # prefix; only_rank_0=True leaves the other ranks empty (each rank still gathers)
    from fp8boost.parallel.fsdp.full_state_dict import full_of
    local = {k: full_of(v) for k, v in model.unwrap().state_dict().items()}
    assert [v.shape for v in local.values()] == [p.shape for p in ref.state_dict().values()]
    for only_rank_0 in (False, True):
        whole = model.state_dict(only_rank_0=only_rank_0, prefix="module.module.")
        if only_rank_0 and rank != 0:
            assert len(whole) == 0, kind
            continue
        assert list(whole) == [f"module.module.{k}" for k in local], kind
        for key, value in local.items():
            got = whole[f"module.module.{key}"]
            assert type(got) is torch.Tensor and torch.equal(got, value), key
    mine = opt.state_dict(only_rank_0=True)
    assert mine["param_groups"] == state["param_groups"]
    if rank:
        assert mine["state"] == {}
    else:
        assert all(torch.equal(mine["state"][i][k], state["state"][i][k])
                   for i in state["state"] for k in state["state"][i])

    # round trip: a step redone from the loaded state is bit-identical
    saved_opt = copy.deepcopy(state)
    saved_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _backward(booster, model, opt, 2, rank, world)
    opt.step(), opt.zero_grad()
    after = _weights(model)
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    loaded = opt.optim.state_dict()["state"]
    for i in sorted(loaded):
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(loaded[i][key], DTensor), (kind, i, key)
            assert torch.equal(loaded[i][key].full_tensor(), saved_opt["state"][i][key])
    _backward(booster, model, opt, 2, rank, world)
    opt.step(), opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(after, _weights(model))), kind
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _fp16_keys(rank: int, world: int) -> None:
    """Under fp16 torch's call keeps the loss scale; Colossal-AI's call (``only_rank_0`` given)
    has its two keys only, as ``test_gemini_torch_compability.py`` compares with torch Adam's."""
    from fp8boost.colossal.booster import Booster
    from fp8boost.colossal.booster.plugin import GeminiPlugin

    booster = Booster(plugin=GeminiPlugin(precision="fp16", initial_scale=2 ** 14))
    model = H.make_mlp()
    model, opt, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    _backward(booster, model, opt, 0, rank, world)
    opt.step(), opt.zero_grad()
    mine = opt.state_dict()
    assert sorted(mine) == ["loss_scaler", "param_groups", "state"], sorted(mine)
    assert mine["loss_scaler"]["scale"] == 2 ** 14, mine["loss_scaler"]
    for only_rank_0 in (False, True):
        colossal = opt.state_dict(only_rank_0=only_rank_0)
        assert sorted(colossal) == ["param_groups", "state"], sorted(colossal)
        assert colossal["param_groups"] == mine["param_groups"]
        assert len(colossal["state"]) == (0 if only_rank_0 and rank else len(mine["state"]))
    scaler = opt.loss_scaler
    scaler.update(True)  # an overflow halves the scale; torch's load puts it back
    assert scaler.state_dict()["scale"] == 2 ** 13
    opt.load_state_dict(mine)
    assert scaler.state_dict()["scale"] == 2 ** 14


def _run(rank: int, world: int) -> list[bytes]:
    _fp16_keys(rank, world)
    return [_check(kind, rank, world) for kind in ("torchfsdp", "gemini")]


def test_fsdp_optimizer_state_dict_is_plain_full_tensors():
    results = run_distributed(_run, 2)
    assert results[0] == results[1]  # every rank gathers the same state
    for saved in results[0]:
        state = torch.load(io.BytesIO(saved), weights_only=True)
        ref = H.make_mlp()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
        ref_opt.load_state_dict(state)  # torch's own layout: a plain optimizer takes it
        assert torch.equal(ref_opt.state[ref[0].weight]["exp_avg"],
                           state["state"][0]["exp_avg"])
