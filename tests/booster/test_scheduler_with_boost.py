"""A torch lr scheduler built on the raw optimizer before ``boost`` drives the boosted one.

The user's order (torch's documented one): build the optimizer, build the scheduler on it, then
``booster.boost(model, optimizer, lr_scheduler=scheduler)``, then every step
``optimizer.step(); scheduler.step()``. torch's ``LRScheduler`` wraps the raw optimizer's
``step`` to notice that it ran; a boosted step that updates the parameters without going
through that ``step`` (the fused master-weight AdamW step) made torch warn
"Detected call of `lr_scheduler.step()` before `optimizer.step()`" on the first step and
skipped the user's step hooks.

Oracle for the learning rates: the same scheduler on a plain torch optimizer, stepped the same
number of times. Oracle for "the step used that lr": a schedule that is 0 on one step leaves
every weight (and FP32 master) bit-identical across that step.
"""
from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fp8boost.booster import Booster, MixedPrecision
from fp8boost.fp8 import Fp8Config
from fp8boost.plugins import LowLevelZeroPlugin, TorchDDPPlugin
from tests.dist_utils import run_distributed
from tests.plugins import helpers as H

EMULATED = Fp8Config(backend="emulated", min_numel=0)  # FP8 emulated on the CPU; tiny layers too
STEPS = 4
ZERO_STEP = 2  # LambdaLR's factor is 0 at this step: nothing may move across it
_ORDER_WARNING = "lr_scheduler.step()` before `optimizer.step()"

SCHEDULERS: dict[str, Callable] = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.0 if s == ZERO_STEP else 1.0 / (s + 1)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
}


def _expected_lrs(kind: str, lr: float) -> list[float]:
    """torch's own sequence: lr after 0, 1, ..., STEPS scheduler steps on a plain optimizer."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = SCHEDULERS[kind](opt)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(STEPS):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def _train_with_scheduler(booster: Booster, kind: str, rank: int = 0, world: int = 1) -> dict:
    """Build optimizer + scheduler, boost, train STEPS steps; return what the test checks."""
    model = H.make_mlp(0)
    raw = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = SCHEDULERS[kind](raw)
    calls = {"pre": 0, "post": 0}
    raw.register_step_pre_hook(lambda *_: calls.__setitem__("pre", calls["pre"] + 1))
    raw.register_step_post_hook(lambda *_: calls.__setitem__("post", calls["post"] + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, _, _, sched = booster.boost(model, raw, lr_scheduler=sched)
        lrs, frozen = [opt.param_groups[0]["lr"]], None
        for step in range(STEPS):
            before = [p.detach().clone() for p in model.unwrap().parameters()]
            H.train(booster, model, opt, rank, world, steps=1, start=step)
            if step == ZERO_STEP and kind == "lambda":
                frozen = all(torch.equal(b, p) for b, p in
                             zip(before, model.unwrap().parameters()))
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    return {"warnings": [str(w.message) for w in caught if _ORDER_WARNING in str(w.message)],
            "lrs": lrs, "frozen": frozen, "hooks": dict(calls),
            "opt_called": getattr(raw, "_opt_called", False), "fused": getattr(opt, "_fused", None)}


def _check(result: dict, kind: str, label: str) -> None:
    assert result["warnings"] == [], f"{label}: torch warned {result['warnings'][0]!r}"
    assert result["lrs"] == pytest.approx(_expected_lrs(kind, 1e-2), rel=1e-12, abs=0), label
    if kind == "lambda":
        assert result["frozen"], f"{label}: weights moved on a step whose scheduled lr is 0"
    assert result["opt_called"], f"{label}: the scheduler never saw optimizer.step() run"
    # Like torch: each optimizer.step() runs the user's pre and post step hooks once.
    assert result["hooks"] == {"pre": STEPS, "post": STEPS}, label


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
@pytest.mark.parametrize("precision,fused", [("bf16", None), ("fp8", None), ("bf16", False),
                                             ("fp32", None)])
def test_scheduler_built_before_boost_drives_the_local_booster(precision, fused, kind):
    mp = MixedPrecision(precision, EMULATED if precision == "fp8" else None,
                        fused_master_step=fused)
    result = _train_with_scheduler(Booster(mixed_precision=mp, device="cpu"), kind)
    if precision != "fp32":  # the default takes the fused master step wherever it applies
        assert result["fused"] is (fused is None)
    _check(result, kind, f"Booster({precision}, fused_master_step={fused})")


def _plugins_worker(rank: int, world: int) -> dict:
    """Every data-parallel plugin, in one spawn: {label: result}."""
    out = {}
    cases = {
        "TorchDDPPlugin(bf16)": lambda: Booster(plugin=TorchDDPPlugin(precision="bf16"),
                                                device="cpu"),
        "TorchDDPPlugin(fp8)": lambda: Booster(plugin=TorchDDPPlugin(
            precision="bf16", use_fp8=True, fp8_config=EMULATED), device="cpu"),
        "TorchDDPPlugin(fp32)": lambda: Booster(plugin=TorchDDPPlugin(precision="fp32"),
                                                device="cpu"),
        "LowLevelZeroPlugin(stage=1)": lambda: Booster(
            plugin=LowLevelZeroPlugin(stage=1, precision="bf16"), device="cpu"),
        "LowLevelZeroPlugin(stage=2, fp8)": lambda: Booster(plugin=LowLevelZeroPlugin(
            stage=2, precision="bf16", use_fp8=True, fp8_config=EMULATED), device="cpu"),
    }
    for label, make in cases.items():
        for kind in ("lambda", "cosine"):
            out[f"{label} {kind}"] = _train_with_scheduler(make(), kind, rank, world)
            dist.barrier()
    return out


def test_scheduler_built_before_boost_drives_every_plugin_on_two_ranks():
    for rank, results in enumerate(run_distributed(_plugins_worker, 2)):
        for label, result in results.items():
            _check(result, label.split()[-1], f"rank {rank} {label}")
