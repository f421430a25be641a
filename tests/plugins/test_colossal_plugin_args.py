"""Issue 25, item 2: GeminiPlugin takes Colossal-AI's own keyword arguments (single process,
no collectives: constructing the plugin is enough)."""
import logging
from collections import namedtuple

import pytest
import torch
import torch.distributed as dist

from fp8boost import _state
from fp8boost.colossal.booster.plugin.args import GeminiPlugin
from fp8boost.colossal.booster.plugin.args.gemini import GEMINI_ARGS, outputs_fp32_hook

LOGGER = "fp8boost.plugins"
NAMES = list(GEMINI_ARGS)
KEYS = NAMES + ["loss-scale"]
#: Colossal-AI v0.5.0's defaults of the arguments added last (commit 4f9953be)
DEFAULTS = dict(chunk_config_dict=None, chunk_init_device=None, steady_cuda_cap_ratio=0.9,
                master_weights=True, pin_memory=False, force_outputs_fp32=False,
                strict_ddp_mode=False, search_range_m=32, hidden_dim=None, min_chunk_size_m=32,
                memstats=None, gpu_margin_mem_ratio=0.0, min_scale=1, growth_factor=2,
                backoff_factor=0.5, hysteresis=2, max_scale=2 ** 32,
                enable_all_optimization=False, enable_sequence_parallelism=False,
                enable_jit_fused=False, verbose=False)


@pytest.fixture(autouse=True)
def _fresh_log_keys():
    for name in KEYS:
        _state.forget_logged(f"colossal-args.gemini.{name}")
    yield
    for name in KEYS:
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
    GeminiPlugin(**DEFAULTS)
    assert _infos(caplog) == []
    assert not dist.is_initialized()


@pytest.mark.parametrize("kwargs, words", [
    (dict(placement_policy="auto"), ["offload_optim_frac", "offload_param_frac"]),
    (dict(max_prefetch=2), ["FSDP2 prefetches the next block"]),
    (dict(enable_async_reduce=False), ["reduce-scatter", "overlaps backward"]),
    (dict(warmup_non_model_data_ratio=0.5), ["offload fractions"]),
    # enable_fused_normalization maps onto fused_norm, no INFO line
    # (test_colossal_args_hybrid.py::test_fused_normalization_maps_onto_fused_norm)
    (dict(enable_flash_attention=True), ["model's own attention", "SDPA"]),
    (dict(chunk_config_dict={"x": 1}), ["no chunks", "FSDP2"]),
    (dict(chunk_init_device=torch.device("cpu")), ["current device"]),
    (dict(steady_cuda_cap_ratio=0.5), ["auto placement", "offload fractions"]),
    (dict(pin_memory=True), ["CPUOffloadPolicy pins"]),
    (dict(strict_ddp_mode=True), ["data-parallel only"]),
    (dict(search_range_m=64), ["no chunks"]),
    (dict(hidden_dim=4096), ["no chunks"]),
    (dict(min_chunk_size_m=8), ["no chunks"]),
    (dict(memstats=object()), ["auto placement"]),
    (dict(gpu_margin_mem_ratio=0.5), ["hybrid CPU/GPU optimizer"]),
    (dict(enable_all_optimization=True), ["fused_norm=True", "model's own modules"]),
    (dict(enable_jit_fused=True), ["model's own modules"]),
    (dict(enable_sequence_parallelism=True),
     ["tp_size=1", "HybridParallelPlugin(tp_size=..., enable_sequence_parallelism=True)"]),
    (dict(verbose=True), ["'fp8boost' loggers"]),
    # under fp16 even Colossal-AI's default hysteresis=2 is said once (as for the others)
    (dict(precision="fp16", hysteresis=2), ["every overflow"]),
    (dict(precision="bf16", growth_factor=4), ["precision='fp16'"]),
])
def test_tuning_arguments_log_one_info_line_once(caplog, kwargs, words):
    caplog.set_level(logging.INFO, logger=LOGGER)
    GeminiPlugin(**kwargs)
    GeminiPlugin(**kwargs)  # once per process
    (line,) = _infos(caplog)
    name = [n for n in kwargs if n != "precision"][0]
    assert name in line and all(w in line for w in words), line
    key = "loss-scale" if kwargs.get("precision") == "bf16" else name
    assert _state.was_logged(f"colossal-args.gemini.{key}")
    assert not dist.is_initialized()


def test_master_weights_false_names_low_level_zero():
    with pytest.raises(ValueError, match=r"LowLevelZeroPlugin\(master_weights=False\)"):
        GeminiPlugin(master_weights=False)
    assert not dist.is_initialized()


def test_loss_scaling_arguments_are_mapped():
    plugin = GeminiPlugin(precision="fp16", min_scale=2, growth_factor=4, backoff_factor=0.25,
                          hysteresis=1, max_scale=2 ** 20)
    assert plugin.loss_scale_kwargs == dict(min_scale=2.0, growth_factor=4.0,
                                            backoff_factor=0.25, max_scale=2.0 ** 20)
    assert GeminiPlugin(precision="bf16", growth_factor=4).loss_scale_kwargs == {}
    assert not dist.is_initialized()


def test_force_outputs_fp32_is_mapped_and_casts_floating_outputs():
    assert GeminiPlugin(force_outputs_fp32=True).force_outputs_fp32
    assert not GeminiPlugin().force_outputs_fp32
    pair = namedtuple("Pair", "a b")
    bf16, ids = torch.ones(2, dtype=torch.bfloat16), torch.arange(2)
    out = outputs_fp32_hook(None, (), {"logits": bf16, "rest": [pair(bf16, ids), (bf16,)]})
    assert out["logits"].dtype == torch.float32
    assert isinstance(out["rest"][0], pair) and out["rest"][0].a.dtype == torch.float32
    assert out["rest"][0].b.dtype == torch.int64 and out["rest"][1][0].dtype == torch.float32
    assert outputs_fp32_hook(None, (), bf16).dtype == torch.float32


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
    dict(tp_size=0), dict(extra_dp_size=0), dict(steady_cuda_cap_ratio=1.5),
    dict(gpu_margin_mem_ratio=-0.1), dict(search_range_m=-1), dict(hidden_dim=0),
    dict(min_chunk_size_m=-1), dict(growth_factor=1.0), dict(hysteresis=0)])
def test_bad_values_raise_value_error(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        GeminiPlugin(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(shard_param_frac="1.0"), dict(shard_param_frac=True), dict(placement_policy=None),
    dict(max_prefetch=1.5), dict(max_prefetch=True), dict(enable_async_reduce=1),
    dict(warmup_non_model_data_ratio="0.8"), dict(enable_fused_normalization="yes"),
    dict(enable_flash_attention=None), dict(tp_size=2.0), dict(extra_dp_size=False),
    dict(chunk_config_dict=[1]), dict(chunk_init_device=0), dict(steady_cuda_cap_ratio="0.9"),
    dict(master_weights=1), dict(pin_memory=None), dict(force_outputs_fp32="yes"),
    dict(strict_ddp_mode=0), dict(search_range_m=32.0), dict(hidden_dim=1024.0),
    dict(min_chunk_size_m=None), dict(gpu_margin_mem_ratio=True), dict(min_scale="1"),
    dict(hysteresis=2.0), dict(enable_all_optimization=None),
    dict(enable_sequence_parallelism=1), dict(enable_jit_fused="no"), dict(verbose=None)])
def test_wrong_types_raise_type_error(kwargs):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        GeminiPlugin(**kwargs)


def test_keyword_only():
    import inspect
    params = inspect.signature(GeminiPlugin).parameters
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in NAMES)
