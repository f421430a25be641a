"""The communication plan (issue 36 item 4): decided once after conversion, read by the engines.

What goes FP8 and why not, per plugin configuration (``build_comm_plan`` needs no process
group); ``plugin.comm_report`` is the plan's report; a plugin hands its engines the plan it
built instead of re-deriving from its flags.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fp8boost.fp8 import Fp8Config, convert_to_fp8
from fp8boost.parallel.comm.config import Fp8CommConfig
from fp8boost.parallel.comm.plan import (FP8_RS_REASON, GRAD_RS_WHY, OFF, CommPlan, CommRoute,
                                         build_comm_plan)
from fp8boost.parallel.comm.report import CommReport
from fp8boost.parallel.mesh import ParallelDims


def _opts(fc=True, frs=False, cfg=None):
    return SimpleNamespace(fp8_communication=fc, fp8_reduce_scatter=frs, comm_config=cfg)


def _model(recipe: str = "tensorwise", fp8: bool = True) -> nn.Module:
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    if fp8:
        cfg = Fp8Config.from_recipe(recipe) if recipe != "tensorwise" else Fp8Config()
        convert_to_fp8(model, dataclasses.replace(cfg, min_numel=0, backend="emulated"))
    return model


DP2 = ParallelDims(dp=2, world_size=2)


def test_off_everywhere_says_why():
    plan = build_comm_plan(_model(), _opts(fc=False), DP2, engine="zero", where="T")
    for f in ("param_all_gather", "grad_reduce", "tp_activations", "sp_all_to_all",
              "pipeline_p2p", "ep_dispatch"):
        route = getattr(plan, f)
        assert not route.fp8 and route.why_not == OFF, (f, route)
    assert plan.fp8_gather_modules == () and not plan.requested


def test_zero_gathers_fp8_layers_and_keeps_gradients():
    plan = build_comm_plan(_model(), _opts(), DP2, engine="zero", where="LowLevelZeroPlugin",
                           param_gather="fp8_linear")
    assert plan.param_all_gather == CommRoute(fp8=True, why_not="")
    assert plan.fp8_gather_modules == ("0", "2")
    assert not plan.grad_reduce.fp8 and plan.grad_reduce.why_not == GRAD_RS_WHY
    report = plan.report()
    assert report.fp8_param_all_gather and not report.fp8_grad_reduce
    assert report.fp8_all_gather_modules == []  # ZeRO gathers flat buckets
    assert "fp8_reduce_scatter=True" in report.why_not["grad_reduce"]
    both = build_comm_plan(_model(), _opts(frs=True), DP2, engine="zero", where="T")
    assert both.grad_reduce.fp8 and both.report().why_not == {}


@pytest.mark.parametrize("choice, fp8, modules", [("all", True, None), ("none", False, ())])
def test_zero_param_gather_choices(choice, fp8, modules):
    plan = build_comm_plan(_model(), _opts(), DP2, engine="zero", where="T", param_gather=choice)
    assert plan.param_all_gather.fp8 is fp8 and plan.fp8_gather_modules == modules
    model = _model()
    params = plan.fp8_gather_params(model)
    assert params is None if choice == "all" else params == []


@pytest.mark.parametrize("dims, stage, why", [
    (ParallelDims(), 2, "one data-parallel rank"),
    (DP2, 0, "zero_stage=0")])
def test_zero_nothing_to_gather(dims, stage, why):
    plan = build_comm_plan(_model(), _opts(), dims, engine="zero", where="T", zero_stage=stage)
    assert not plan.param_all_gather.fp8 and why in plan.param_all_gather.why_not


def test_zero_without_fp8_layers_warns_with_the_way_out():
    with pytest.warns(UserWarning, match="fp8_param_gather='all'"):
        plan = build_comm_plan(_model(fp8=False), _opts(), DP2, engine="zero",
                               where="LowLevelZeroPlugin", param_gather="fp8_linear")
    assert not plan.param_all_gather.fp8 and "no Fp8Linear" in plan.param_all_gather.why_not


@pytest.mark.filterwarnings("ignore:fp8boost GeminiPlugin")
def test_rowwise_weights_stay_in_the_training_dtype():
    plan = build_comm_plan(_model("rowwise"), _opts(), DP2, engine="fsdp", where="GeminiPlugin")
    assert not plan.param_all_gather.fp8 and plan.fp8_gather_modules == ()
    assert "rowwise/blockwise" in plan.param_all_gather.why_not


@pytest.mark.filterwarnings("ignore:fp8boost T")
def test_blockwise_rows_after_the_tp_split_decide():
    # [256, 128] colwise over tp=2 leaves 128 rows: 2 ZeRO ranks would split a 128-row block
    model, dims = _model("blockwise"), ParallelDims(dp=2, tp=2, world_size=4)
    cut = build_comm_plan(model, _opts(), dims, engine="zero", where="T", tp_colwise=("0",))
    whole = build_comm_plan(model, _opts(), dims, engine="zero", where="T")
    assert "0" not in cut.fp8_gather_modules and "0" in whole.fp8_gather_modules


def test_fsdp_names_the_gathered_weights_and_its_reduce_scatter():
    plan = build_comm_plan(_model(), _opts(), DP2, engine="fsdp", where="GeminiPlugin")
    report = plan.report()
    assert report.fp8_all_gather_modules == ["0.weight", "2.weight"]
    assert report.why_not == {"grad_reduce": FP8_RS_REASON}
    off = build_comm_plan(_model(fp8=False), _opts(), DP2, engine="fsdp", where="GeminiPlugin")
    assert "no Fp8Linear" in off.report().why_not["param_all_gather"]


def test_ddp_hook_and_nothing_to_gather():
    on = build_comm_plan(_model(), _opts(), DP2, engine="ddp", where="TorchDDPPlugin")
    off = build_comm_plan(_model(), _opts(fc=False), DP2, engine="ddp", where="TorchDDPPlugin")
    assert on.grad_reduce.fp8 and not off.grad_reduce.fp8
    assert "DDP replicates" in on.param_all_gather.why_not == off.param_all_gather.why_not


def test_hybrid_and_moe_routes():
    dims = ParallelDims(dp=2, pp=2, tp=2, sp=2, world_size=16)
    sg = build_comm_plan(_model(), _opts(), dims, engine="zero", where="T",
                         sequence_parallel="split_gather")
    assert sg.tp_activations.fp8 and sg.sp_all_to_all.fp8 and sg.pipeline_p2p.fp8
    assert not sg.ep_dispatch.fp8 and "expert" in sg.ep_dispatch.why_not
    no_sp = build_comm_plan(_model(), _opts(), dims, engine="zero", where="T")
    assert not no_sp.tp_activations.fp8 and "split_gather" in no_sp.tp_activations.why_not
    moe = build_comm_plan(_model(), _opts(), ParallelDims(dp=2, ep=2, world_size=2),
                          engine="moe", where="MoeHybridParallelPlugin")
    assert moe.ep_dispatch.fp8 and not moe.param_all_gather.fp8 and not moe.grad_reduce.fp8
    assert not moe.pipeline_p2p.fp8 and "pp_size=1" in moe.pipeline_p2p.why_not


@pytest.mark.parametrize("kwargs, err", [
    (dict(engine="gemini"), ValueError), (dict(param_gather="some"), ValueError)])
def test_bad_input_raises_before_anything(kwargs, err):
    kw = {"engine": "zero", "where": "T", **kwargs}
    with pytest.raises(err):
        build_comm_plan(_model(), _opts(), DP2, **kw)
    with pytest.raises(ValueError, match="needs fp8_communication"):
        build_comm_plan(_model(), _opts(fc=False, frs=True), DP2, engine="zero", where="T")
    with pytest.raises(TypeError, match="comm_config"):
        build_comm_plan(_model(), _opts(cfg="fp8"), DP2, engine="zero", where="T")
    with pytest.raises(TypeError, match="options"):
        build_comm_plan(_model(), object(), DP2, engine="zero", where="T")


def test_plan_is_frozen_and_checked():
    plan = CommPlan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.requested = True
    with pytest.raises(ValueError, match="must say why"):
        CommRoute(fp8=False, why_not="")
    with pytest.raises(TypeError):
        CommPlan(grad_reduce=True)
    with pytest.raises(TypeError):
        CommPlan(config="fp8")
    assert isinstance(plan.report(), CommReport)


def test_the_plugin_hands_its_engines_the_plan(monkeypatch):
    """A plugin's comm_report and its ZeRO optimizer follow the plan it built, not its flags:
    a plan that says "gradients in FP8" although the options do not reaches the optimizer."""
    import torch.distributed as dist

    from fp8boost.booster import Booster
    from fp8boost.plugins import LowLevelZeroPlugin

    forced = CommPlan(requested=True, engine="zero", config=Fp8CommConfig(min_payload_numel=0),
                      grad_reduce=CommRoute(fp8=True, why_not=""))
    monkeypatch.setattr(LowLevelZeroPlugin, "plan_comm", lambda self, model: forced)
    plugin = LowLevelZeroPlugin(stage=2, use_fp8=True, fp8_communication=False)
    model = nn.Sequential(nn.Linear(32, 32))
    try:
        model, opt, *_ = Booster(plugin=plugin, device="cpu").boost(
            model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert plugin.comm_plan is forced and opt.comm_plan is forced
        assert plugin.comm_report.fp8_grad_reduce  # derived from the plan, not the options
        assert not any(opt.fp8_gather_mask)
    finally:  # boost started a one-process group: later tests check that none is left
        if dist.is_initialized():
            dist.destroy_process_group()


def test_comm_report_before_boost_is_empty():
    from fp8boost.plugins import GeminiPlugin
    plugin = GeminiPlugin(fp8_communication=True)
    assert plugin.comm_plan is None and plugin.comm_report.why_not == {}
    assert torch.float8_e4m3fn == Fp8CommConfig().param_dtype
