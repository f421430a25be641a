"""``fp8boost.colossal.zero``: ``isinstance(optimizer, LowLevelZeroOptimizer)`` holds for what the
ZeRO-1/2 boosts return (``LowLevelZeroPlugin``; ``HybridParallelPlugin`` /
``MoeHybridParallelPlugin`` at ``zero_stage`` 1 or 2) and for nothing else (one replica's master
weights under ``Booster(mixed_precision=...)`` or DDP, ``zero_stage=0``, Gemini, FSDP), as in
Colossal-AI; ``GeminiDDP`` / ``GeminiOptimizer`` likewise for what ``GeminiPlugin`` boosts;
Colossal-AI's ``colossalai.zero`` names import, and those fp8boost does not build directly
raise naming the ``Booster`` call.

One process: each boost starts fp8boost's one-process gloo group; the fixture destroys it.
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from tests.plugins import helpers as H

# colossalai/zero/__init__.py's __all__ at Colossal-AI v0.5.0 (4f9953be)
UPSTREAM_ALL = ["GeminiDDP", "GeminiOptimizer", "GeminiAdamOptimizer", "zero_model_wrapper",
                "zero_optim_wrapper", "LowLevelZeroOptimizer", "get_static_torch_model"]


def _boost(plugin_name: str, **kwargs):
    from fp8boost.colossal.booster import Booster
    from fp8boost.colossal.booster import plugin as plugins

    booster = Booster(plugin=getattr(plugins, plugin_name)(**kwargs))
    if plugin_name == "MoeHybridParallelPlugin":
        from tests.plugins.test_moe_plugin import tiny
        model = tiny("mixtral")
    else:
        model = H.make_mlp()
    model, opt, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    return booster, model, opt


# (plugin, kwargs, is a LowLevelZeroOptimizer): Colossal-AI v0.5.0's answer for each
CASES = [
    ("LowLevelZeroPlugin", dict(stage=1, precision="fp32"), True),
    ("LowLevelZeroPlugin", dict(stage=2, precision="bf16"), True),
    ("HybridParallelPlugin", dict(tp_size=1, zero_stage=1, precision="fp32"), True),
    ("HybridParallelPlugin", dict(tp_size=1, zero_stage=2, precision="bf16"), True),
    ("HybridParallelPlugin", dict(tp_size=1, zero_stage=0, precision="bf16"), False),
    ("MoeHybridParallelPlugin", dict(ep_size=1, zero_stage=1, precision="fp32"), True),
    ("MoeHybridParallelPlugin", dict(ep_size=1, zero_stage=0, precision="fp32"), False),
    ("TorchDDPPlugin", dict(precision="bf16"), False),  # a ZeroOptimizer of one replica
    ("GeminiPlugin", dict(precision="fp32"), False),
    ("TorchFSDPPlugin", {}, False),
]


@pytest.mark.parametrize("plugin_name,kwargs,expected", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_low_level_zero_optimizer_is_what_zero_1_2_boosts(group, plugin_name, kwargs, expected):
    from fp8boost.colossal.interface import OptimizerWrapper
    from fp8boost.colossal.zero import GeminiDDP, GeminiOptimizer, LowLevelZeroOptimizer

    booster, model, opt = _boost(plugin_name, **kwargs)
    assert isinstance(opt, LowLevelZeroOptimizer) is expected, type(opt)
    assert isinstance(opt, OptimizerWrapper)
    gemini = plugin_name == "GeminiPlugin"
    assert isinstance(opt, GeminiOptimizer) is gemini and isinstance(model, GeminiDDP) is gemini
    if expected:  # the class it answers for trains: ZeroOptimizer's (and Colossal-AI's) methods
        if plugin_name == "MoeHybridParallelPlugin":
            from tests.plugins.test_moe_plugin import batch
            loss = model(input_ids=batch(0), labels=batch(0)).loss
        else:
            x, y = H.global_batch(0)
            loss = F.mse_loss(model(x).float(), y)
        booster.backward(loss, opt)
        assert opt.clip_grad_by_norm(1.0) > 0
        opt.step()
        opt.zero_grad()
        assert isinstance(opt, LowLevelZeroOptimizer)
        assert opt.working_to_master_param  # ZeRO's map, as Colossal-AI's optimizer has


def test_gemini_optimizer_answers_through_its_model(group):
    """GeminiOptimizer is told from TorchFSDP's optimizer (the same class) by the model it was
    boosted with: once that model is gone, it no longer answers."""
    from fp8boost.colossal.zero import GeminiOptimizer

    _, model, opt = _boost("GeminiPlugin", precision="fp32")
    assert isinstance(opt, GeminiOptimizer)
    del model
    gc.collect()
    assert not isinstance(opt, GeminiOptimizer)


def test_one_replica_master_weights_are_not_low_level_zero():
    from fp8boost.booster import Booster
    from fp8boost.colossal.zero import LowLevelZeroOptimizer
    from fp8boost.parallel.zero import ZeroOptimizer

    model = H.make_mlp()
    _, opt, *_ = Booster(mixed_precision="bf16", device="cpu").boost(
        model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(opt, ZeroOptimizer) and not isinstance(opt, LowLevelZeroOptimizer)
    assert not isinstance(torch.optim.SGD(model.parameters(), lr=0.1), LowLevelZeroOptimizer)


def test_module_paths_and_classes():
    import fp8boost.colossal as colossalai
    from fp8boost.colossal import zero
    from fp8boost.colossal.interface import ModelWrapper, OptimizerWrapper
    from fp8boost.colossal.zero.gemini import GeminiDDP, GeminiOptimizer
    from fp8boost.colossal.zero.low_level import LowLevelZeroOptimizer
    from fp8boost.colossal.zero.low_level.low_level_optim import LowLevelZeroOptimizer as deep
    from fp8boost.parallel.zero import ZeroOptimizer

    assert sorted(zero.__all__) == sorted(UPSTREAM_ALL)
    assert all(hasattr(zero, name) for name in UPSTREAM_ALL)
    assert colossalai.zero is zero and "zero" in dir(colossalai)
    assert zero.LowLevelZeroOptimizer is LowLevelZeroOptimizer is deep
    assert zero.GeminiDDP is GeminiDDP and zero.GeminiOptimizer is GeminiOptimizer
    # Colossal-AI's hierarchy: both optimizers are OptimizerWrappers, GeminiDDP a ModelWrapper
    assert issubclass(LowLevelZeroOptimizer, OptimizerWrapper)
    assert issubclass(GeminiOptimizer, OptimizerWrapper) and issubclass(GeminiDDP, ModelWrapper)
    assert issubclass(zero.GeminiAdamOptimizer, GeminiOptimizer)
    # not every ZeroOptimizer is ZeRO-1/2 over dp ranks
    assert not issubclass(ZeroOptimizer, LowLevelZeroOptimizer)


def test_direct_construction_is_refused_naming_the_booster_call():
    from fp8boost.colossal import zero

    layer = torch.nn.Linear(2, 2)
    optim = torch.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"LowLevelZeroPlugin\(stage=1 or 2\)"):
        zero.LowLevelZeroOptimizer(optim, overlap_communication=True, initial_scale=128)
    with pytest.raises(TypeError, match="booster.boost.*GeminiPlugin"):
        zero.GeminiDDP(layer, pin_memory=True)
    with pytest.raises(TypeError, match="GeminiOptimizer is built by booster.boost"):
        zero.GeminiOptimizer(optim, layer, initial_scale=2 ** 14)
    with pytest.raises(TypeError, match="GeminiAdamOptimizer is built by booster.boost"):
        zero.GeminiAdamOptimizer(layer, lr=1e-3)
    with pytest.raises(NotImplementedError, match="LowLevelZeroPlugin.*GeminiPlugin"):
        zero.zero_model_wrapper(layer, zero_stage=2)
    with pytest.raises(NotImplementedError, match="LowLevelZeroPlugin.*GeminiPlugin"):
        zero.zero_optim_wrapper(layer, optim, initial_scale=2 ** 5)
    with pytest.raises(NotImplementedError, match="booster.save_model"):
        zero.get_static_torch_model(layer)


@pytest.mark.parametrize("module", ["fp8boost.colossal.zero",
                                    "fp8boost.colossal.zero.low_level.low_level_optim",
                                    "fp8boost.colossal.zero.gemini",
                                    "fp8boost.colossal.zero.wrapper"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted and result.failed == 0
