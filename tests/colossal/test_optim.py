"""HybridAdam equals torch's AdamW/Adam step for step; CosineAnnealingWarmupLR its closed form.

Equality is exact (``torch.equal``): HybridAdam *is* torch's implementation with the
foreach path on the CPU, so the same inputs must give the same bits.
"""
from __future__ import annotations

import math

import pytest
import torch

from fp8boost.colossal.nn.lr_scheduler import CosineAnnealingWarmupLR
from fp8boost.colossal.nn.optimizer import HybridAdam


def _run(make_opt, steps: int = 5) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = make_opt(model.parameters())
    data = torch.randn(steps, 3, 8)
    for x in data:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_hybrid_adam_equals_torch(adamw_mode):
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ours = _run(lambda p: HybridAdam(p, adamw_mode=adamw_mode, **kw))
    ref = _run(lambda p: ref_cls(p, foreach=True, **kw))
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    # Adam and AdamW differ with weight decay: the mode really switches the semantics
    other = _run(lambda p: HybridAdam(p, adamw_mode=not adamw_mode, **kw))
    assert not all(torch.equal(a, b) for a, b in zip(ours, other))


def test_hybrid_adam_is_a_torch_adamw_and_picks_foreach_on_cpu():
    p = torch.nn.Parameter(torch.ones(3))
    opt = HybridAdam([p], lr=0.1)
    assert isinstance(opt, torch.optim.AdamW)
    p.grad = torch.ones(3)
    opt.step()
    assert opt.param_groups[0]["foreach"] is True and opt.param_groups[0]["fused"] is False
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    # a state dict round trip keeps adamw_mode=False's L2 decay
    adam = HybridAdam([torch.nn.Parameter(torch.ones(2))], adamw_mode=False)
    adam.load_state_dict(adam.state_dict())
    assert adam.param_groups[0]["decoupled_weight_decay"] is False


def test_hybrid_adam_refuses_nvme_offload_and_no_bias_correction():
    params = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="cpu_offload"):
        HybridAdam(params, nvme_offload_fraction=0.5)
    with pytest.raises(ValueError, match="NVMe"):
        HybridAdam(params, nvme_offload_dir="/tmp/x")
    with pytest.raises(ValueError, match="bias_correction"):
        HybridAdam(params, bias_correction=False)


def _closed_form(k: int, base: float, total: int, warmup: int, eta_min: float) -> float:
    # Colossal-AI: WarmupScheduler((k+1)/W * base) then CosineAnnealingLR(T_max = total - W)
    if k < warmup:
        return base * (k + 1) / warmup
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * (k - warmup) / (total - warmup))) / 2


@pytest.mark.parametrize("total,warmup,eta_min", [(20, 5, 0.0), (12, 0, 1e-4), (7, 3, 0.01)])
def test_cosine_annealing_warmup_lr_closed_form(total, warmup, eta_min):
    bases = [0.1, 0.03]
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": [model.weight], "lr": bases[0]},
                           {"params": [model.bias], "lr": bases[1]}])
    sched = CosineAnnealingWarmupLR(opt, total_steps=total, warmup_steps=warmup, eta_min=eta_min)
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    for k in range(total + 3):  # a few steps past the end too
        for group, base in zip(opt.param_groups, bases):
            assert group["lr"] == pytest.approx(_closed_form(k, base, total, warmup, eta_min),
                                                rel=1e-12, abs=1e-15), (k, group["lr"])
        opt.step()
        sched.step()
    # the schedule's landmarks: base at the end of warm-up, eta_min at total_steps
    if warmup:
        assert _closed_form(warmup - 1, 1.0, total, warmup, 0) == 1.0
    assert _closed_form(total, 1.0, total, warmup, eta_min) == pytest.approx(eta_min)


def test_cosine_annealing_warmup_lr_resumes_from_state_dict():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched = CosineAnnealingWarmupLR(opt, total_steps=10, warmup_steps=3)
    for _ in range(5):
        opt.step(); sched.step()
    opt2 = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched2 = CosineAnnealingWarmupLR(opt2, total_steps=10, warmup_steps=3)
    sched2.load_state_dict(sched.state_dict())
    opt.step(); sched.step(); opt2.step(); sched2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == \
        pytest.approx(_closed_form(6, 1.0, 10, 3, 0.0))


def test_cosine_annealing_warmup_lr_rejects_bad_steps():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    with pytest.raises(ValueError, match="total_steps"):
        CosineAnnealingWarmupLR(opt, total_steps=5, warmup_steps=5)
    with pytest.raises(ValueError, match="warmup_steps"):
        CosineAnnealingWarmupLR(opt, total_steps=5, warmup_steps=-1)


def test_hybrid_adam_fused_choice_moves_existing_steps():
    """When a group turns fused, step counters made on the CPU (foreach steps, a checkpoint
    loaded before the first step) move beside their parameters as float32, as torch's fused
    kernel needs. The test machine has no CUDA: a meta-device parameter stands in for it."""
    p = torch.nn.Parameter(torch.empty(3, device="meta"))
    opt = HybridAdam([p], lr=0.1)
    opt.state[p]["step"] = torch.tensor(5.0, dtype=torch.float64)  # on the CPU
    opt._steps_beside_params(opt.param_groups[0])
    step = opt.state[p]["step"]
    assert step.device.type == "meta" and step.dtype == torch.float32
