"""Colossal-AI's ``FP16TorchMixedPrecision`` (``fp8boost.colossal.booster.amp``): torch AMP in
FP16 through ``configure``, and ``Booster(mixed_precision=FP16TorchMixedPrecision())``."""
from __future__ import annotations

import logging

import torch

from fp8boost import _state
from fp8boost.colossal.booster import Booster
from fp8boost.colossal.booster.mixed_precision import (FP16TorchMixedPrecision, TorchAMPModule,
                                                       TorchAMPOptimizer)
from fp8boost.colossal.interface import ModelWrapper, OptimizerWrapper


def test_configure_runs_torch_amp_and_its_scaler():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    start = [p.detach().clone() for p in net.parameters()]
    amp = FP16TorchMixedPrecision(init_scale=2.0 ** 8, growth_interval=1)
    model, opt, crit = amp.configure(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                     lambda y: y.float().pow(2).mean())
    assert isinstance(model, (TorchAMPModule, ModelWrapper))
    assert isinstance(opt, (TorchAMPOptimizer, OptimizerWrapper))
    x = torch.randn(4, 8)
    out = model(x)
    assert out.dtype == torch.float16 and net[0].weight.dtype == torch.float32  # autocast only
    loss = crit(out)
    assert torch.allclose(opt.scale_loss(loss), loss * 256)
    opt.backward(loss)
    plain = torch.autograd.grad(crit(torch.nn.Sequential(*net)(x)), net[2].weight)[0]
    assert net[2].weight.grad.abs().max() > 10 * plain.abs().max()  # still scaled
    norm = opt.clip_grad_by_norm(1e6)  # unscales first (Colossal-AI's order), then clips
    assert torch.isfinite(norm)
    assert torch.allclose(net[2].weight.grad, plain, rtol=0.05, atol=1e-3)
    opt.step()
    opt.zero_grad()
    assert opt.scaler.get_scale() == 512.0  # finite step: grown after growth_interval=1
    assert any(not torch.equal(a, p) for a, p in zip(start, net.parameters()))


def test_booster_trains_fp8boosts_fp16_in_its_place(caplog):
    _state.reset()
    with caplog.at_level(logging.INFO, logger="fp8boost.colossal"):
        booster = Booster("cpu", FP16TorchMixedPrecision())
        again = Booster(device="cpu", mixed_precision=FP16TorchMixedPrecision())
    assert booster.plugin.mp.precision == "fp16"
    assert again.plugin.mp.precision == "fp16"
    assert caplog.text.count("FP16TorchMixedPrecision") == 1  # once per process
    _state.reset()


def test_boosted_optimizers_answer_scale_loss_as_colossal_ai_does():
    """Colossal-AI's base OptimizerWrapper raises NotImplementedError for scale_loss and
    unscale_grad (only its AMP optimizer has them); so do fp8boost's, naming the fix."""
    import pytest

    opt = OptimizerWrapper(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(NotImplementedError, match="booster.backward"):
        opt.scale_loss(torch.ones(()))
    with pytest.raises(NotImplementedError, match="unscales its gradients itself"):
        opt.unscale_grad()
