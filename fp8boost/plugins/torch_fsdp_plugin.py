"""TorchFSDPPlugin: plain FSDP2, the baseline users know, with the same FP8 switches."""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from .fsdp_plugin_base import FsdpPluginBase
from .options import check_bool, takes_plugin_options


@takes_plugin_options(positional=("precision", "max_norm"))
class TorchFSDPPlugin(FsdpPluginBase):
    """PyTorch FSDP2 (``fully_shard`` per block + root) with FP32 masters and FP32 reductions.

    Colossal-AI's (FSDP1) arguments (``mixed_precision``, ``sharding_strategy``,
    ``CPUOffload``, ...) are taken by ``fp8boost.colossal.booster.plugin.TorchFSDPPlugin``,
    which maps them onto these.

    Args:
        precision: ``"bf16"`` (default), ``"fp16"`` (dynamic loss scaling) or ``"fp32"``.
        max_norm: clip the global gradient norm at every step; 0 disables.
        reshard_after_forward: free gathered parameters after forward.
        cpu_offload: FSDP2 ``CPUOffloadPolicy`` (parameters, gradients, optimizer on the CPU).
        param_init_fn: called on every module holding meta tensors of a meta-device model at
            ``boost`` (after sharding), instead of fp8boost's own init (FSDP1's meaning).
        use_fp8, fp8_communication, fp8_reduce_scatter, fp8_config, comm_config: as
            ``GeminiPlugin``.
        initial_scale, growth_interval: fp16 dynamic loss scaling.

    Example:
        >>> from fp8boost.booster import Booster
        >>> from fp8boost.plugins import TorchFSDPPlugin
        >>> booster = Booster(plugin=TorchFSDPPlugin(use_fp8=True))
    """

    def __init__(self, *, reshard_after_forward: bool = True, cpu_offload: bool = False,
                 param_init_fn: Optional[Callable[[nn.Module], None]] = None,
                 **options) -> None:
        check_bool("reshard_after_forward", reshard_after_forward)
        check_bool("cpu_offload", cpu_offload)
        if param_init_fn is not None and not callable(param_init_fn):
            raise TypeError("param_init_fn must be a callable module -> None, got "
                            f"{param_init_fn!r}")
        super().__init__(**options)  # precision, FP8, clipping, loss scaling: PluginOptions
        self.reshard_after_forward, self.cpu_offload = reshard_after_forward, cpu_offload
        self.param_init_fn = param_init_fn

    def __repr__(self) -> str:
        return (f"TorchFSDPPlugin(precision={self.precision!r}, use_fp8={self.use_fp8}, "
                f"fp8_communication={self.fp8_communication}, cpu_offload={self.cpu_offload})")
