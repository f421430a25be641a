"""Issue 24 items 1-2: the options every plugin shares are declared once (``PluginOptions``) and
reach every plugin's public signature; ``configure`` is one skeleton.

The signatures below were snapshotted before the shared options moved out of the plugins
(commit dd8464b): the positional parameters, in order, and the keyword-only ones, with their
defaults. The move must not change them.
"""
from __future__ import annotations

import dataclasses
import inspect
import pydoc

import pytest

from fp8boost.colossal.booster.plugin.args import (GeminiPlugin, HybridParallelPlugin,
                                                   LowLevelZeroPlugin, TorchDDPPlugin,
                                                   TorchFSDPPlugin)
from fp8boost.plugins import Plugin
from fp8boost.plugins.options import PluginOptions

PLUGINS = [TorchDDPPlugin, LowLevelZeroPlugin, GeminiPlugin, TorchFSDPPlugin, HybridParallelPlugin]

#: {plugin: (positional (name, default) in order, {keyword-only name: default})} before the move
BEFORE = {
    "TorchDDPPlugin": (
        (("use_fp8", False), ("fp8_communication", False)),
        {"precision": None, "max_norm": 0.0, "broadcast_buffers": True, "bucket_cap_mb": 25,
         "find_unused_parameters": False, "gradient_as_bucket_view": True,
         "static_graph": False, "fp8_config": None, "comm_config": None,
         "check_reduction": False}),
    "LowLevelZeroPlugin": (
        (("stage", 2), ("precision", "bf16"), ("use_fp8", False), ("fp8_communication", False)),
        {"overlap_communication": True, "reduce_bucket_size_in_m": None, "max_norm": 0.0,
         "cpu_offload": False, "master_weights": True, "initial_scale": 65536.0,
         "growth_interval": 1000, "fp8_config": None, "comm_config": None,
         "fp8_param_gather": "fp8_linear", "fp8_reduce_scatter": False,
         "norm_type": 2.0, "min_scale": 1, "growth_factor": 2, "backoff_factor": 0.5,
         "hysteresis": 2, "max_scale": 2 ** 32, "communication_dtype": None,
         "overlap_allgather": False, "verbose": False, "cast_inputs": True, "extra_dp_size": 1}),
    "GeminiPlugin": (
        (("precision", "bf16"), ("max_norm", 0.0), ("norm_type", 2.0)),
        {"offload_optim_frac": 0.0, "offload_param_frac": 0.0,
         "enable_gradient_accumulation": False, "reshard_after_forward": True, "use_fp8": False,
         "fp8_communication": False, "fp8_reduce_scatter": False, "fp8_config": None,
         "comm_config": None, "initial_scale": 65536.0, "growth_interval": 1000,
         # Colossal-AI's arguments (issue 25), keyword-only, added at the end
         "shard_param_frac": 1.0, "placement_policy": "static", "max_prefetch": 0,
         "enable_async_reduce": True, "warmup_non_model_data_ratio": 0.8,
         "enable_fused_normalization": False, "enable_flash_attention": False, "tp_size": 1,
         "extra_dp_size": 1, "chunk_config_dict": None, "chunk_init_device": None,
         "steady_cuda_cap_ratio": 0.9, "master_weights": True, "pin_memory": False,
         "force_outputs_fp32": False, "strict_ddp_mode": False, "search_range_m": 32,
         "hidden_dim": None, "min_chunk_size_m": 32, "memstats": None,
         "gpu_margin_mem_ratio": 0.0, "min_scale": 1, "growth_factor": 2, "backoff_factor": 0.5,
         "hysteresis": 2, "max_scale": 2 ** 32, "enable_all_optimization": False,
         "enable_sequence_parallelism": False, "enable_jit_fused": False, "verbose": False}),
    "TorchFSDPPlugin": (
        (("precision", "bf16"), ("max_norm", 0.0)),
        {"reshard_after_forward": True, "cpu_offload": False, "use_fp8": False,
         "fp8_communication": False, "fp8_reduce_scatter": False, "fp8_config": None,
         "comm_config": None, "initial_scale": 65536.0, "growth_interval": 1000,
         "process_group": None, "sharding_strategy": None, "auto_wrap_policy": None,
         "backward_prefetch": None, "mixed_precision": None, "ignored_modules": None,
         "param_init_fn": None, "sync_module_states": False, "forward_prefetch": False,
         "limit_all_gathers": True, "use_orig_params": False, "device_id": None}),
    "HybridParallelPlugin": (
        (("tp_size", 1), ("pp_size", 1), ("precision", "bf16"), ("zero_stage", 0),
         ("enable_sequence_parallelism", False), ("sequence_parallelism_mode", None),
         ("max_norm", 0.0), ("custom_policy", None), ("use_fp8", False),
         ("fp8_communication", False), ("fp8_config", None)),
        {"comm_config": None, "overlap_communication": True, "reduce_bucket_size_in_m": None,
         "cpu_offload": False, "initial_scale": 65536.0, "growth_interval": 1000,
         "sp_size": None, "num_microbatches": None, "microbatch_size": None, "pp_style": "1f1b",
         "num_model_chunks": 1, "num_layers_per_stage": None, "fp8_reduce_scatter": False,
         "enable_all_optimization": False, "enable_fused_normalization": False,
         "enable_flash_attention": False, "enable_jit_fused": False,
         "enable_sequence_overlap": False, "parallel_output": True, "min_scale": 1,
         "growth_factor": 2, "backoff_factor": 0.5, "hysteresis": 2, "max_scale": 2 ** 32,
         "broadcast_buffers": True, "ddp_bucket_cap_mb": 25, "find_unused_parameters": False,
         "check_reduction": False, "gradient_as_bucket_view": False, "static_graph": False,
         "zero_bucket_size_in_m": None, "communication_dtype": None, "scheduler_nodes": None,
         "gradient_checkpoint_config": None, "enable_metadata_cache": True,
         "make_vocab_size_divisible_by": 64, "dp_outside": True, "overlap_p2p": True,
         "overlap_allgather": False, "inner_ring_size": None}),
}

#: shared options a plugin does not take (DDP has no loss-scaling arguments and its FP8 hook
#: already all-reduces gradients in FP8)
#: shared options added since that snapshot, keyword-only at the end of every signature
ADDED = {"fused_lm_loss": True, "fused_norm": False}

NOT_TAKEN = {"TorchDDPPlugin": {"fp8_reduce_scatter", "initial_scale", "growth_interval"}}


def _split(cls) -> tuple[tuple, dict]:
    params = [p for p in inspect.signature(cls).parameters.values()]
    assert all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params), params
    return (tuple((p.name, p.default) for p in params if p.kind is p.POSITIONAL_OR_KEYWORD),
            {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY})


@pytest.mark.parametrize("cls", PLUGINS, ids=lambda c: c.__name__)
def test_signature_is_unchanged(cls):
    positional, keyword = _split(cls)
    before_positional, before_keyword = BEFORE[cls.__name__]
    assert positional == before_positional  # the order positional callers rely on
    assert keyword == {**before_keyword, **ADDED}
    # __init__ itself (what help() shows) has the same signature as the class
    assert list(inspect.signature(cls.__init__).parameters)[1:] == \
        list(inspect.signature(cls).parameters)


@pytest.mark.parametrize("cls", PLUGINS, ids=lambda c: c.__name__)
def test_every_shared_option_reaches_every_plugin(cls):
    """A field added to PluginOptions appears in every plugin's signature with its default."""
    params = inspect.signature(cls).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(PluginOptions)}
    missing = set(defaults) - set(params) - NOT_TAKEN.get(cls.__name__, set())
    assert not missing, f"{cls.__name__} lacks shared options {missing}"
    for name in set(defaults) & set(params):
        if not (cls is TorchDDPPlugin and name == "precision"):  # None: the Booster decides
            assert params[name].default == defaults[name], name
    shown = pydoc.render_doc(cls, renderer=pydoc.plaintext)  # what help(cls) prints
    assert all(f" {name}: " in shown or f" {name}=" in shown for name in params), shown


@pytest.mark.parametrize("cls", PLUGINS, ids=lambda c: c.__name__)
def test_options_are_one_frozen_validated_object(cls):
    plugin = cls(use_fp8=True, max_norm=1)
    assert isinstance(plugin.options, PluginOptions)
    assert plugin.use_fp8 is True and plugin.max_norm == 1.0 and plugin.options.max_norm == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        plugin.options.use_fp8 = False
    with pytest.raises(AttributeError):
        plugin.use_fp8 = False  # read from plugin.options: never out of step with it
    with pytest.raises(TypeError, match="use_fp8 must be True or False"):
        cls(use_fp8=1)
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        cls(max_norm=-1)
    with pytest.raises(ValueError, match="precision='int8' is not supported"):
        cls(precision="int8")
    with pytest.raises(TypeError, match="fp8_config must be"):
        cls(fp8_config="tensorwise")
    with pytest.raises(TypeError, match="comm_config must be"):
        cls(comm_config="fp8")
    with pytest.raises(TypeError, match=f"{cls.__name__}\\(\\): .*unexpected keyword.*'use_fp9'"):
        cls(use_fp9=True)
    if "fp8_reduce_scatter" in inspect.signature(cls).parameters:
        with pytest.raises(ValueError, match="fp8_reduce_scatter=True needs fp8_communication"):
            cls(fp8_reduce_scatter=True)
        with pytest.raises(ValueError, match=r"initial_scale must be a number in \[1, 2\*\*32\]"):
            cls(initial_scale=0.5)
        with pytest.raises(ValueError, match="growth_interval must be an int >= 1"):
            cls(growth_interval=0)


def test_positional_arguments_keep_their_order():
    ddp = TorchDDPPlugin(True, True)
    assert ddp.use_fp8 and ddp.fp8_communication and ddp.precision == "fp32"
    zero = LowLevelZeroPlugin(1, "fp16", True, True)
    assert (zero.stage, zero.precision, zero.use_fp8, zero.fp8_communication) == \
        (1, "fp16", True, True)
    gemini = GeminiPlugin("fp16", 1.0, 1.0)
    assert (gemini.precision, gemini.max_norm, gemini.norm_type) == ("fp16", 1.0, 1.0)
    assert TorchFSDPPlugin("fp32", 2.0).max_norm == 2.0
    hybrid = HybridParallelPlugin(2, 1, "fp16", 1, True, None, 1.0, None, True, True)
    assert (hybrid.tp_size, hybrid.precision, hybrid.zero_stage, hybrid.max_norm,
            hybrid.use_fp8, hybrid.fp8_communication) == (2, "fp16", 1, 1.0, True, True)
    with pytest.raises(TypeError, match="HybridParallelPlugin\\(\\): too many positional"):
        HybridParallelPlugin(2, 1, "fp16", 1, True, None, 1.0, None, True, True, None, True)


@pytest.mark.parametrize("cls", PLUGINS, ids=lambda c: c.__name__)
def test_configure_is_the_one_skeleton(cls):
    """Plugins fill in configure's steps; none rewrites the sequence itself."""
    assert cls.configure is Plugin.configure


def _broadcast_case(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    from fp8boost.parallel.distributed import broadcast_module

    def model_of(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        m = torch.nn.Linear(4, 4).to(torch.bfloat16)
        m.register_buffer("fp8_buf", (torch.randn(8) * 4).to(torch.float8_e4m3fn))
        return m

    # A group whose first rank is not global rank 0: ranks 1 and 2 start from rank 1's model.
    pair = dist.new_group([1, 2])
    model = model_of(rank)
    if rank in (1, 2):
        broadcast_module(model, pair)
        want = model_of(1)
        assert torch.equal(model.weight, want.weight) and torch.equal(model.bias, want.bias)
        assert torch.equal(model.fp8_buf.view(torch.uint8), want.fp8_buf.view(torch.uint8))
    broadcast_module(model)  # None: the whole world, from global rank 0
    want = model_of(0)
    assert torch.equal(model.weight, want.weight)
    assert torch.equal(model.fp8_buf.view(torch.uint8), want.fp8_buf.view(torch.uint8))


def test_broadcast_module_sends_the_first_ranks_weights_and_fp8_bytes():
    """The one 'start every replica equal' of the plugins (FP8 tensors as uint8 on gloo)."""
    from tests.dist_utils import run_distributed

    run_distributed(_broadcast_case, 3)
