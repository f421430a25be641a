"""Issue 25, item 2: GeminiPlugin takes Colossal-AI's own keyword arguments (single process,
no collectives: constructing the plugin is enough)."""
import logging

import pytest
import torch.distributed as dist

from fp8boost import _state
from fp8boost.plugins import GeminiPlugin

LOGGER = "fp8boost.plugins"
NAMES = ["shard_param_frac", "placement_policy", "max_prefetch", "enable_async_reduce",
         "warmup_non_model_data_ratio", "enable_fused_normalization", "enable_flash_attention",
         "tp_size", "extra_dp_size"]


@pytest.fixture(autouse=True)
def _fresh_log_keys():
    for name in NAMES:
        _state.forget_logged(f"colossal-args.gemini.{name}")
    yield
    for name in NAMES:
        _state.forget_logged(f"colossal-args.gemini.{name}")


def _infos(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.INFO]


def test_defaults_are_accepted_silently(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    GeminiPlugin(shard_param_frac=1.0, placement_policy="static", max_prefetch=0,
                 enable_async_reduce=True, warmup_non_model_data_ratio=0.8,
                 enable_fused_normalization=False, enable_flash_attention=False, tp_size=1,
                 extra_dp_size=1)
    GeminiPlugin(shard_param_frac=1)  # an int 1 is 1.0
    assert _infos(caplog) == []
    assert not dist.is_initialized()


@pytest.mark.parametrize("kwargs, words", [
    (dict(placement_policy="auto"), ["offload_optim_frac", "offload_param_frac"]),
    (dict(max_prefetch=2), ["FSDP2 prefetches the next block"]),
    (dict(enable_async_reduce=False), ["reduce-scatter", "overlaps backward"]),
    (dict(warmup_non_model_data_ratio=0.5), ["offload fractions"]),
    (dict(enable_fused_normalization=True), ["model's own normalization"]),
    (dict(enable_flash_attention=True), ["model's own attention", "SDPA"]),
])
def test_tuning_arguments_log_one_info_line_once(caplog, kwargs, words):
    caplog.set_level(logging.INFO, logger=LOGGER)
    GeminiPlugin(**kwargs)
    GeminiPlugin(**kwargs)  # once per process
    (line,) = _infos(caplog)
    name = next(iter(kwargs))
    assert name in line and all(w in line for w in words), line
    assert _state.was_logged(f"colossal-args.gemini.{name}")


def test_placement_auto_keeps_the_offload_mapping():
    plugin = GeminiPlugin(placement_policy="auto", offload_optim_frac=1.0, offload_param_frac=1.0)
    assert plugin.cpu_offload
    assert not GeminiPlugin(placement_policy="auto").cpu_offload


@pytest.mark.parametrize("frac", [0.0, 0.5, 0.99])
def test_partial_sharding_names_the_alternatives(frac):
    with pytest.raises(ValueError, match="shard_param_frac") as err:
        GeminiPlugin(shard_param_frac=frac)
    assert "LowLevelZeroPlugin" in str(err.value) and "shard_param_frac=1.0" in str(err.value)


@pytest.mark.parametrize("kwargs", [dict(tp_size=2), dict(extra_dp_size=2),
                                    dict(tp_size=2, extra_dp_size=4)])
def test_tp_and_extra_dp_name_hybrid_parallel_plugin(kwargs):
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"HybridParallelPlugin\(tp_size=\.\.\., zero_stage=\.\.\.\)"):
        GeminiPlugin(**kwargs)
    assert not dist.is_initialized()  # raised in __init__, before any collective


@pytest.mark.parametrize("kwargs", [
    dict(placement_policy="cuda"), dict(max_prefetch=-1), dict(warmup_non_model_data_ratio=2.0),
    dict(tp_size=0), dict(extra_dp_size=0)])
def test_bad_values_raise_value_error(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        GeminiPlugin(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(shard_param_frac="1.0"), dict(shard_param_frac=True), dict(placement_policy=None),
    dict(max_prefetch=1.5), dict(max_prefetch=True), dict(enable_async_reduce=1),
    dict(warmup_non_model_data_ratio="0.8"), dict(enable_fused_normalization="yes"),
    dict(enable_flash_attention=None), dict(tp_size=2.0), dict(extra_dp_size=False)])
def test_wrong_types_raise_type_error(kwargs):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        GeminiPlugin(**kwargs)


def test_keyword_only():
    import inspect
    params = inspect.signature(GeminiPlugin).parameters
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in NAMES)
