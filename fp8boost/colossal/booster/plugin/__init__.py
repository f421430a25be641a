"""``colossalai.booster.plugin``: fp8boost's six plugins under Colossal-AI's path.

Each is fp8boost's own plugin class taking Colossal-AI's arguments too (:mod:`.args`: their
checks and mapping onto fp8boost's arguments), with Colossal-AI's positional order
(:func:`fp8boost.colossal.positional.with_colossal_order`; the orders are Colossal-AI v0.5.0's,
commit 4f9953be), so ``GeminiPlugin("cuda", ...)``-style positional calls bind as they do
there. Keyword calls behave exactly as on :mod:`.args`. ``HybridParallelPlugin`` and
``MoeHybridParallelPlugin`` also answer ``get_checkpoint_io()`` as Colossal-AI's do: a
``HybridParallelCheckpointIO`` / ``MoECheckpointIO`` (``fp8boost.colossal.checkpoint_io``).
``TorchFSDPPlugin`` boosts a model whose ``state_dict()`` holds full plain tensors, as
Colossal-AI's FSDP1 one does (:mod:`.fsdp1_surface`).

Example:
    >>> from fp8boost.colossal.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
"""
from types import MappingProxyType

from fp8boost import plugins as _plugins
from fp8boost.colossal.checkpoint_io import HybridParallelCheckpointIO, MoECheckpointIO
from fp8boost.colossal.positional import with_colossal_order
from fp8boost.plugins import Plugin

from . import args, fsdp1_surface

ORDERS = MappingProxyType({
    "LowLevelZeroPlugin": (
        "stage", "precision", "initial_scale", "min_scale", "growth_factor", "backoff_factor",
        "growth_interval", "hysteresis", "max_scale", "max_norm", "norm_type",
        "reduce_bucket_size_in_m", "communication_dtype", "overlap_communication",
        "overlap_allgather", "cpu_offload", "master_weights", "verbose", "cast_inputs",
        "fp8_communication", "use_fp8", "extra_dp_size"),
    "GeminiPlugin": (
        "chunk_config_dict", "chunk_init_device", "placement_policy",
        "enable_gradient_accumulation", "max_prefetch", "shard_param_frac", "offload_optim_frac",
        "offload_param_frac", "warmup_non_model_data_ratio", "steady_cuda_cap_ratio",
        "precision", "master_weights", "pin_memory", "force_outputs_fp32", "strict_ddp_mode",
        "search_range_m", "hidden_dim", "min_chunk_size_m", "memstats", "gpu_margin_mem_ratio",
        "initial_scale", "min_scale", "growth_factor", "backoff_factor", "growth_interval",
        "hysteresis", "max_scale", "max_norm", "norm_type", "tp_size", "extra_dp_size",
        "enable_all_optimization", "enable_fused_normalization", "enable_flash_attention",
        "enable_sequence_parallelism", "enable_jit_fused", "enable_async_reduce", "use_fp8",
        "verbose", "fp8_communication"),
    "HybridParallelPlugin": (
        "tp_size", "pp_size", "sp_size", "precision", "zero_stage", "enable_all_optimization",
        "enable_fused_normalization", "enable_flash_attention", "enable_jit_fused",
        "enable_sequence_parallelism", "sequence_parallelism_mode", "parallel_output",
        "num_microbatches", "microbatch_size", "initial_scale", "min_scale", "growth_factor",
        "backoff_factor", "growth_interval", "hysteresis", "max_scale", "max_norm",
        "broadcast_buffers", "ddp_bucket_cap_mb", "find_unused_parameters", "check_reduction",
        "gradient_as_bucket_view", "static_graph", "zero_bucket_size_in_m", "cpu_offload",
        "communication_dtype", "overlap_communication", "custom_policy", "pp_style",
        "num_model_chunks", "scheduler_nodes", "num_layers_per_stage",
        "gradient_checkpoint_config", "enable_metadata_cache", "make_vocab_size_divisible_by",
        "dp_outside", "overlap_p2p", "overlap_allgather", "fp8_communication", "use_fp8",
        "inner_ring_size"),
    "MoeHybridParallelPlugin": (
        "tp_size", "pp_size", "ep_size", "sp_size", "precision", "zero_stage",
        "enable_all_optimization", "enable_fused_normalization", "enable_flash_attention",
        "enable_jit_fused", "enable_sequence_parallelism", "sequence_parallelism_mode",
        "parallel_output", "num_microbatches", "microbatch_size", "initial_scale", "min_scale",
        "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "max_scale",
        "max_norm", "broadcast_buffers", "ddp_bucket_cap_mb", "find_unused_parameters",
        "check_reduction", "gradient_as_bucket_view", "static_graph", "zero_bucket_size_in_m",
        "cpu_offload", "communication_dtype", "overlap_communication", "custom_policy",
        "pp_style", "num_model_chunks", "scheduler_nodes", "num_layers_per_stage",
        "gradient_checkpoint_config", "enable_metadata_cache", "make_vocab_size_divisible_by",
        "moe_dp_outside", "overlap_p2p", "overlap_allgather", "fp8_communication", "use_fp8"),
    "TorchDDPPlugin": (
        "broadcast_buffers", "bucket_cap_mb", "find_unused_parameters", "check_reduction",
        "gradient_as_bucket_view", "static_graph", "fp8_communication"),
    "TorchFSDPPlugin": (
        "process_group", "sharding_strategy", "cpu_offload", "auto_wrap_policy",
        "backward_prefetch", "mixed_precision", "ignored_modules", "param_init_fn",
        "sync_module_states", "fp8_communication"),
})
"""Colossal-AI v0.5.0's ``__init__`` parameters of each plugin, in order."""

DEFAULTS = MappingProxyType({
    "LowLevelZeroPlugin": MappingProxyType({"stage": 1, "initial_scale": 2.0 ** 32}),
})
"""Colossal-AI's defaults where fp8boost's own differ in meaning. Kept as fp8boost's: ``precision``
(``"bf16"`` here, ``"fp16"`` there: FP8 GEMMs on Hopper want BF16, which needs no loss
scaling), the ZeRO bucket size (None: fp8boost's measured choice, 12 MB there) and DDP's
``gradient_as_bucket_view`` (True here: one gradient copy less, same numbers)."""

LowLevelZeroPlugin = with_colossal_order(args.LowLevelZeroPlugin, ORDERS["LowLevelZeroPlugin"],
                                         DEFAULTS["LowLevelZeroPlugin"])
GeminiPlugin = with_colossal_order(args.GeminiPlugin, ORDERS["GeminiPlugin"])


def _colossal_checkpoint_io(io_class: type, base: type):
    """``get_checkpoint_io`` of a Colossal-AI-facing plugin: ``io_class`` (Colossal-AI's
    signatures) over the fp8boost plugin's own checkpoint IO."""

    def get_checkpoint_io(self) -> HybridParallelCheckpointIO:
        return io_class(self, native=base.get_checkpoint_io(self))

    get_checkpoint_io.__doc__ = (
        f"Colossal-AI's ``{io_class.__name__}``: its save/load signatures over "
        f"``{base.__name__}``'s own checkpoint IO (its ``native``).")
    return get_checkpoint_io


HybridParallelPlugin = with_colossal_order(
    args.HybridParallelPlugin, ORDERS["HybridParallelPlugin"],
    methods={"get_checkpoint_io": _colossal_checkpoint_io(HybridParallelCheckpointIO,
                                                          _plugins.HybridParallelPlugin)})
TorchDDPPlugin = with_colossal_order(args.TorchDDPPlugin, ORDERS["TorchDDPPlugin"])
# FSDP1's answers on the FSDP2 model: full state dicts, FSDP.full_optim_state_dict (fsdp1_surface)
TorchFSDPPlugin = with_colossal_order(args.TorchFSDPPlugin, ORDERS["TorchFSDPPlugin"],
                                      methods={"configure": fsdp1_surface.configure})
MoeHybridParallelPlugin = with_colossal_order(
    args.MoeHybridParallelPlugin, ORDERS["MoeHybridParallelPlugin"],
    methods={"get_checkpoint_io": _colossal_checkpoint_io(MoECheckpointIO,
                                                          _plugins.MoeHybridParallelPlugin)})

__all__ = ["Plugin", "TorchDDPPlugin", "LowLevelZeroPlugin", "GeminiPlugin", "TorchFSDPPlugin",
           "HybridParallelPlugin", "MoeHybridParallelPlugin", "ORDERS", "DEFAULTS"]
