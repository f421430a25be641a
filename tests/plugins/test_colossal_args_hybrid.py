"""Issue 25 item 2: Colossal-AI's arguments of HybridParallelPlugin, LowLevelZeroPlugin,
TorchDDPPlugin and TorchFSDPPlugin are accepted (constructing a plugin is enough: no
collectives); GeminiPlugin's are pinned in test_colossal_plugin_args.py, its signature parity
here. Signature parity is against Colossal-AI v0.5.0, commit
4f9953be335ef371b3848719ddafe596c01ecd37 (colossalai/booster/plugin/*.py)."""
import inspect
import logging

import pytest
import torch
import torch.distributed as dist

from fp8boost import _state
from fp8boost.colossal.pipeline.schedule.v_schedule import PipelineGraph
from fp8boost.colossal.shardformer import PipelineGradientCheckpointConfig
from fp8boost.colossal.booster.plugin.args import (GeminiPlugin, HybridParallelPlugin,
                                                   LowLevelZeroPlugin, MoeHybridParallelPlugin,
                                                   TorchDDPPlugin, TorchFSDPPlugin)

LOGGER = "fp8boost.plugins"
#: Colossal-AI v0.5.0 __init__ parameter names.
COLOSSAL = {
    HybridParallelPlugin: """tp_size pp_size sp_size precision zero_stage enable_all_optimization
        enable_fused_normalization enable_flash_attention enable_jit_fused
        enable_sequence_parallelism sequence_parallelism_mode parallel_output num_microbatches
        microbatch_size initial_scale min_scale growth_factor backoff_factor growth_interval
        hysteresis max_scale max_norm broadcast_buffers ddp_bucket_cap_mb find_unused_parameters
        check_reduction gradient_as_bucket_view static_graph zero_bucket_size_in_m cpu_offload
        communication_dtype overlap_communication custom_policy pp_style num_model_chunks
        scheduler_nodes num_layers_per_stage gradient_checkpoint_config enable_metadata_cache
        make_vocab_size_divisible_by dp_outside overlap_p2p overlap_allgather fp8_communication
        use_fp8 inner_ring_size""",
    LowLevelZeroPlugin: """stage precision initial_scale min_scale growth_factor backoff_factor
        growth_interval hysteresis max_scale max_norm norm_type reduce_bucket_size_in_m
        communication_dtype overlap_communication overlap_allgather cpu_offload master_weights
        verbose cast_inputs fp8_communication use_fp8 extra_dp_size""",
    GeminiPlugin: """chunk_config_dict chunk_init_device placement_policy
        enable_gradient_accumulation max_prefetch shard_param_frac offload_optim_frac
        offload_param_frac warmup_non_model_data_ratio steady_cuda_cap_ratio precision
        master_weights pin_memory force_outputs_fp32 strict_ddp_mode search_range_m hidden_dim
        min_chunk_size_m memstats gpu_margin_mem_ratio initial_scale min_scale growth_factor
        backoff_factor growth_interval hysteresis max_scale max_norm norm_type tp_size
        extra_dp_size enable_all_optimization enable_fused_normalization enable_flash_attention
        enable_sequence_parallelism enable_jit_fused enable_async_reduce use_fp8 verbose
        fp8_communication""",
    MoeHybridParallelPlugin: """tp_size pp_size ep_size sp_size precision zero_stage
        enable_all_optimization enable_fused_normalization enable_flash_attention
        enable_jit_fused enable_sequence_parallelism sequence_parallelism_mode parallel_output
        num_microbatches microbatch_size initial_scale min_scale growth_factor backoff_factor
        growth_interval hysteresis max_scale max_norm broadcast_buffers ddp_bucket_cap_mb
        find_unused_parameters check_reduction gradient_as_bucket_view static_graph
        zero_bucket_size_in_m cpu_offload communication_dtype overlap_communication
        custom_policy pp_style num_model_chunks scheduler_nodes num_layers_per_stage
        gradient_checkpoint_config enable_metadata_cache make_vocab_size_divisible_by
        moe_dp_outside overlap_p2p overlap_allgather fp8_communication use_fp8""",
    TorchDDPPlugin: """broadcast_buffers bucket_cap_mb find_unused_parameters check_reduction
        gradient_as_bucket_view static_graph fp8_communication""",
    TorchFSDPPlugin: """process_group sharding_strategy cpu_offload auto_wrap_policy
        backward_prefetch mixed_precision ignored_modules param_init_fn sync_module_states
        fp8_communication""",
}


KEYS = [f"colossal-args.{plugin}.{name}" for plugin, names in (
    ("hybrid", "enable_all_optimization enable_fused_normalization enable_flash_attention "
               "enable_jit_fused enable_sequence_overlap enable_metadata_cache overlap_p2p "
               "dp_outside make_vocab_size_divisible_by inner_ring_size "
               "broadcast_buffers ddp_bucket_cap_mb find_unused_parameters check_reduction "
               "gradient_as_bucket_view static_graph scheduler_nodes communication_dtype "
               "hysteresis loss-scale pipeline-options"),
    ("low_level_zero", "verbose communication_dtype hysteresis loss-scale"),
    ("ddp", "check_reduction")) for name in names.split()] + ["hybrid-overlap-allgather-na"]


@pytest.fixture(autouse=True)
def _fresh_log_keys():
    for key in KEYS:
        _state.forget_logged(key)
    yield
    for key in KEYS:
        _state.forget_logged(key)


def _infos(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.INFO]


@pytest.mark.parametrize("cls", list(COLOSSAL), ids=lambda c: c.__name__)
def test_every_colossal_argument_is_in_the_signature(cls):
    missing = set(COLOSSAL[cls].split()) - set(inspect.signature(cls).parameters)
    assert not missing, missing


def test_defaults_are_silent(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    HybridParallelPlugin(enable_all_optimization=False, parallel_output=True, min_scale=1,
                         growth_factor=2, backoff_factor=0.5, hysteresis=2, max_scale=2 ** 32,
                         broadcast_buffers=True, ddp_bucket_cap_mb=25, check_reduction=False,
                         enable_metadata_cache=True, make_vocab_size_divisible_by=64,
                         dp_outside=True, overlap_p2p=True, overlap_allgather=False)
    LowLevelZeroPlugin(norm_type=2.0, verbose=False, cast_inputs=True, extra_dp_size=1)
    TorchDDPPlugin(check_reduction=False)
    TorchFSDPPlugin(sync_module_states=True, limit_all_gathers=True)
    assert _infos(caplog) == []
    assert not dist.is_initialized()


@pytest.mark.parametrize("cls, kwargs, words", [
    (HybridParallelPlugin, dict(enable_flash_attention=True), ["SDPA"]),
    (HybridParallelPlugin, dict(enable_all_optimization=True), ["fused_norm=True", "SDPA"]),
    (HybridParallelPlugin, dict(enable_jit_fused=True), ["model's own modules"]),
    (HybridParallelPlugin, dict(enable_metadata_cache=False), ["pipelining"]),
    (HybridParallelPlugin, dict(overlap_p2p=False), ["pipelining"]),
    (HybridParallelPlugin, dict(overlap_allgather=True), ["zero_stage 1 or 2", "pp_size=1"]),
    (HybridParallelPlugin, dict(make_vocab_size_divisible_by=128), ["does not pad"]),
    (HybridParallelPlugin, dict(inner_ring_size=2), ["ring attention"]),
    (HybridParallelPlugin, dict(find_unused_parameters=True), ["ZeRO optimizer"]),
    (HybridParallelPlugin, dict(dp_outside=False), ["dp outermost"]),
    (HybridParallelPlugin, dict(microbatch_size=2), ["ignored with pp_size=1"]),
    (HybridParallelPlugin, dict(num_microbatches=4, pp_style="interleaved", num_model_chunks=2),
     ["ignored with pp_size=1"]),
    (HybridParallelPlugin, dict(precision="fp16", hysteresis=2), ["every overflow"]),
    (HybridParallelPlugin, dict(precision="bf16", growth_factor=4), ["precision='fp16'"]),
    (LowLevelZeroPlugin, dict(verbose=True), ["loggers"]),
    (LowLevelZeroPlugin, dict(communication_dtype=torch.bfloat16), ["working dtype"]),
    (TorchDDPPlugin, dict(check_reduction=True), ["deprecated"]),
])
def test_tuning_arguments_log_one_info_line_once(caplog, cls, kwargs, words):
    caplog.set_level(logging.INFO, logger=LOGGER)
    cls(**kwargs)
    cls(**kwargs)  # once per process
    (line,) = _infos(caplog)
    assert all(w in line for w in words), line
    assert not dist.is_initialized()


@pytest.mark.parametrize("cls", [HybridParallelPlugin, GeminiPlugin, MoeHybridParallelPlugin],
                         ids=lambda c: c.__name__)
def test_fused_normalization_maps_onto_fused_norm(cls, caplog):
    # Colossal-AI's Shardformer swaps in its fused RMSNorm; fp8boost runs HF's RMSNorms through
    # F.rms_norm (fused_norm, fp8boost.norm), no INFO line for it.
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert cls(enable_fused_normalization=True).fused_norm is True
    assert _infos(caplog) == []
    assert cls(enable_all_optimization=True).fused_norm is True
    assert cls().fused_norm is False and cls(fused_norm=True).fused_norm is True
    with pytest.raises(TypeError, match="enable_fused_normalization"):
        cls(enable_fused_normalization=1)
    assert not dist.is_initialized()


def test_pipeline_options_at_pp1_are_ignored():
    plugin = HybridParallelPlugin(microbatch_size=2, num_layers_per_stage=[1, 1])
    assert plugin.pipeline is None and plugin.stage_manager is None


def test_scheduler_nodes_are_accepted_with_zbv_and_not_replayed(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    nodes = PipelineGraph(n_stage=2, n_micro=4, f_cost=1, b_cost=1, w_cost=1, c_cost=1,
                          f_mem=2, b_mem=-1, w_mem=-1).get_v_schedule()
    HybridParallelPlugin(pp_size=2, pp_style="zbv", num_model_chunks=2, num_microbatches=4,
                         zero_stage=1, scheduler_nodes=nodes)
    (line,) = _infos(caplog)
    assert "not replayed" in line and "ScheduleZBVZeroBubble" in line
    with pytest.raises(TypeError, match="scheduler_nodes"):
        HybridParallelPlugin(scheduler_nodes="zbv")


def test_v_schedule_is_a_valid_order():
    g = PipelineGraph(n_stage=3, n_micro=4, f_cost=2, b_cost=2, w_cost=1, c_cost=1, f_mem=1,
                      b_mem=-1, w_mem=0)
    sched = g.get_v_schedule()
    assert len(sched) == 3
    for s, nodes in enumerate(sched):
        assert len(nodes) == 6 * 4 and all(n.stage == s for n in nodes)
        assert {(n.type, n.chunk, n.minibatch) for n in nodes} == \
            {(t, c, m) for t in "FBW" for c in (0, 1) for m in range(4)}
        assert all(a.completion_time <= b.start_time for a, b in zip(nodes, nodes[1:]))
    at = {(n.type, n.chunk, n.stage, n.minibatch): n for st in sched for n in st}
    for m in range(4):  # the V: chunk 0 goes 0 -> 2, chunk 1 comes back 2 -> 0
        assert at["F", 0, 2, m].completion_time <= at["F", 1, 2, m].start_time
        assert at["F", 1, 1, m].completion_time < at["F", 1, 0, m].start_time
        assert at["B", 1, 0, m].completion_time < at["B", 1, 1, m].start_time
        assert at["B", 0, 1, m].completion_time < at["B", 0, 0, m].start_time


def test_mapped_values():
    plugin = HybridParallelPlugin(zero_bucket_size_in_m=32)
    assert plugin.reduce_bucket_numel == 32 * 1024 * 1024
    cfg = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5)
    assert HybridParallelPlugin(gradient_checkpoint_config=cfg).colossal \
        .gradient_checkpoint_config is cfg
    zero = LowLevelZeroPlugin(precision="fp16", growth_factor=4, backoff_factor=0.25,
                              min_scale=2, max_scale=2 ** 20, hysteresis=1)
    assert zero.loss_scale_kwargs == dict(min_scale=2.0, growth_factor=4.0,
                                          backoff_factor=0.25, max_scale=2.0 ** 20)
    assert HybridParallelPlugin(precision="fp16", growth_factor=3, hysteresis=1) \
        .colossal.loss_scale["growth_factor"] == 3.0


@pytest.mark.parametrize("cls, kwargs, match", [
    (HybridParallelPlugin, dict(tp_size=2, parallel_output=False), "parallel_output=True"),
    (HybridParallelPlugin, dict(communication_dtype=torch.float16), "fp8_communication=True"),
    (HybridParallelPlugin, dict(zero_bucket_size_in_m=8, reduce_bucket_size_in_m=16),
     "pass one"),
    (HybridParallelPlugin, dict(growth_factor=1.0), "growth_factor must be > 1"),
    (LowLevelZeroPlugin, dict(norm_type=1.0), "GeminiPlugin"),
    (LowLevelZeroPlugin, dict(extra_dp_size=2), "HybridParallelPlugin"),
    (LowLevelZeroPlugin, dict(cast_inputs=False), "precision='fp32'"),
    (LowLevelZeroPlugin, dict(communication_dtype=torch.float16), "fp8_communication=True"),
])
def test_numerics_changing_values_raise_naming_the_alternative(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)
    assert not dist.is_initialized()


@pytest.mark.parametrize("cls, kwargs", [
    (HybridParallelPlugin, dict(enable_flash_attention=1)),
    (HybridParallelPlugin, dict(gradient_checkpoint_config=0.5)),
    (HybridParallelPlugin, dict(communication_dtype="bf16")),
    (HybridParallelPlugin, dict(hysteresis=1.5)),
    (LowLevelZeroPlugin, dict(verbose="yes")),
    (TorchDDPPlugin, dict(check_reduction=None)),
])
def test_wrong_types_raise_type_error(cls, kwargs):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        cls(**kwargs)


def test_overlap_allgather_is_fp8boosts_own(caplog):
    """Colossal-AI's ``overlap_allgather`` reaches fp8boost's ZeRO (the post-step all-gather
    overlapped with the next forward: tests/parallel/test_zero_overlap_allgather.py), silently
    where it applies; the hybrid plugin says once where it does not (no ZeRO, or pp)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert LowLevelZeroPlugin(overlap_allgather=True).overlap_allgather is True
    assert LowLevelZeroPlugin().overlap_allgather is False
    assert HybridParallelPlugin(tp_size=2, zero_stage=1, overlap_allgather=True).overlap_allgather
    assert _infos(caplog) == []
