"""Precision handling shared by the plugins (and by ``Booster(mixed_precision=...)``).

Mixed precision here is BF16/FP16 "O2": the model's parameters are cast to the low-precision
dtype and an FP32 master copy lives in the optimizer (``ZeroOptimizer``; with a single replica
it never communicates). ``use_fp8`` then swaps eligible ``nn.Linear`` layers for ``Fp8Linear``
("O1" FP8: only their GEMMs run in FP8), after the cast so FP8 scaling state stays FP32.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fp8boost import _state
from fp8boost.fp8 import convert_to_fp8
from fp8boost.fp8.config import Fp8Config
from fp8boost.parallel.wrappers import DTYPES, OptimizerWrapper, cast_buffers_, cast_params_
from fp8boost.parallel.zero import DynamicLossScaler, ZeroOptimizer


MIXED_PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


def move_and_cast(model: nn.Module, precision: str, device: torch.device) -> None:
    """Move ``model`` to ``device`` and cast its floating parameters and buffers to
    ``precision`` (buffers as :func:`~fp8boost.parallel.wrappers.cast_buffers_` says)."""
    model.to(device)
    if precision != "fp32":
        cast_params_(model, DTYPES[precision])
        cast_buffers_(model, DTYPES[precision])


def convert_model(model: nn.Module, use_fp8: bool, fp8_config: Optional[Fp8Config]):
    """``convert_to_fp8(model, fp8_config)`` when ``use_fp8`` (it warns once when nothing
    converted, saying why); its ``ConversionReport``, or None without ``use_fp8``."""
    if not use_fp8:
        return None
    return convert_to_fp8(model, fp8_config)


def prepare_model(model: nn.Module, precision: str, use_fp8: bool,
                  fp8_config: Optional[Fp8Config], device: torch.device):
    """Move to ``device``, cast params to ``precision``, convert linears to FP8 when asked.

    Returns the ``ConversionReport`` of the FP8 conversion (None without ``use_fp8``).
    """
    move_and_cast(model, precision, device)
    return convert_model(model, use_fp8, fp8_config)


def validate_optimizer(optimizer: Optional[torch.optim.Optimizer], precision: str) -> None:
    """What ``wrap_optimizer`` needs of ``optimizer``, checked before anything moves: the
    master-weight wrapper (any precision but fp32) takes ``ZeroOptimizer``'s optimizers."""
    if optimizer is not None and precision != "fp32":
        ZeroOptimizer.validate(optimizer)


def make_loss_scaler(precision: str, initial_scale: float, growth_interval: int,
                     **extra: float) -> Optional[DynamicLossScaler]:
    """The fp16 ``DynamicLossScaler`` (None under any other precision).

    ``extra``: more ``DynamicLossScaler`` keywords (``min_scale``, ``growth_factor``,
    ``backoff_factor``, ``max_scale``), e.g. a plugin's ``loss_scale_kwargs``.
    """
    if precision != "fp16":
        return None
    return DynamicLossScaler(initial_scale, growth_interval=growth_interval, **extra)


def wrap_optimizer(optimizer: Optional[torch.optim.Optimizer], precision: str, max_norm: float,
                   initial_scale: float = 2.0 ** 16, growth_interval: int = 1000,
                   fused_master_step: Optional[bool] = None):
    """Single-replica optimizer wrapper: FP32 master weights unless training in FP32.

    ``fused_master_step``: see ``MixedPrecision.fused_master_step`` (None: where it applies)."""
    if optimizer is None:
        return None
    if precision == "fp32":
        if fused_master_step:  # asked for explicitly: say why it cannot run
            _state.warn_once("fused-master-step-fp32",
                             "fp8boost: fused_master_step=True does not apply (precision fp32 "
                             "keeps no master weights); using the plain optimizer step")
        return OptimizerWrapper(optimizer, max_norm=max_norm)
    return ZeroOptimizer(optimizer, dp_group=None, max_norm=max_norm,
                         loss_scaler=make_loss_scaler(precision, initial_scale, growth_interval),
                         fused_master_step=fused_master_step)
