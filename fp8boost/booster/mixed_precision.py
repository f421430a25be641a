"""``Booster(mixed_precision=...)`` without a plugin: one process, no data parallelism.

* ``"fp32"`` / None: the model as is; the optimizer gets ``backward``/clipping only.
* ``"bf16"`` / ``"fp16"``: parameters cast to BF16/FP16, FP32 master weights kept by the
  optimizer wrapper (FP16 adds dynamic loss scaling); floating inputs are cast on the way in.
* ``"fp8"``: ``"bf16"`` plus ``convert_to_fp8`` (eligible linears run their GEMMs in FP8).
  On a machine without FP8 tensor cores the default ``Fp8Config(backend="auto")`` falls back
  to the emulated backend with a one-time warning.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost.fp8.backends import warn_once
from fp8boost.fp8.config import Fp8Config
from fp8boost.plugins.plugin_base import Boosted, Plugin, check_boost_args, default_device, \
    shard_dataloader
from fp8boost.plugins.precision import MIXED_PRECISIONS, check_fp8_config, check_max_norm, \
    check_precision, prepare_model, wrap_optimizer
from fp8boost.plugins.wrappers import DTYPES, ModelWrapper


@dataclass(frozen=True)
class MixedPrecision:
    """A mixed-precision choice for ``Booster`` with options a bare string cannot carry.

    Example:
        >>> from fp8boost.booster import Booster, MixedPrecision
        >>> from fp8boost.fp8 import Fp8Config
        >>> booster = Booster(mixed_precision=MixedPrecision("fp8", Fp8Config(backend="emulated")))
    """

    precision: str = "bf16"
    """"fp32", "bf16", "fp16" or "fp8" (see the module docstring)."""
    fp8_config: Optional[Fp8Config] = None
    """The FP8 recipe for ``"fp8"`` (default ``Fp8Config()``)."""
    max_norm: float = 0.0
    """Clip gradients to this global norm at every step (0 disables)."""
    fused_master_step: Optional[bool] = None
    """For ``"bf16"``/``"fp8"`` with ``torch.optim.AdamW`` (or ``Adam`` without coupled weight
    decay): update the FP32 master from the BF16 gradient and write the BF16 parameter in one
    kernel per tensor, skipping the two dtype copies of the two-pass master-weight step (1.08x
    a compiled 7B-shaped BF16 step on one H100, 1.09x FP8; BENCHMARKS.md 4f). None (default):
    wherever it applies, else the two-pass step without a word; True: a one-time warning says
    why when it cannot apply; False: always the two-pass step."""

    def __post_init__(self) -> None:
        check_precision(self.precision, MIXED_PRECISIONS)
        check_fp8_config(self.fp8_config)
        object.__setattr__(self, "max_norm", check_max_norm(self.max_norm))
        if self.fused_master_step is not None and not isinstance(self.fused_master_step, bool):
            raise TypeError("MixedPrecision.fused_master_step must be None, True or False, got "
                            f"{type(self.fused_master_step).__name__}")


class LocalPlugin(Plugin):
    """What ``Booster`` uses when no plugin is given (see module docstring)."""

    supported_precisions = MIXED_PRECISIONS

    def __init__(self, mixed_precision: MixedPrecision) -> None:
        self.mp = mixed_precision
        self.fp8_report = None

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

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None,
                  lr_scheduler=None, device=None) -> Boosted:
        check_boost_args(model, optimizer, criterion, dataloader, lr_scheduler)
        if dist.is_initialized() and dist.get_world_size() > 1:
            warn_once("booster_no_plugin_multiprocess",
                      "Booster without a plugin in a multi-process job: every process trains its "
                      "own replica (no gradient averaging); use TorchDDPPlugin or "
                      "LowLevelZeroPlugin for data parallelism")
        precision = "bf16" if self.mp.precision == "fp8" else self.mp.precision
        if optimizer is not None and precision != "fp32":
            from fp8boost.parallel.zero import ZeroOptimizer
            ZeroOptimizer.validate(optimizer)
        device = torch.device(device) if device is not None else default_device()
        self.fp8_report = prepare_model(model, precision, self.mp.precision == "fp8",
                                        self.mp.fp8_config, device)
        wrapped = ModelWrapper(model, DTYPES[precision])
        opt = wrap_optimizer(optimizer, precision, self.mp.max_norm,
                             fused_master_step=self.mp.fused_master_step)
        wrapped._fp8boost_optimizers = [opt] if opt is not None else []
        # One replica, with the plugins' sampler semantics (seeded, set_epoch; a loader with
        # its own sampler is kept as built).
        loader = shard_dataloader(dataloader, 1, 0)
        return wrapped, opt, criterion, loader, lr_scheduler
