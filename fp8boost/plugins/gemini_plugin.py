"""GeminiPlugin: ZeRO-3 on FSDP2 (``fully_shard`` per block + root)."""
from __future__ import annotations

import logging
from fp8boost import _state

from .fsdp_plugin_base import FsdpPluginBase
from .options import check_bool, takes_plugin_options

logger = logging.getLogger("fp8boost.plugins")


def _check_frac(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if 0.0 < value < 1.0:
        raise ValueError(f"{name}={value}: partial offload is not supported yet; use 0.0 (all on "
                         "the GPU) or 1.0 (all on the CPU through FSDP2's CPUOffloadPolicy)")
    return float(value)


@takes_plugin_options(positional=("precision", "max_norm", "norm_type"))
class GeminiPlugin(FsdpPluginBase):
    """ZeRO-3: parameters, gradients and optimizer state sharded 1/dp, on FSDP2.

    Each decoder block (and the root) is a ``fully_shard`` unit: its FP32 master parameters
    are sharded over the data-parallel ranks, all-gathered in ``precision`` for forward and
    backward, and gradients are reduce-scattered in FP32. The user's optimizer is rebound to
    the sharded parameters, so its state is sharded too.

    Args:
        precision: ``"bf16"`` (default), ``"fp16"`` (dynamic loss scaling) or ``"fp32"``.
        max_norm: clip the global gradient norm (over all shards) at every step; 0 disables.
        norm_type: the norm for clipping.
        offload_optim_frac, offload_param_frac: 0.0 or 1.0. Any 1.0 keeps parameters,
            gradients and optimizer state on the CPU (FSDP2 ``CPUOffloadPolicy``: the optimizer
            step runs on the CPU); fractions in between raise.
        enable_gradient_accumulation: allow ``booster.no_sync`` (local accumulation, no
            reduce-scatter) for all but the last micro-batch.
        reshard_after_forward: free gathered parameters after forward (ZeRO-3); False keeps
            them until backward (more memory, one all-gather less).
        use_fp8: run eligible linear layers' GEMMs in FP8 (``convert_to_fp8``).
        fp8_communication: all-gather the weights of FP8 linear layers as FP8 bytes, one scale
            per weight (all scales refreshed in one all-reduce after each step). Gradients stay
            FP32 on the wire unless ``fp8_reduce_scatter``: FP8 reduce-scatter measured slower
            on NVLink (the reason is logged once and kept in ``plugin.comm_report``).
        fp8_reduce_scatter: reduce-scatter gradients as FP8 (e5m2, per-chunk scales) too.
        fp8_config: FP8 recipe for ``use_fp8``. comm_config: ``Fp8CommConfig``.
        initial_scale, growth_interval: fp16 dynamic loss scaling.

    Colossal-AI's own arguments (chunks, placement policy, Shardformer switches, loss-scaling
    details, ``force_outputs_fp32``, ...) are taken by
    ``fp8boost.colossal.booster.plugin.GeminiPlugin``, which maps them onto these.

    Example:
        >>> from fp8boost.booster import Booster
        >>> from fp8boost.plugins import GeminiPlugin
        >>> booster = Booster(plugin=GeminiPlugin(precision="bf16", use_fp8=True))
        >>> # model, optimizer, *_ = booster.boost(model, optimizer)
    """

    def __init__(self, norm_type: float = 2.0, *, offload_optim_frac: float = 0.0,
                 offload_param_frac: float = 0.0, enable_gradient_accumulation: bool = False,
                 reshard_after_forward: bool = True, **options) -> None:
        super().__init__(**options)  # precision, FP8, clipping, loss scaling: PluginOptions
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or norm_type <= 0:
            raise ValueError(f"norm_type must be a number > 0 (2.0: L2), got {norm_type!r}")
        self.norm_type = float(norm_type)
        optim_frac = _check_frac("offload_optim_frac", offload_optim_frac)
        param_frac = _check_frac("offload_param_frac", offload_param_frac)
        for name, value in (("enable_gradient_accumulation", enable_gradient_accumulation),
                            ("reshard_after_forward", reshard_after_forward)):
            check_bool(name, value)
        # FSDP2 offloads parameters, gradients and optimizer state together.
        self.cpu_offload = optim_frac == 1.0 or param_frac == 1.0
        if optim_frac != param_frac:
            _state.log_once(logger, "gemini-offload-together",
                            "fp8boost: FSDP2's CPUOffloadPolicy moves parameters, gradients and "
                            "optimizer state to the CPU together, so offload_optim_frac="
                            f"{optim_frac} with offload_param_frac={param_frac} offloads all of "
                            "them (as both = 1.0)")
        self.offload_optim_frac, self.offload_param_frac = optim_frac, param_frac
        self.allow_no_sync = enable_gradient_accumulation
        self.reshard_after_forward = reshard_after_forward

    def __repr__(self) -> str:
        return (f"GeminiPlugin(precision={self.precision!r}, use_fp8={self.use_fp8}, "
                f"fp8_communication={self.fp8_communication}, cpu_offload={self.cpu_offload})")
