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

from fp8boost.fp8.config import Fp8Config
from fp8boost.parallel.zero import DynamicLossScaler, ZeroOptimizer

from .wrappers import DTYPES, PRECISIONS, OptimizerWrapper, cast_params_

MIXED_PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


def check_precision(precision: object, allowed: tuple[str, ...] = PRECISIONS) -> str:
    if precision not in allowed:
        raise ValueError(f"precision={precision!r} is not supported; use one of {allowed} "
                         "(FP8 GEMMs are turned on with use_fp8=True on top of bf16)")
    return precision  # type: ignore[return-value]


def check_fp8_config(fp8_config: object) -> Optional[Fp8Config]:
    if fp8_config is not None and not isinstance(fp8_config, Fp8Config):
        raise TypeError(f"fp8_config must be an fp8boost.fp8.Fp8Config, got {type(fp8_config).__name__}")
    return fp8_config


def check_comm_config(comm_config: object):
    if comm_config is None:
        return None
    from fp8boost.parallel.comm.config import Fp8CommConfig
    if not isinstance(comm_config, Fp8CommConfig):
        raise TypeError("comm_config must be an fp8boost.parallel.comm.config.Fp8CommConfig, "
                        f"got {type(comm_config).__name__}")
    return comm_config


def check_max_norm(max_norm: object) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"max_norm must be a number >= 0 (0 disables clipping), got {max_norm!r}")
    return float(max_norm)


def prepare_model(model: nn.Module, precision: str, use_fp8: bool,
                  fp8_config: Optional[Fp8Config], device: torch.device):
    """Move to ``device``, cast params to ``precision``, convert linears to FP8 when asked.

    Returns the ``ConversionReport`` of the FP8 conversion (None without ``use_fp8``).
    """
    model.to(device)
    if precision != "fp32":
        cast_params_(model, DTYPES[precision])
    if not use_fp8:
        return None
    from fp8boost.fp8 import convert_to_fp8  # the FP8 layer is imported only when used
    from fp8boost.fp8.backends import warn_once

    report = convert_to_fp8(model, fp8_config)
    if not report.converted:
        # use_fp8=True that converts nothing must not pass for an FP8 run.
        reasons = sorted(set(report.skipped.values()))
        warn_once(f"fp8-nothing-converted-{reasons}",
                  "fp8boost: use_fp8=True but no linear layer was converted to FP8 "
                  f"({'; '.join(reasons) or 'the model has no nn.Linear'}). Pass "
                  "fp8_config=Fp8Config(min_numel=0) to convert small layers anyway.")
    return report


def make_loss_scaler(precision: str, initial_scale: float, growth_interval: int):
    return DynamicLossScaler(initial_scale, growth_interval=growth_interval) if precision == "fp16" else None


def wrap_optimizer(optimizer: Optional[torch.optim.Optimizer], precision: str, max_norm: float,
                   initial_scale: float = 2.0 ** 16, growth_interval: int = 1000,
                   fused_master_step: Optional[bool] = None):
    """Single-replica optimizer wrapper: FP32 master weights unless training in FP32.

    ``fused_master_step``: see ``MixedPrecision.fused_master_step`` (None: where it applies)."""
    if optimizer is None:
        return None
    if precision == "fp32":
        if fused_master_step:  # asked for explicitly: say why it cannot run
            from fp8boost import _state
            _state.warn_once("fused-master-step-fp32",
                             "fp8boost: fused_master_step=True does not apply (precision fp32 "
                             "keeps no master weights); using the plain optimizer step")
        return OptimizerWrapper(optimizer, max_norm=max_norm)
    return ZeroOptimizer(optimizer, dp_group=None, max_norm=max_norm,
                         loss_scaler=make_loss_scaler(precision, initial_scale, growth_interval),
                         fused_master_step=fused_master_step)
