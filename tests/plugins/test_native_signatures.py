"""Issue 38 item 2: ``fp8boost.plugins`` takes fp8boost's arguments only; Colossal-AI's extra
arguments are taken by ``fp8boost.colossal.booster.plugin`` (and its ``args`` classes), which
map them onto these. ``inspect.signature`` shows each plugin's real parameters."""
from __future__ import annotations

import inspect

import pytest

import fp8boost.plugins as native
from fp8boost.colossal.booster import plugin as colossal
from fp8boost.colossal.booster.plugin import args

#: {plugin: (positional names in order, keyword-only names)}
NATIVE = {
    "TorchDDPPlugin": (
        "use_fp8 fp8_communication",
        "broadcast_buffers bucket_cap_mb comm_config find_unused_parameters fp8_config "
        "fused_lm_loss fused_norm gradient_as_bucket_view max_norm precision static_graph"),
    "LowLevelZeroPlugin": (
        "stage precision use_fp8 fp8_communication",
        "comm_config cpu_offload fp8_config fp8_param_gather fp8_reduce_scatter fused_lm_loss fused_norm "
        "growth_interval initial_scale master_weights max_norm overlap_allgather "
        "overlap_communication reduce_bucket_size_in_m"),
    "GeminiPlugin": (
        "precision max_norm norm_type",
        "comm_config enable_gradient_accumulation fp8_communication fp8_config "
        "fp8_reduce_scatter fused_lm_loss fused_norm growth_interval initial_scale offload_optim_frac "
        "offload_param_frac reshard_after_forward use_fp8"),
    "TorchFSDPPlugin": (
        "precision max_norm",
        "comm_config cpu_offload fp8_communication fp8_config fp8_reduce_scatter fused_lm_loss fused_norm "
        "growth_interval initial_scale param_init_fn reshard_after_forward use_fp8"),
    "HybridParallelPlugin": (
        "tp_size pp_size precision zero_stage enable_sequence_parallelism "
        "sequence_parallelism_mode max_norm custom_policy use_fp8 fp8_communication fp8_config",
        "comm_config cpu_offload fp8_reduce_scatter fused_lm_loss fused_norm gradient_checkpoint_config "
        "growth_interval initial_scale microbatch_size num_layers_per_stage num_microbatches "
        "num_model_chunks overlap_allgather overlap_communication pp_style "
        "reduce_bucket_size_in_m sp_size"),
    "MoeHybridParallelPlugin": (
        "tp_size pp_size ep_size precision zero_stage",
        "comm_config cpu_offload custom_policy fp8_communication fp8_config fp8_reduce_scatter "
        "fused_lm_loss fused_norm gradient_checkpoint_config growth_interval initial_scale max_norm "
        "microbatch_size moe_dp_outside num_layers_per_stage num_microbatches "
        "num_model_chunks pp_style reduce_bucket_size_in_m use_fp8"),
}


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_native_signature_has_native_arguments_only(name):
    cls = getattr(native, name)
    params = list(inspect.signature(cls).parameters.values())
    positional, keyword = NATIVE[name]
    assert [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD] == positional.split()
    assert sorted(p.name for p in params if p.kind is p.KEYWORD_ONLY) == keyword.split()
    with pytest.raises(TypeError, match=f"{name}\\(\\): .*unexpected keyword.*'verbose'"):
        cls(verbose=True)  # a Colossal-AI argument (of several plugins) is not fp8boost's


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_colossal_classes_add_colossal_arguments_over_the_native_ones(name):
    base, mapped, ordered = getattr(native, name), getattr(args, name), getattr(colossal, name)
    assert issubclass(ordered, mapped) and issubclass(mapped, base)
    own = set(inspect.signature(base).parameters)
    assert own < set(inspect.signature(mapped).parameters) == \
        set(inspect.signature(ordered).parameters)
    assert set(colossal.ORDERS[name]) - own  # Colossal-AI's extra arguments live up there
