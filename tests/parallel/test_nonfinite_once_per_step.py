"""The non-finite guard checks the gradients once per optimizer step, also with clipping.

Regression: ``OptimizerWrapper`` (FP32) and ``FsdpOptimizer`` forgot the step's verdict before
clipping, so ``max_norm > 0`` checked the gradients twice per step: the guard's step count (named
in its warnings) doubled and one bad step counted as two towards ``max_consecutive``.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from fp8boost.booster import Booster
from fp8boost.booster.mixed_precision import MixedPrecision
from fp8boost.parallel.nonfinite import NonFiniteGuard
from fp8boost.plugins import TorchFSDPPlugin


def _boost(kind: str, guard: NonFiniteGuard):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if kind == "fp32":
        booster = Booster(mixed_precision=MixedPrecision("fp32", max_norm=1.0), device="cpu",
                          nonfinite_guard=guard)
    else:
        booster = Booster(plugin=TorchFSDPPlugin(precision="fp32", max_norm=1.0), device="cpu",
                          nonfinite_guard=guard)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


@pytest.fixture(autouse=True)
def _no_group_left():
    """TorchFSDPPlugin starts a one-process group: later tests check that none is left."""
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["fp32", "fsdp"])
def test_guard_checks_once_per_step_with_clipping(kind):
    guard = NonFiniteGuard(max_consecutive=2)
    booster, model, opt = _boost(kind, guard)
    guard = opt.nonfinite_guard  # boost binds a copy to the run's group
    x = torch.randn(8, 16)
    for _ in range(3):
        booster.backward(model(x).pow(2).mean(), opt)
        opt.step()
        opt.zero_grad()
    assert guard.step == 3
    # one bad step is one strike: training goes on after it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        booster.backward(model(x * float("nan")).pow(2).mean(), opt)
        opt.step()
        opt.zero_grad()
    assert guard.step == 4 and guard.consecutive == 1
