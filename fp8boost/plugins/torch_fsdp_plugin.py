"""TorchFSDPPlugin: plain FSDP2, the baseline users know, with the same FP8 switches."""
from __future__ import annotations

from typing import Optional

from fp8boost.fp8.config import Fp8Config

from .fsdp_plugin_base import FsdpPluginBase, check_loss_scaling
from .plugin_base import check_bool
from .precision import check_comm_config, check_fp8_config, check_max_norm, check_precision


class TorchFSDPPlugin(FsdpPluginBase):
    """PyTorch FSDP2 (``fully_shard`` per block + root) with FP32 masters and FP32 reductions.

    Args:
        precision: ``"bf16"`` (default), ``"fp16"`` (dynamic loss scaling) or ``"fp32"``.
        max_norm: clip the global gradient norm at every step; 0 disables.
        reshard_after_forward: free gathered parameters after forward.
        cpu_offload: FSDP2 ``CPUOffloadPolicy`` (parameters, gradients, optimizer on the CPU).
        use_fp8, fp8_communication, fp8_reduce_scatter, fp8_config, comm_config: as
            ``GeminiPlugin``.
        initial_scale, growth_interval: fp16 dynamic loss scaling.

    Example:
        >>> from fp8boost.booster import Booster
        >>> from fp8boost.plugins import TorchFSDPPlugin
        >>> booster = Booster(plugin=TorchFSDPPlugin(use_fp8=True))
    """

    def __init__(self, precision: str = "bf16", max_norm: float = 0.0, *,
                 reshard_after_forward: bool = True, cpu_offload: bool = False,
                 use_fp8: bool = False, fp8_communication: bool = False,
                 fp8_reduce_scatter: bool = False, fp8_config: Optional[Fp8Config] = None,
                 comm_config=None, initial_scale: float = 2.0 ** 16,
                 growth_interval: int = 1000) -> None:
        self.precision = check_precision(precision, self.supported_precisions)
        self.max_norm = check_max_norm(max_norm)
        for name, value in (("reshard_after_forward", reshard_after_forward),
                            ("cpu_offload", cpu_offload), ("use_fp8", use_fp8),
                            ("fp8_communication", fp8_communication),
                            ("fp8_reduce_scatter", fp8_reduce_scatter)):
            check_bool(name, value)
        if fp8_reduce_scatter and not fp8_communication:
            raise ValueError("fp8_reduce_scatter=True needs fp8_communication=True")
        self.initial_scale, self.growth_interval = check_loss_scaling(initial_scale,
                                                                      growth_interval)
        self.reshard_after_forward, self.cpu_offload = reshard_after_forward, cpu_offload
        self.use_fp8, self.fp8_communication = use_fp8, fp8_communication
        self.fp8_reduce_scatter = fp8_reduce_scatter
        self.fp8_config = check_fp8_config(fp8_config)
        self.comm_config = check_comm_config(comm_config)
        self.fp8_report = None
        self.comm_report: dict = {}

    def __repr__(self) -> str:
        return (f"TorchFSDPPlugin(precision={self.precision!r}, use_fp8={self.use_fp8}, "
                f"fp8_communication={self.fp8_communication}, cpu_offload={self.cpu_offload})")
