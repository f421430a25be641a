"""LocalPlugin: what ``Booster`` trains with when no plugin is given (one process, no sharding).

It takes a ``MixedPrecision`` (``fp8boost.booster``): ``"fp8"`` is BF16 working weights plus
FP8 GEMMs (``use_fp8``); the other precisions are the shared plugin options as they are. Every
``configure`` step is the ``Plugin`` default but two: no process group is formed, and several
processes each training their own replica get a warning.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from fp8boost.fp8.backends import warn_once
from fp8boost.parallel.distributed import default_device

from .plugin_base import Plugin
from .precision import MIXED_PRECISIONS

if TYPE_CHECKING:
    from .mixed_precision import MixedPrecision


class LocalPlugin(Plugin):
    """One process: ``Booster(mixed_precision=...)`` without a plugin.

    Args:
        mixed_precision: the validated ``MixedPrecision`` the Booster was given.

    Example:
        >>> from fp8boost.booster import Booster
        >>> type(Booster(mixed_precision="bf16").plugin).__name__
        'LocalPlugin'
    """

    supported_precisions = MIXED_PRECISIONS

    def __init__(self, mixed_precision: "MixedPrecision") -> None:
        fp8 = mixed_precision.precision == "fp8"
        super().__init__(precision="bf16" if fp8 else mixed_precision.precision, use_fp8=fp8,
                         fp8_config=mixed_precision.fp8_config,
                         max_norm=mixed_precision.max_norm,
                         fused_lm_loss=mixed_precision.fused_lm_loss,
                         fused_norm=mixed_precision.fused_norm)
        self.mp = mixed_precision
        self.fused_master_step = mixed_precision.fused_master_step

    @property
    def dp_group(self):
        return None  # a single process: even under an initialised group, nothing is sharded

    @property
    def checkpoint_group(self):
        return None

    @property
    def dp_size(self) -> int:
        return 1

    @property
    def dp_rank(self) -> int:
        return 0

    def validate(self, model: nn.Module, optimizer) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            warn_once("booster_no_plugin_multiprocess",
                      "Booster without a plugin in a multi-process job: every process trains its "
                      "own replica (no gradient averaging); use TorchDDPPlugin or "
                      "LowLevelZeroPlugin for data parallelism")
        super().validate(model, optimizer)

    def setup_distributed(self, device) -> torch.device:
        return torch.device(device) if device is not None else default_device()
