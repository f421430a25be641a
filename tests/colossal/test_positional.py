"""``fp8boost.colossal``'s Booster and plugins bind positional arguments in Colossal-AI's order
(v0.5.0, commit 4f9953be), while ``fp8boost.plugins`` keeps its own order (issue 25, item 2)."""
from __future__ import annotations

import inspect

import pytest
import torch.distributed as dist

from fp8boost.colossal.booster.plugin import args as native
from fp8boost.booster import Booster as NativeBooster
from fp8boost.colossal.booster import Booster
from fp8boost.colossal.booster import plugin as colossal_plugins
from tests.plugins.test_colossal_args_hybrid import COLOSSAL


def _positional(cls) -> list[str]:
    return [p.name for p in inspect.signature(cls).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD]


@pytest.mark.parametrize("name", sorted(colossal_plugins.ORDERS))
def test_positional_order_is_colossal_ais(name):
    cls = getattr(colossal_plugins, name)
    order = colossal_plugins.ORDERS[name]
    assert _positional(cls) == list(order)
    assert issubclass(cls, getattr(native, name)) and cls.__name__ == name
    native_cls = getattr(native, name)
    if native_cls in COLOSSAL:  # the parity list written from Colossal-AI's source
        assert sorted(order) == sorted(COLOSSAL[native_cls].split())
    # every fp8boost argument is still there, as a keyword
    assert set(inspect.signature(cls).parameters) == set(inspect.signature(native_cls).parameters)


def test_positional_calls_bind_by_colossal_order():
    h = colossal_plugins.HybridParallelPlugin(2, 1, None, "bf16", 1)  # tp, pp, sp, precision, zero
    assert (h.tp_size, h.pp_size, h.precision, h.zero_stage) == (2, 1, "bf16", 1)
    assert isinstance(h, native.HybridParallelPlugin)
    z = colossal_plugins.LowLevelZeroPlugin(2, "bf16", 2.0 ** 16)  # stage, precision, initial_scale
    assert (z.stage, z.precision, z.initial_scale) == (2, "bf16", 2.0 ** 16)
    g = colossal_plugins.GeminiPlugin(None, None, "static", True)  # ..., enable_grad_accumulation
    assert g.allow_no_sync is True
    m = colossal_plugins.MoeHybridParallelPlugin(2, 1, 2, None, "fp32", 1)  # tp, pp, ep, sp, ...
    assert (m.tp_size, m.ep_size, m.precision, m.zero_stage) == (2, 2, "fp32", 1)
    assert isinstance(m, native.MoeHybridParallelPlugin)
    d = colossal_plugins.TorchDDPPlugin(False, 50)  # broadcast_buffers, bucket_cap_mb
    assert isinstance(d, native.TorchDDPPlugin)
    b = Booster("cpu", "bf16")  # device, mixed_precision, plugin
    assert isinstance(b, NativeBooster) and b.plugin is not None
    assert _positional(Booster) == ["device", "mixed_precision", "plugin"]
    with pytest.raises(TypeError, match="multiple values for argument 'tp_size'"):
        colossal_plugins.HybridParallelPlugin(2, tp_size=2)
    with pytest.raises(TypeError, match="at most 7 positional"):
        colossal_plugins.TorchDDPPlugin(*[False] * 8)
    assert not dist.is_initialized()


def test_colossal_defaults_where_the_meaning_differs():
    z = colossal_plugins.LowLevelZeroPlugin()
    assert (z.stage, z.initial_scale) == (1, 2.0 ** 32)  # Colossal-AI's ZeRO-1 and fp16 scale
    assert native.LowLevelZeroPlugin().stage == 2  # fp8boost's own default is unchanged
    assert colossal_plugins.LowLevelZeroPlugin(stage=2).stage == 2
    sig = inspect.signature(colossal_plugins.LowLevelZeroPlugin).parameters
    assert sig["stage"].default == 1 and sig["precision"].default == "bf16"


def test_save_model_defaults_to_one_file_as_colossal_ai(tmp_path):
    """Colossal-AI's ``save_model(model, "model.pt")`` (``shard=False`` by default) writes that
    one file; fp8boost's own Booster keeps sharding into a folder by default (issue 37)."""
    import torch

    assert inspect.signature(Booster.save_model).parameters["shard"].default is False
    assert inspect.signature(NativeBooster.save_model).parameters["shard"].default is True
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    colossal = Booster(device="cpu")  # Colossal-AI's positional order starts with device
    boosted, *_ = colossal.boost(model)
    colossal.save_model(boosted, str(tmp_path / "model.pt"))
    assert (tmp_path / "model.pt").is_file()
    NativeBooster(device="cpu").save_model(boosted, str(tmp_path / "native.pt"))
    assert (tmp_path / "native.pt").is_dir()
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    again, *_ = Booster(device="cpu").boost(fresh)
    colossal.load_model(again, str(tmp_path / "model.pt"))
    for a, b in zip(boosted.parameters(), again.parameters()):
        assert torch.equal(a, b)
