"""Fp8Linear runs the rowwise and blockwise recipes (issue 26): it calls ``granular_linear``
(same bytes, eager and under ``torch.compile`` without graph breaks), keeps no delayed buffers,
amax groups, shared casts or prequantized weights for them, and caches a frozen weight's
operands. The bug this replaces: a rowwise/blockwise config silently ran as tensorwise."""
from __future__ import annotations

import pytest
import torch

from fp8boost.fp8 import Fp8Config, Fp8Linear, convert_to_fp8
from fp8boost.fp8.casts import TensorwiseCasts
from fp8boost.fp8.granular import RowGroups, granular_linear
from fp8boost.fp8.linear import invalidate_weight_caches

RECIPES = ["rowwise", "rowwise_with_gw_hp", "blockwise", "blockwise_pow2"]


def cfg_of(name: str, **kw) -> Fp8Config:
    return Fp8Config.from_recipe(name, backend="emulated", min_numel=0, **kw)


def outliers(*shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., 3] *= 1000.0  # one outlier channel sets a per-tensor scale
    return x


def layer_and_reference(name, k=200, n=136, dtype=torch.float32):
    torch.manual_seed(0)
    layer = Fp8Linear(k, n, config=cfg_of(name), dtype=dtype)
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    return layer, w, b


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("k, n", [(200, 136), (256, 128)])  # partial tiles; whole blocks
def test_fp8linear_equals_granular_linear(name, k, n):
    layer, w, b = layer_and_reference(name, k, n)
    x = outliers(3, 10, k).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(3, 10, n)
    y = layer(x)
    y.backward(dy)
    y2 = granular_linear(x2.reshape(-1, k), w, b, layer.fp8_config, "emulated")
    y2.backward(dy.reshape(-1, n))
    assert y.shape == (3, 10, n)
    assert torch.equal(y.reshape(-1, n), y2)
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(layer.weight.grad, w.grad) and torch.equal(layer.bias.grad, b.grad)


@pytest.mark.parametrize("name", ["rowwise", "blockwise"])
def test_granular_config_no_longer_runs_as_tensorwise(name):
    """The bug: Fp8Linear ignored the recipe and scaled per tensor."""
    layer, w, b = layer_and_reference(name)
    tensorwise = Fp8Linear(200, 136, config=Fp8Config(backend="emulated", fp8_format="e4m3"))
    tensorwise.load_state_dict(layer.state_dict())
    x = torch.randn(32, 200, generator=torch.Generator().manual_seed(0))
    x[::8] *= 1e5  # a few outlier tokens set the per-tensor scale: the others underflow
    with torch.no_grad():
        y, y_tw = layer(x), tensorwise(x)
        exact = torch.nn.functional.linear(x, layer.weight, layer.bias)
        ref = granular_linear(x, w, b, layer.fp8_config, "emulated")
    assert torch.equal(y, ref) and not torch.equal(y, y_tw)
    # per-row/tile scales keep the ordinary tokens that the per-tensor scale ruins
    def err(a):
        return ((a - exact)[1::8].norm() / exact[1::8].norm()).item()
    assert err(y) < 0.05 < 0.3 < err(y_tw), (err(y), err(y_tw))


@pytest.mark.parametrize("name", RECIPES)
def test_no_tensorwise_machinery_for_granular_recipes(name, monkeypatch):
    from fp8boost.fp8 import shared_cast
    layer, _, _ = layer_and_reference(name)
    assert not any("amax" in n for n, _ in layer.named_buffers())
    assert f"recipe={layer.fp8_config.recipe}" in repr(layer)
    assert ("block_size=128" in repr(layer)) == ("blockwise" in name)
    group = object()
    layer.set_amax_groups({"input": group, "weight": group})
    assert layer.amax_group("input") is None and layer.amax_group("weight") is None
    # rowwise reduces the row amaxes of a row-parallel layer's x and W; blockwise nothing
    rowwise = layer.fp8_config.recipe == "rowwise"
    assert layer.casts.row_groups == (RowGroups(x=group, w=group) if rowwise else None)
    layer.set_amax_groups({"grad": group, "weight": group})
    assert layer.casts.row_groups == (RowGroups(dy=group, wt=group) if rowwise else None)
    if rowwise:
        with pytest.raises(ValueError, match="'input' with it"):
            layer.set_amax_groups({"weight": group})
    layer.set_amax_groups({})
    # rowwise refuses a prequantized weight; blockwise takes one scale per block only
    with pytest.raises(ValueError, match="tensorwise or blockwise" if rowwise
                       else "one inverse scale per 128x128 block"):
        layer.set_prequantized_weight(torch.zeros(136, 200, dtype=torch.float8_e4m3fn),
                                      torch.ones(()))
    # no tensorwise cast at all: two layers reading one tensor share the granular cast
    # (tests/fp8/test_cast_sharing_and_compile.py), which dies with the tensor
    monkeypatch.setattr(TensorwiseCasts, "quantize",
                        lambda *a, **k: pytest.fail("tensorwise cast"))
    other, _, _ = layer_and_reference(name)
    x = outliers(8, 200)
    layer(x), other(x)
    assert shared_cast.holds_cast()
    del x
    assert not shared_cast.holds_cast()


@pytest.mark.parametrize("name", ["rowwise", "blockwise"])
def test_frozen_weight_operands_are_cached_and_exact(name, monkeypatch):
    import fp8boost.fp8.operands as linear_mod
    layer, w, b = layer_and_reference(name)
    layer.weight.requires_grad_(False)
    calls = []
    real = linear_mod.weight_operands
    monkeypatch.setattr(linear_mod, "weight_operands", lambda *a: calls.append(1) or real(*a))
    x = outliers(16, 200)
    for step in range(3):
        xi = x.clone().requires_grad_()
        layer(xi).sum().backward()
    assert len(calls) == 1  # cast once, reused by later steps (forward and dgrad)
    x2 = x.clone().requires_grad_()
    granular_linear(x2, w.detach(), b, layer.fp8_config, "emulated").sum().backward()
    assert torch.equal(xi.grad, x2.grad)
    with torch.no_grad():
        layer.weight.mul_(0.5)  # an in-place write invalidates the cache
    layer(x)
    invalidate_weight_caches(layer)
    layer(x)
    assert len(calls) == 3


def test_conv1d_runs_the_granular_recipe():
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    model = torch.nn.Sequential(Conv1D(144, 208))  # dims divisible by 16, not by 128
    cfg = cfg_of("rowwise")
    w = model[0].weight.detach().t().clone()
    b = model[0].bias.detach().clone()
    convert_to_fp8(model, cfg)
    assert type(model[0]).__name__ == "Fp8Conv1D"
    x = outliers(12, 208)
    with torch.no_grad():
        assert torch.equal(model(x), granular_linear(x, w, b, cfg, "emulated"))
    assert transformers is not None


@pytest.mark.parametrize("name", RECIPES)
def test_compiled_model_traces_without_graph_breaks(name):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = cfg_of(name)
    # full tiles only: torch 2.13's CPU inductor miscompiles partial tiles (granular/quantize.py)
    model = torch.nn.Sequential(Fp8Linear(256, 256, config=cfg), torch.nn.GELU(),
                                Fp8Linear(256, 128, config=cfg))
    x = outliers(32, 256).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y = torch.compile(model, backend="aot_eager")(x)
    y.sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y2 = model(x2)
    y2.sum().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    assert all(torch.equal(a, p.grad) for a, p in zip(eager_grads, model.parameters()))


def test_fp8_carrier_input_is_dequantized_once_with_a_warning():
    """An FP8 carrier (one scale per tensor) reaching a rowwise layer: dequantized, warned
    once, and the layer's output is the one of the plain weight's value (its gradient passes
    through as a plain tensor)."""
    import warnings

    from fp8boost import _state
    from fp8boost.fp8.prequantized import Fp8WeightTensor, dequantize_weight
    from fp8boost.fp8.scaling import amax, cast_to_fp8, scale_from_amax

    _state.reset()
    torch.manual_seed(0)
    layer = Fp8Linear(64, 32, bias=False,
                      config=Fp8Config.from_recipe("rowwise", backend="emulated"))
    w = layer.weight.detach()
    s = scale_from_amax(amax(w), torch.float8_e4m3fn)
    carrier = Fp8WeightTensor(cast_to_fp8(w, s, torch.float8_e4m3fn), s.reciprocal(), w.dtype)
    x = torch.randn(8, 64)
    from fp8boost.fp8.linear_granular import granular_forward

    with pytest.warns(UserWarning, match="dequantizes an FP8 weight"):
        y = granular_forward(x, carrier, None, layer.fp8_config, "emulated")
    ref = granular_forward(x, dequantize_weight(carrier), None, layer.fp8_config, "emulated")
    assert torch.equal(y, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        granular_forward(x, carrier, None, layer.fp8_config, "emulated")  # once
