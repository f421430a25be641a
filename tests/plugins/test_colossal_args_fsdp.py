"""Issue 25 item 2: TorchFSDPPlugin takes Colossal-AI's FSDP1 objects (mapped onto FSDP2)."""
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy

from fp8boost import _state
from fp8boost.colossal.booster.plugin.args import TorchFSDPPlugin
from fp8boost.parallel.fsdp.wiring import apply_param_init_fn

LOGGER = "fp8boost.plugins"


@pytest.fixture(autouse=True)
def _fresh_log_keys():
    for name in ("reduce_dtype", "buffer_dtype", "auto_wrap_policy", "backward_prefetch",
                 "forward_prefetch", "limit_all_gathers", "use_orig_params", "device_id"):
        _state.forget_logged(f"colossal-args.torch_fsdp.{name}")
    yield


def _infos(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.INFO]


@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, "bf16"), (torch.float16, "fp16"),
                                              (torch.float32, "fp32"), (None, "fp32")])
def test_mixed_precision_maps_to_precision(dtype, precision):
    plugin = TorchFSDPPlugin(mixed_precision=MixedPrecision(param_dtype=dtype))
    assert plugin.precision == precision
    assert not dist.is_initialized()


def test_reduce_dtype_is_said_once(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    TorchFSDPPlugin(mixed_precision=mp)
    TorchFSDPPlugin(mixed_precision=mp)
    (line,) = _infos(caplog)
    assert "reduce_dtype" in line and "FP32" in line


def test_cpu_offload_and_sharding_strategy_map():
    assert TorchFSDPPlugin(cpu_offload=CPUOffload(offload_params=True)).cpu_offload is True
    assert TorchFSDPPlugin(cpu_offload=CPUOffload(offload_params=False)).cpu_offload is False
    assert TorchFSDPPlugin(cpu_offload=True).cpu_offload is True
    assert TorchFSDPPlugin(sharding_strategy=ShardingStrategy.FULL_SHARD).reshard_after_forward
    assert not TorchFSDPPlugin(
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP).reshard_after_forward


@pytest.mark.parametrize("kwargs, match", [
    (dict(sharding_strategy=ShardingStrategy.NO_SHARD), "TorchDDPPlugin"),
    (dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD), "HybridParallelPlugin"),
    (dict(ignored_modules=[nn.Linear(1, 1)]), "ignored_modules=None"),
    (dict(precision="fp16", mixed_precision=MixedPrecision(param_dtype=torch.float32)),
     "pass one"),
    (dict(reshard_after_forward=False, sharding_strategy=ShardingStrategy.FULL_SHARD),
     "SHARD_GRAD_OP"),
])
def test_unsupported_values_raise_naming_the_alternative(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TorchFSDPPlugin(**kwargs)
    assert not dist.is_initialized()


@pytest.mark.parametrize("kwargs, words", [
    (dict(auto_wrap_policy=lambda *a, **k: True), "each decoder block"),
    (dict(backward_prefetch=object()), "prefetches"),
    (dict(forward_prefetch=True), "prefetches"),
    (dict(limit_all_gathers=False), "stream"),
    (dict(use_orig_params=True), "original parameters"),
    (dict(device_id=0), "Booster"),
])
def test_fsdp1_tuning_logs_once(caplog, kwargs, words):
    caplog.set_level(logging.INFO, logger=LOGGER)
    TorchFSDPPlugin(**kwargs)
    TorchFSDPPlugin(**kwargs)
    (line,) = _infos(caplog)
    assert words in line, line


@pytest.mark.parametrize("kwargs", [dict(mixed_precision="bf16"), dict(cpu_offload="yes"),
                                    dict(sharding_strategy="FULL_SHARD"),
                                    dict(param_init_fn=3), dict(forward_prefetch=1)])
def test_wrong_types_raise_type_error(kwargs):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        TorchFSDPPlugin(**kwargs)


def test_param_init_fn_materialises_meta_modules():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    seen = []

    def init(mod):
        seen.append(type(mod).__name__)
        mod.to_empty(device="cpu", recurse=False)
        for p in mod.parameters(recurse=False):
            nn.init.constant_(p, 0.5)

    plugin = TorchFSDPPlugin(param_init_fn=init)
    apply_param_init_fn(model, plugin.param_init_fn)
    assert seen == ["Linear", "Linear"]
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters())
    with torch.device("meta"):
        lazy = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device"):
        apply_param_init_fn(lazy, lambda m: None)
