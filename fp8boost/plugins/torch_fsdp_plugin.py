"""TorchFSDPPlugin: plain FSDP2, the baseline users know, with the same FP8 switches."""
from __future__ import annotations

from .colossal_args_fsdp import fsdp_args
from .fsdp_plugin_base import FsdpPluginBase
from .options import check_bool, takes_plugin_options


@takes_plugin_options(positional=("precision", "max_norm"))
class TorchFSDPPlugin(FsdpPluginBase):
    """PyTorch FSDP2 (``fully_shard`` per block + root) with FP32 masters and FP32 reductions.

    Args:
        precision: ``"bf16"`` (default), ``"fp16"`` (dynamic loss scaling) or ``"fp32"``.
        max_norm: clip the global gradient norm at every step; 0 disables.
        reshard_after_forward: free gathered parameters after forward.
        cpu_offload: FSDP2 ``CPUOffloadPolicy`` (parameters, gradients, optimizer on the CPU):
            True, or FSDP1's ``CPUOffload(offload_params=True)``.
        mixed_precision: FSDP1's ``MixedPrecision``: ``param_dtype`` bf16/fp16/fp32 sets
            ``precision``; gradients reduce in FP32 whatever ``reduce_dtype`` (INFO otherwise).
        sharding_strategy: FSDP1's ``ShardingStrategy``: FULL_SHARD (reshard_after_forward
            True), SHARD_GRAD_OP (False); NO_SHARD raises (use TorchDDPPlugin), HYBRID_* raise.
        param_init_fn: called on every module holding meta tensors of a meta-device model at
            ``boost`` (after sharding), instead of fp8boost's own init (FSDP1's meaning).
        process_group (None or the world group), ignored_modules (None or empty): others raise.
        auto_wrap_policy, backward_prefetch, forward_prefetch, limit_all_gathers,
            use_orig_params, device_id, sync_module_states: FSDP1 tuning: accepted; a
            non-default value logs once what FSDP2 here does instead (ranks always start
            from rank 0's weights, so ``sync_module_states`` is honoured either way).
        use_fp8, fp8_communication, fp8_reduce_scatter, fp8_config, comm_config: as
            ``GeminiPlugin``.
        initial_scale, growth_interval: fp16 dynamic loss scaling.

    Example:
        >>> from fp8boost.booster import Booster
        >>> from fp8boost.plugins import TorchFSDPPlugin
        >>> booster = Booster(plugin=TorchFSDPPlugin(use_fp8=True))
    """

    def __init__(self, *, reshard_after_forward: bool = True, cpu_offload=False,
                 process_group=None, sharding_strategy=None, auto_wrap_policy=None,
                 backward_prefetch=None, mixed_precision=None, ignored_modules=None,
                 param_init_fn=None, sync_module_states: bool = False,
                 forward_prefetch: bool = False, limit_all_gathers: bool = True,
                 use_orig_params: bool = False, device_id=None, **options) -> None:
        check_bool("reshard_after_forward", reshard_after_forward)
        # Colossal-AI's (FSDP1) arguments, mapped before anything else (colossal_args_fsdp).
        fsdp1 = fsdp_args(
            precision=options["precision"], reshard_after_forward=reshard_after_forward,
            process_group=process_group, sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload, auto_wrap_policy=auto_wrap_policy,
            backward_prefetch=backward_prefetch, mixed_precision=mixed_precision,
            ignored_modules=ignored_modules, param_init_fn=param_init_fn,
            sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params,
            device_id=device_id)
        if fsdp1.precision is not None:
            options["precision"] = fsdp1.precision
        super().__init__(**options)  # precision, FP8, clipping, loss scaling: PluginOptions
        self.reshard_after_forward = reshard_after_forward if fsdp1.reshard_after_forward is None \
            else fsdp1.reshard_after_forward
        self.cpu_offload, self.param_init_fn = fsdp1.cpu_offload, fsdp1.param_init_fn

    def __repr__(self) -> str:
        return (f"TorchFSDPPlugin(precision={self.precision!r}, use_fp8={self.use_fp8}, "
                f"fp8_communication={self.fp8_communication}, cpu_offload={self.cpu_offload})")
