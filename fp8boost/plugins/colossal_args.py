"""Colossal-AI plugin arguments that fp8boost takes for compatibility: validation and mapping.

One function per plugin (``gemini_args``; later plugins add theirs). Each checks the types,
raises ``ValueError`` naming the fp8boost alternative for what fp8boost does not support, and
logs once per process (``fp8boost._state.log_once``, INFO, key ``"colossal-args.<plugin>.<arg>"``)
what fp8boost does instead when a value that tunes Colossal-AI internals is passed.
"""
from __future__ import annotations

import logging

from fp8boost import _state

logger = logging.getLogger("fp8boost.plugins")


def _check_type(name: str, value: object, kinds: tuple[type, ...], what: str) -> None:
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise TypeError(f"{name} must be {what}, got {value!r}")


def _info(plugin: str, name: str, message: str) -> None:
    _state.log_once(logger, f"colossal-args.{plugin}.{name}", f"fp8boost: {message}",
                    level=logging.INFO)


def gemini_args(*, shard_param_frac: float, placement_policy: str, max_prefetch: int,
                enable_async_reduce: bool, warmup_non_model_data_ratio: float,
                enable_fused_normalization: bool, enable_flash_attention: bool,
                tp_size: int, extra_dp_size: int) -> None:
    """Validate Colossal-AI's extra ``GeminiPlugin`` arguments (no collectives)."""
    _check_type("shard_param_frac", shard_param_frac, (int, float), "a number")
    _check_type("placement_policy", placement_policy, (str,), '"static" or "auto"')
    _check_type("max_prefetch", max_prefetch, (int,), "an int >= 0")
    _check_type("enable_async_reduce", enable_async_reduce, (bool,), "True or False")
    _check_type("warmup_non_model_data_ratio", warmup_non_model_data_ratio, (int, float),
                "a number")
    _check_type("enable_fused_normalization", enable_fused_normalization, (bool,),
                "True or False")
    _check_type("enable_flash_attention", enable_flash_attention, (bool,), "True or False")
    _check_type("tp_size", tp_size, (int,), "an int >= 1")
    _check_type("extra_dp_size", extra_dp_size, (int,), "an int >= 1")
    if tp_size < 1 or extra_dp_size < 1:
        raise ValueError(f"tp_size and extra_dp_size must be >= 1, got tp_size={tp_size}, "
                         f"extra_dp_size={extra_dp_size}")
    if tp_size > 1 or extra_dp_size > 1:
        raise ValueError(
            f"GeminiPlugin(tp_size={tp_size}, extra_dp_size={extra_dp_size}): fp8boost's "
            "GeminiPlugin shards over all ranks (ZeRO-3) without tensor parallelism or an extra "
            "data-parallel group; use HybridParallelPlugin(tp_size=..., zero_stage=...) "
            "instead (tensor parallelism with ZeRO across the replicas)")
    if shard_param_frac != 1.0:
        raise ValueError(
            f"shard_param_frac={shard_param_frac}: fp8boost's GeminiPlugin shards every "
            "parameter (FSDP2, ZeRO-3) and cannot keep part of them replicated; use "
            "shard_param_frac=1.0, or LowLevelZeroPlugin for unsharded parameters")
    if placement_policy not in ("static", "auto"):
        raise ValueError(f'placement_policy must be "static" or "auto", got {placement_policy!r}')
    if max_prefetch < 0:
        raise ValueError(f"max_prefetch must be an int >= 0, got {max_prefetch!r}")
    if not 0.0 <= warmup_non_model_data_ratio <= 1.0:
        raise ValueError("warmup_non_model_data_ratio must be a number in [0, 1], got "
                         f"{warmup_non_model_data_ratio!r}")
    if placement_policy == "auto":
        _info("gemini", "placement_policy",
              'placement_policy="auto" is not used: fp8boost places parameters, gradients and '
              "optimizer state by offload_optim_frac/offload_param_frac (0.0: GPU, 1.0: CPU "
              "through FSDP2's CPUOffloadPolicy)")
    if max_prefetch != 0:
        _info("gemini", "max_prefetch",
              f"max_prefetch={max_prefetch} is not used: FSDP2 prefetches the next block's "
              "all-gather itself")
    if enable_async_reduce is not True:
        _info("gemini", "enable_async_reduce",
              "enable_async_reduce=False is not used: FSDP2's reduce-scatter always overlaps "
              "backward")
    if warmup_non_model_data_ratio != 0.8:
        _info("gemini", "warmup_non_model_data_ratio",
              f"warmup_non_model_data_ratio={warmup_non_model_data_ratio} is not used: it tunes "
              "Colossal-AI's auto placement; fp8boost places by the offload fractions")
    if enable_fused_normalization:
        _info("gemini", "enable_fused_normalization",
              "enable_fused_normalization=True changes nothing: fp8boost runs the model's own "
              "normalization layers")
    if enable_flash_attention:
        _info("gemini", "enable_flash_attention",
              "enable_flash_attention=True changes nothing: fp8boost runs the model's own "
              "attention (SDPA, which uses flash attention through PyTorch)")
