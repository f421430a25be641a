"""Colossal-AI's ``LowLevelZeroPlugin`` arguments over fp8boost's (validation and mapping)."""
from __future__ import annotations

from typing import Optional

import torch

from fp8boost import plugins

from .common import check_bools, check_comm_dtype, check_type, log_tuning, loss_scale_args, \
    takes_colossal_args


@takes_colossal_args(positional=("stage", "precision", "use_fp8", "fp8_communication"))
class LowLevelZeroPlugin(plugins.LowLevelZeroPlugin):
    """fp8boost's ``LowLevelZeroPlugin`` that also takes Colossal-AI's arguments (by keyword).

    Args:
        min_scale, growth_factor, backoff_factor, max_scale: fp16 loss scaling, as Colossal-AI
            (``hysteresis``: only 1 is implemented; other values log once under fp16).
        norm_type, communication_dtype, verbose, cast_inputs, extra_dp_size:
            :func:`low_level_zero_args`: ``norm_type`` must be 2.0, ``communication_dtype``
            None or the working dtype, ``cast_inputs`` True and ``extra_dp_size`` 1 (else
            ``ValueError`` naming the alternative); ``verbose`` tunes a Colossal-AI internal
            (INFO once).
        overlap_allgather: fp8boost's own option of that name (the post-step parameter
            all-gather overlapped with the next forward). Colossal-AI's defaults ``stage=1``,
            ``precision="fp16"``, ``initial_scale=2**32`` differ from fp8boost's (2,
            ``"bf16"``, 2**16: FP8 training wants BF16).
        **native: ``fp8boost.plugins.LowLevelZeroPlugin``'s arguments.
    """

    def __init__(self, *, norm_type: float = 2.0, min_scale: float = 1,
                 growth_factor: float = 2, backoff_factor: float = 0.5, hysteresis: int = 2,
                 max_scale: float = 2 ** 32, communication_dtype: Optional[torch.dtype] = None,
                 overlap_allgather: bool = False, verbose: bool = False, cast_inputs: bool = True,
                 extra_dp_size: int = 1, **native) -> None:
        super().__init__(overlap_allgather=overlap_allgather, **native)
        low_level_zero_args(precision=self.precision, norm_type=norm_type,
                            communication_dtype=communication_dtype, verbose=verbose,
                            cast_inputs=cast_inputs, extra_dp_size=extra_dp_size)
        self.loss_scale_kwargs = loss_scale_args(
            "low_level_zero", self.precision, min_scale=min_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, hysteresis=hysteresis, max_scale=max_scale)


def low_level_zero_args(*, precision: str, norm_type: float, communication_dtype: object,
                        verbose: bool, cast_inputs: bool, extra_dp_size: int) -> None:
    """Validate Colossal-AI's extra ``LowLevelZeroPlugin`` arguments (no collectives)."""
    check_type("norm_type", norm_type, (int, float), "a number")
    check_bools(verbose=verbose, cast_inputs=cast_inputs)
    check_type("extra_dp_size", extra_dp_size, (int,), "an int >= 1")
    if extra_dp_size < 1:
        raise ValueError(f"extra_dp_size must be an int >= 1, got {extra_dp_size!r}")
    if norm_type != 2.0:
        raise ValueError(f"norm_type={norm_type}: fp8boost's ZeRO clips by the L2 norm only; "
                         "use norm_type=2.0, or GeminiPlugin(norm_type=...) for other norms")
    if extra_dp_size > 1:
        raise ValueError(
            f"LowLevelZeroPlugin(extra_dp_size={extra_dp_size}): fp8boost's ZeRO shards over "
            "all data-parallel ranks; use extra_dp_size=1, or HybridParallelPlugin(tp_size=..., "
            "zero_stage=...) to shard over part of the ranks")
    if not cast_inputs:
        raise ValueError(
            "cast_inputs=False is not supported: fp8boost casts floating-point inputs to the "
            "working dtype of the parameters; use cast_inputs=True, or precision='fp32' to "
            "keep FP32 inputs")
    check_comm_dtype("low_level_zero", communication_dtype, precision)
    log_tuning("low_level_zero", [
        ("verbose", verbose, False,
         "fp8boost reports through the 'fp8boost' loggers (plugin.comm_report for FP8 comm)"),
    ])


