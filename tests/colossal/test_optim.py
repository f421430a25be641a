"""HybridAdam equals torch's AdamW/Adam step for step; CosineAnnealingWarmupLR is Colossal-AI's.

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
    # a resume loads the optimizer (whose groups carry the lr) and the scheduler
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched = CosineAnnealingWarmupLR(opt, total_steps=10, warmup_steps=3)
    for _ in range(5):
        opt.step(); sched.step()
    opt2 = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched2 = CosineAnnealingWarmupLR(opt2, total_steps=10, warmup_steps=3)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert sched2.get_last_lr() == sched.get_last_lr()
    for k in range(6, 12):
        opt.step(); sched.step(); opt2.step(); sched2.step()
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == \
            pytest.approx(_closed_form(k, 1.0, 10, 3, 0.0), rel=1e-12, abs=1e-15)
        assert sched2.get_last_lr() == sched.get_last_lr() == [opt.param_groups[0]["lr"]]


def test_cosine_annealing_warmup_lr_built_on_a_stepped_optimizer():
    # Colossal-AI's test_general_checkpoint_io builds a second scheduler on an optimizer that
    # already stepped: without warm-up the lr stays as it is (torch's CosineAnnealingLR keeps
    # the current lr at its step 0); with warm-up it restarts from initial_lr, which the first
    # scheduler set and torch keeps
    opt = torch.optim.Adam(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    first = CosineAnnealingWarmupLR(opt, total_steps=10)
    opt.step(); first.step()
    stepped = 1e-3 * (1 + math.cos(math.pi / 10)) / 2  # 0.000975...
    assert opt.param_groups[0]["lr"] == pytest.approx(stepped, rel=1e-12)
    second = CosineAnnealingWarmupLR(opt, total_steps=10)
    assert opt.param_groups[0]["lr"] == pytest.approx(stepped, rel=1e-12)
    assert second.get_last_lr() == [opt.param_groups[0]["lr"]]
    assert second.base_lrs == [1e-3] and opt.param_groups[0]["initial_lr"] == 1e-3
    CosineAnnealingWarmupLR(opt, total_steps=10, warmup_steps=4)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / 4)


def test_cosine_annealing_warmup_lr_anneals_the_current_lr():
    # the cosine phase is torch's recursive update: an lr changed by hand is annealed on
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched = CosineAnnealingWarmupLR(opt, total_steps=6, warmup_steps=2)
    for _ in range(3):
        opt.step(); sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(_closed_form(3, 1.0, 6, 2, 0.0))
    opt.param_groups[0]["lr"] /= 2
    opt.step(); sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(_closed_form(4, 1.0, 6, 2, 0.0) / 2)
    assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]


def test_cosine_annealing_warmup_lr_state_dict_is_colossal_ais():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched = CosineAnnealingWarmupLR(opt, total_steps=10, warmup_steps=3, eta_min=0.01)
    for _ in range(5):
        opt.step(); sched.step()
    # the warm-up scheduler's own count stops at warmup_steps; the cosine part counts on
    assert (sched.last_epoch, sched.after_scheduler.last_epoch, sched.finished) == (3, 2, True)
    state = sched.state_dict()
    assert {"warmup_epochs", "finished", "base_lrs", "last_epoch", "_step_count",
            "_last_lr"} <= state.keys()
    assert "optimizer" not in state and "after_scheduler" not in state
    assert (state["warmup_epochs"], state["finished"], state["after_scheduler_type"]) == \
        (3, True, "CosineAnnealingLR")
    after = state["after_scheduler_dict"]
    assert (after["T_max"], after["eta_min"], after["last_epoch"]) == (7, 0.01, 2)
    # a dict written by Colossal-AI (no _is_initial, an older torch's verbose) loads too
    colossal = {key: value for key, value in state.items() if key != "_is_initial"}
    colossal["verbose"] = False
    opt2 = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched2 = CosineAnnealingWarmupLR(opt2, total_steps=10, warmup_steps=3, eta_min=0.01)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(colossal)
    opt.step(); sched.step(); opt2.step(); sched2.step()
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert sched2.after_scheduler.last_epoch == 3


def test_cosine_annealing_warmup_lr_refuses_a_schedule_without_a_cosine_phase():
    # Colossal-AI takes these and divides by zero at the first cosine step past the end.
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    with pytest.raises(ValueError, match=r"total_steps \(2\) must exceed warmup_steps \(2\)"):
        CosineAnnealingWarmupLR(opt, total_steps=2, warmup_steps=2)
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        CosineAnnealingWarmupLR(opt, total_steps=2, warmup_steps=-1)


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
