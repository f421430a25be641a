"""The Colossal-AI wrapper surface on every plugin's boosted objects, on gloo ranks (CPU).

Module-level so spawned ranks can import it; ``tests/colossal/test_interface.py`` runs it.

Each plugin trains the same MLP in FP32 with plain SGD (no momentum: an update is exactly
``-lr * grad``, so a wrong gradient or clip shows in the weights) on the same global batches as
a single-process torch reference, and checks:

* ``isinstance`` against ``fp8boost.colossal.interface`` (and ``HybridParallelModule`` only
  for the hybrid plugin);
* ``get_param_grad`` equals the reference's full-batch gradient;
* ``clip_grad_by_norm`` returns ``torch.nn.utils.clip_grad_norm_``'s norm and clips alike (the
  weights after the step match), ``get_grad_norm`` reports it;
* ``clip_grad_by_value`` clamps alike (weights after the step match);
* ``state_dict`` / ``load_state_dict`` (optimizer and model) resume bit-exactly: a step redone
  from the restored state gives bit-identical weights;
* ZeRO's ``working_to_master_param`` / ``master_to_working_param`` / ``get_param_padding_size``
  describe its chunks (Colossal-AI's own check);
* ``unwrap`` / ``unwrap_model``.

Tolerance: 1e-6 absolute on gradients, norms and weights (FP32; only the order of the sums over
the two half batches differs: measured below 1e-7 on weights of size ~0.1).
"""
from __future__ import annotations

import copy
import io

import torch
import torch.nn.functional as F

from tests.plugins import helpers as H

TOL = 1e-6
LR = 0.1


def make_plugin(kind: str):
    from fp8boost.colossal.booster.plugin import (GeminiPlugin, HybridParallelPlugin,
                                                  LowLevelZeroPlugin, TorchDDPPlugin,
                                                  TorchFSDPPlugin)
    return {
        "ddp": lambda: TorchDDPPlugin(precision="fp32"),
        "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32",
                                            reduce_bucket_size_in_m=0.002),
        "gemini": lambda: GeminiPlugin(precision="fp32"),
        "torchfsdp": lambda: TorchFSDPPlugin(precision="fp32"),
        "hybrid": lambda: HybridParallelPlugin(tp_size=1, zero_stage=1, precision="fp32"),
    }[kind]()


def full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor (FSDP's DTensors gathered: collective)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def snapshot(obj):
    """A deep copy whose tensors are clones (DTensors stay DTensors)."""
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return copy.deepcopy(obj)


def weights(model) -> dict[str, torch.Tensor]:
    return {n: full(p).detach().clone() for n, p in model.unwrap().named_parameters()}


def backward(booster, model, opt, step: int, rank: int, world: int) -> None:
    x, y = H.global_batch(step)
    loss = F.mse_loss(model(H.local_part(x, rank, world)).float(), H.local_part(y, rank, world))
    booster.backward(loss, opt)


def ref_backward(ref, step: int) -> None:
    x, y = H.global_batch(step)
    F.mse_loss(ref(x), y).backward()


def check_close(got: dict, want: dict, what: str) -> None:
    for name, w in want.items():
        err = (got[name].float() - w.float()).abs().max().item()
        assert err <= TOL, f"{what} {name}: max error {err}"


def check_types(kind: str, model, opt) -> None:
    from fp8boost.colossal.booster.plugin.hybrid_parallel_plugin import HybridParallelModule
    from fp8boost.colossal.interface import AMPModelMixin, ModelWrapper, OptimizerWrapper

    assert isinstance(opt, OptimizerWrapper), type(opt)
    assert isinstance(model, ModelWrapper) and isinstance(model, AMPModelMixin), type(model)
    assert isinstance(model, HybridParallelModule) == (kind == "hybrid")
    assert opt.unwrap() is opt.optim and opt.unwrap_model() is model
    assert model.unwrap() is model.module or kind == "ddp"
    assert opt.param_groups is opt.optim.param_groups and opt.get_grad_norm() is None


def check_zero_maps(model, opt, rank: int, world: int) -> None:
    """Colossal-AI's test of the ZeRO maps: each master is its rank's padded chunk."""
    ids = {id(p) for p in model.parameters()}
    assert len(opt.working_to_master_param) == len(ids)
    for p_id, master in opt.working_to_master_param.items():
        assert p_id in ids
        working = opt.master_to_working_param[id(master)]
        padding = opt.get_param_padding_size(working)
        padded = F.pad(working.data.view(-1), (0, padding))
        assert torch.equal(padded.chunk(world)[rank], master.view(-1).to(padded.dtype))


def run_plugin(kind: str, rank: int, world: int) -> None:
    from fp8boost.colossal.booster import Booster

    ref = H.make_mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    booster = Booster(plugin=make_plugin(kind))
    model = H.make_mlp()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR))
    check_types(kind, model, opt)
    names = dict(model.unwrap().named_parameters())

    # step 0: the reduced gradients, then clipping by norm, as torch does on one process
    backward(booster, model, opt, 0, rank, world)
    ref_backward(ref, 0)
    grads = {n: opt.get_param_grad(p) for n, p in names.items()}
    check_close(grads, {n: p.grad for n, p in ref.named_parameters()}, f"{kind} grad")
    norm = opt.clip_grad_by_norm(0.05)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert float(ref_norm) > 0.1  # the clip is active
    assert abs(float(norm) - float(ref_norm)) <= TOL, (kind, float(norm), float(ref_norm))
    assert opt.get_grad_norm() == float(norm)
    opt.step(), ref_opt.step()
    opt.zero_grad(), ref_opt.zero_grad()
    check_close(weights(model), dict(ref.named_parameters()), f"{kind} clipped-by-norm step")

    # step 1: clipping by value
    backward(booster, model, opt, 1, rank, world)
    ref_backward(ref, 1)
    assert max(p.grad.abs().max() for p in ref.parameters()) > 4e-3  # the clamp is active
    opt.clip_grad_by_value(2e-3)
    torch.nn.utils.clip_grad_value_(ref.parameters(), 2e-3)
    opt.step(), ref_opt.step()
    opt.zero_grad()
    check_close(weights(model), dict(ref.named_parameters()), f"{kind} clipped-by-value step")
    if kind in ("zero2", "hybrid"):
        check_zero_maps(model.unwrap(), opt, rank, world)

    # state_dict round trip: a step redone from the restored state is bit-identical
    saved_opt, saved_model = snapshot(opt.state_dict()), snapshot(model.state_dict())
    backward(booster, model, opt, 2, rank, world)
    opt.step()
    opt.zero_grad()
    after = weights(model)
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    backward(booster, model, opt, 2, rank, world)
    opt.step()
    opt.zero_grad()
    again = weights(model)
    assert all(torch.equal(after[n], again[n]) for n in after), f"{kind}: resume not bit-exact"


def run_all(rank: int, world: int, kinds: tuple[str, ...]) -> dict:
    """Every plugin in turn; rank 0 returns a ZeRO-2 Adam's ``state_dict()`` (full shapes)
    and weights after one step, as ``torch.save`` bytes."""
    for kind in kinds:
        run_plugin(kind, rank, world)
    from fp8boost.colossal.booster import Booster

    booster = Booster(plugin=make_plugin("zero2"))
    model = H.make_mlp()
    model, opt, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    backward(booster, model, opt, 0, rank, world)
    opt.step()
    state = opt.state_dict()  # collective: every rank gathers
    if rank != 0:
        return b""
    buf = io.BytesIO()  # bytes, not tensors: shared-memory tensors die with the rank
    torch.save({"state": state, "weights": weights(model)}, buf)
    return buf.getvalue()
