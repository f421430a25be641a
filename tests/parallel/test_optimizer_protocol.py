"""Every boosted optimizer implements the declared ``BoostedOptimizer`` interface.

Checked twice: at run time (``isinstance`` against the runtime-checkable protocols) and by
signature (every protocol method exists on the wrapper with the same parameters), so a wrapper
that drops or renames a member fails here rather than in a plugin's ``hasattr`` probe.
"""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from fp8boost.parallel.boosted_optimizer import (BoostedOptimizer, OptimizerProxy,
                                                 ShardedCheckpointState)
from fp8boost.parallel.zero import ZeroOptimizer
from fp8boost.plugins.fsdp_plugin_base import FsdpOptimizer
from fp8boost.parallel.wrappers import OptimizerWrapper


def _zero() -> ZeroOptimizer:
    model = nn.Linear(4, 4).to(torch.bfloat16)
    return ZeroOptimizer(torch.optim.AdamW(model.parameters()))


def _wrapper() -> OptimizerWrapper:
    return OptimizerWrapper(torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1), max_norm=1.0)


def _fsdp() -> FsdpOptimizer:
    # The constructor only stores the model: no process group or FSDP2 wrapping is needed.
    model = nn.Linear(4, 4)
    return FsdpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)


WRAPPERS = {"ZeroOptimizer": _zero, "OptimizerWrapper": _wrapper, "FsdpOptimizer": _fsdp}
CHECKPOINTABLE = ("ZeroOptimizer", "OptimizerWrapper")  # FSDP saves through DCP instead


def _methods(protocol: type) -> dict[str, inspect.Signature]:
    out = {}
    for name, member in vars(protocol).items():
        if callable(member) and not name.startswith("_"):
            out[name] = inspect.signature(member)
    return out


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_wrapper_is_a_boosted_optimizer(name: str) -> None:
    opt = WRAPPERS[name]()
    assert isinstance(opt, OptimizerProxy)
    assert isinstance(opt, BoostedOptimizer)
    assert isinstance(opt, ShardedCheckpointState) is (name in CHECKPOINTABLE)
    assert opt.param_groups is opt.optim.param_groups and opt.defaults is opt.optim.defaults


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_wrapper_signatures_match_the_protocol(name: str) -> None:
    opt = WRAPPERS[name]()
    protocols = [BoostedOptimizer] + ([ShardedCheckpointState] if name in CHECKPOINTABLE else [])
    for protocol in protocols:
        for method, sig in _methods(protocol).items():
            own = inspect.signature(getattr(type(opt), method))
            assert list(own.parameters) == list(sig.parameters), (name, method)
            for param, spec in sig.parameters.items():
                assert own.parameters[param].default == spec.default, (name, method, param)


def test_defaults_mean_nothing_to_do() -> None:
    opt = _wrapper()
    assert opt.exact_working_params() == {} and opt.loss_scaler is None
    assert opt.sync_master_from_model() is None and opt.nonfinite_guard is None
    with opt.no_sync():
        pass


def test_zero_optimizer_round_trip_through_protocol_calls() -> None:
    """A single-process step driven only through protocol members."""
    opt: BoostedOptimizer = _zero()
    model_params = list(opt.params)
    before = [p.detach().clone() for p in model_params]
    loss = sum((p.float() ** 2).sum() for p in model_params)
    opt.backward(loss)
    norm = opt.clip_grad_norm_(1e9)
    assert torch.isfinite(norm)
    opt.step()
    opt.zero_grad()
    assert any(not torch.equal(a, b) for a, b in zip(before, model_params))
    assert opt.exact_working_params() == {}
    opt.sync_master_from_model()


@pytest.mark.parametrize("opt_cls,fused", [(torch.optim.AdamW, None), (torch.optim.AdamW, False),
                                           (torch.optim.SGD, False)])
def test_master_weight_optimizer_is_zero_at_one_rank(opt_cls, fused) -> None:
    """The master-weight layer alone steps exactly as ZeroOptimizer without a dp group."""
    from fp8boost.parallel.zero import MasterWeightOptimizer

    torch.manual_seed(0)
    a = nn.Linear(8, 8).to(torch.bfloat16)
    b = nn.Linear(8, 8).to(torch.bfloat16)
    b.load_state_dict(a.state_dict())
    kw = {"lr": 0.1}
    oa = ZeroOptimizer(opt_cls(a.parameters(), **kw), max_norm=0.5, fused_master_step=fused)
    ob = MasterWeightOptimizer(opt_cls(b.parameters(), **kw), max_norm=0.5,
                               fused_master_step=fused)
    assert isinstance(ob, BoostedOptimizer) and isinstance(ob, ShardedCheckpointState)
    assert oa.uses_fused_step == ob.uses_fused_step == (fused is None)
    for step in range(3):
        x = torch.randn(4, 8, dtype=torch.bfloat16)
        for model, opt in ((a, oa), (b, ob)):
            opt.backward(model(x).float().pow(2).mean() * (step + 1))
            opt.step()
            opt.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    for ma, mb in zip(oa.full_master_params(), ob.full_master_params()):
        assert torch.equal(ma, mb)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_boosted_model_holds_the_optimizer_boost_returned(precision: str) -> None:
    """The model ``boost`` returns holds its optimizer explicitly (no side attribute)."""
    from fp8boost.booster import Booster

    model = nn.Sequential(nn.Linear(4, 4))
    booster = Booster(mixed_precision=precision, device="cpu")
    wrapped, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters()))
    assert isinstance(opt, BoostedOptimizer)
    assert len(wrapped.boosted_optimizers) == 1 and wrapped.boosted_optimizers[0] is opt
    assert booster.plugin.exact_weights(wrapped) == {}
    assert booster.plugin.exact_weights(model) == {}  # not a model boost returned: none held
    booster.plugin.after_load_model(wrapped)
