"""Colossal-AI plugin arguments that fp8boost takes for compatibility: validation and mapping.

One function per plugin (``hybrid_args``, ``low_level_zero_args``, ``ddp_args``;
``GeminiPlugin``'s: ``colossal_args_gemini.gemini_args``; ``TorchFSDPPlugin``'s FSDP1 objects:
``colossal_args_fsdp``; ``MoeHybridParallelPlugin``'s: ``colossal_args_moe.moe_args``, which
reuses ``hybrid_args``). Each checks the types,
raises ``ValueError`` naming the fp8boost alternative for what fp8boost does not support, and
logs once per process (``fp8boost._state.log_once``, INFO, key ``"colossal-args.<plugin>.<arg>"``)
what fp8boost does instead when a value that tunes Colossal-AI internals is passed.
"""
from __future__ import annotations

import logging

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

import torch

from fp8boost import _state
from fp8boost.parallel.zero.loss_scaler import DynamicLossScaler

from .grad_ckpt_config import GradientCheckpointConfig

logger = logging.getLogger("fp8boost.plugins")


def check_type(name: str, value: object, kinds: tuple[type, ...], what: str) -> None:
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise TypeError(f"{name} must be {what}, got {value!r}")


def log_info(plugin: str, name: str, message: str) -> None:
    _state.log_once(logger, f"colossal-args.{plugin}.{name}", f"fp8boost: {message}",
                    level=logging.INFO)


# ------------------------------------------------------------------------- loss scaling
LOSS_SCALE_DEFAULTS = MappingProxyType({"min_scale": 1.0, "growth_factor": 2.0,
                                        "backoff_factor": 0.5, "hysteresis": 2,
                                        "max_scale": 2.0 ** 32})
"""Colossal-AI's fp16 dynamic loss scaling arguments and defaults (both plugins)."""


def loss_scale_args(plugin: str, precision: str, *, min_scale: float, growth_factor: float,
                    backoff_factor: float, hysteresis: int, max_scale: float) -> dict:
    """Check Colossal-AI's loss-scaling arguments; returns the ``DynamicLossScaler`` keywords.

    They matter only under ``precision="fp16"`` (Colossal-AI ignores them otherwise, and so
    does fp8boost, silently at the defaults). ``hysteresis`` is not implemented: fp8boost backs
    the scale off at every overflow (``hysteresis=1``), said once under fp16 otherwise.
    """
    for name, value in (("min_scale", min_scale), ("growth_factor", growth_factor),
                        ("backoff_factor", backoff_factor), ("max_scale", max_scale)):
        check_type(name, value, (int, float), "a number")
    check_type("hysteresis", hysteresis, (int,), "an int >= 1")
    if hysteresis < 1:
        raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")
    if not growth_factor > 1.0:
        raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
    if not 0.0 < min_scale <= max_scale:
        raise ValueError(f"need 0 < min_scale <= max_scale, got min_scale={min_scale!r}, "
                         f"max_scale={max_scale!r}")
    given = dict(min_scale=min_scale, growth_factor=growth_factor,
                 backoff_factor=backoff_factor, hysteresis=hysteresis, max_scale=max_scale)
    changed = [n for n, v in given.items() if v != LOSS_SCALE_DEFAULTS[n]]
    if precision != "fp16":
        if changed:
            log_info(plugin, "loss-scale", f"{changed} not used: dynamic loss scaling runs only "
                  f"with precision='fp16' (precision={precision!r}), as in Colossal-AI")
        return {}
    if hysteresis != 1:
        log_info(plugin, "hysteresis", f"hysteresis={hysteresis} is not used: fp8boost's "
              "DynamicLossScaler backs the scale off at every overflow (hysteresis=1); the "
              "overflowing step is skipped either way")
    return dict(min_scale=float(min_scale), growth_factor=float(growth_factor),
                backoff_factor=float(backoff_factor), max_scale=float(max_scale))


def make_scaler(precision: str, initial_scale: float, growth_interval: int, extra: dict):
    """The fp16 ``DynamicLossScaler`` with Colossal-AI's mapped arguments (None otherwise)."""
    if precision != "fp16":
        return None
    return DynamicLossScaler(initial_scale, growth_interval=growth_interval, **extra)


def _check_comm_dtype(plugin: str, communication_dtype: object, precision: str) -> None:
    if communication_dtype is None:
        return
    if not isinstance(communication_dtype, torch.dtype):
        raise TypeError(f"communication_dtype must be a torch.dtype or None, got "
                        f"{communication_dtype!r}")
    working = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    if communication_dtype != working:
        raise ValueError(
            f"communication_dtype={communication_dtype} differs from precision={precision!r}: "
            "fp8boost's ZeRO communicates in the working dtype; use communication_dtype=None, "
            "or fp8_communication=True to put FP8 on the wire")
    log_info(plugin, "communication_dtype", f"communication_dtype={communication_dtype} is the "
          "working dtype, which fp8boost's ZeRO communicates in anyway")


def check_bools(**values: object) -> None:
    for name, value in values.items():
        check_type(name, value, (bool,), "True or False")


def log_tuning(plugin: str, rows) -> None:
    """INFO once for each (name, value, default, what fp8boost does) whose value is not the
    default."""
    for name, value, default, instead in rows:
        if value != default:
            log_info(plugin, name, f"{name}={value!r} is not used: {instead}")


# ------------------------------------------------------------------------------- hybrid
@dataclass(frozen=True, kw_only=True)
class HybridColossalArgs:
    """What ``hybrid_args`` maps Colossal-AI's ``HybridParallelPlugin`` arguments to."""

    reduce_bucket_size_in_m: Optional[float] = None
    """ZeRO bucket size (``zero_bucket_size_in_m`` or ``reduce_bucket_size_in_m``)."""
    loss_scale: Any = None
    """``DynamicLossScaler`` keywords from ``min_scale``/``growth_factor``/... (fp16 only)."""
    gradient_checkpoint_config: Any = None
    """The ``GradientCheckpointConfig`` applied at ``boost`` (``plugins/grad_ckpt.py``)."""


_DDP_INSTEAD = ("the plugin does not wrap the model in DDP: its ZeRO optimizer (stage 0 "
                "included) reduces gradients over dp itself")


def hybrid_args(*, tp_size: int, pp_size: int, pp_style: str, precision: str,
                reduce_bucket_size_in_m: Optional[float], zero_bucket_size_in_m: Optional[float],
                communication_dtype: object, scheduler_nodes: object,
                gradient_checkpoint_config: object, parallel_output: bool,
                make_vocab_size_divisible_by: int, inner_ring_size: Optional[int],
                loss_scale: dict, tuning: dict, plugin: str = "hybrid") -> HybridColossalArgs:
    """Validate Colossal-AI's extra ``HybridParallelPlugin`` arguments (no collectives).

    ``tuning`` holds the booleans that only tune Colossal-AI internals, by name
    (``enable_all_optimization`` ... ``overlap_allgather``, DDP's options); ``loss_scale``
    the fp16 loss-scaling arguments (``loss_scale_args``). ``plugin``: the log-key prefix
    (``MoeHybridParallelPlugin`` shares these arguments: ``colossal_args_moe``).
    """
    check_bools(parallel_output=parallel_output, **{k: v for k, v in tuning.items()
                                                     if k != "ddp_bucket_cap_mb"})
    check_type("ddp_bucket_cap_mb", tuning["ddp_bucket_cap_mb"], (int, float), "a number > 0")
    check_type("make_vocab_size_divisible_by", make_vocab_size_divisible_by, (int,),
                "an int >= 1")
    if make_vocab_size_divisible_by < 1:
        raise ValueError("make_vocab_size_divisible_by must be an int >= 1, got "
                         f"{make_vocab_size_divisible_by!r}")
    if inner_ring_size is not None:
        check_type("inner_ring_size", inner_ring_size, (int,), "an int >= 1 or None")
        if inner_ring_size < 1:
            raise ValueError(f"inner_ring_size must be an int >= 1 or None, got {inner_ring_size}")
    bucket = _zero_bucket(reduce_bucket_size_in_m, zero_bucket_size_in_m)
    _check_comm_dtype(plugin, communication_dtype, precision)
    if not parallel_output and tp_size > 1:
        raise ValueError(
            "parallel_output=False (gather the logits over tp) is not supported: the model's "
            "logits stay this rank's vocabulary slice and the HF loss is computed from the "
            "slices; use parallel_output=True (the default) or tp_size=1")
    _check_scheduler_nodes(scheduler_nodes, pp_size, pp_style, plugin)
    ckpt = _check_ckpt_config(gradient_checkpoint_config)
    _hybrid_tuning(tuning, make_vocab_size_divisible_by, inner_ring_size, plugin)
    return HybridColossalArgs(reduce_bucket_size_in_m=bucket, loss_scale=loss_scale,
                              gradient_checkpoint_config=ckpt)


def _zero_bucket(reduce_bucket_size_in_m, zero_bucket_size_in_m) -> Optional[float]:
    if zero_bucket_size_in_m is None:
        return reduce_bucket_size_in_m
    if reduce_bucket_size_in_m is not None and reduce_bucket_size_in_m != zero_bucket_size_in_m:
        raise ValueError(f"zero_bucket_size_in_m={zero_bucket_size_in_m} and "
                         f"reduce_bucket_size_in_m={reduce_bucket_size_in_m} are two names for "
                         "the ZeRO bucket size: pass one")
    return zero_bucket_size_in_m


def _check_scheduler_nodes(nodes: object, pp_size: int, pp_style: str,
                           plugin: str = "hybrid") -> None:
    if nodes is None:
        return
    if not isinstance(nodes, (list, tuple)):
        raise TypeError("scheduler_nodes must be a list (one list of schedule nodes per stage, "
                        f"PipelineGraph.get_v_schedule()) or None, got {type(nodes).__name__}")
    if pp_size > 1 and pp_style == "zbv":
        log_info(plugin, "scheduler_nodes",
              "scheduler_nodes are not replayed: fp8boost runs torch.distributed.pipelining's "
              "ZBV schedule (ScheduleZBVZeroBubble: the same zero-bubble V placement, its own "
              "F/B/W order)")
    else:
        log_info(plugin, "scheduler_nodes", "scheduler_nodes are ignored: they are used only "
              "with pp_size > 1 and pp_style='zbv' (as in Colossal-AI)")


def _check_ckpt_config(config: object):
    if config is None:
        return None
    if not isinstance(config, GradientCheckpointConfig):
        raise TypeError("gradient_checkpoint_config must be a fp8boost.colossal.shardformer."
                        "(Pipeline)GradientCheckpointConfig or None, got "
                        f"{type(config).__name__}")
    return config


def _hybrid_tuning(t: dict, vocab_div: int, inner_ring_size: Optional[int],
                   plugin: str = "hybrid") -> None:
    model_own = "fp8boost runs the model's own modules (SDPA attention, its normalization)"
    log_tuning(plugin, [
        ("enable_all_optimization", t["enable_all_optimization"], False, model_own),
        ("enable_fused_normalization", t["enable_fused_normalization"], False,
         "fp8boost runs the model's own normalization layers"),
        ("enable_flash_attention", t["enable_flash_attention"], False,
         "fp8boost runs the model's own attention (SDPA, which uses flash attention through "
         "PyTorch)"),
        ("enable_jit_fused", t["enable_jit_fused"], False, model_own),
        ("enable_sequence_overlap", t["enable_sequence_overlap"], False,
         "sequence-parallel collectives are issued in order, not overlapped"),
        ("enable_metadata_cache", t["enable_metadata_cache"], True,
         "torch.distributed.pipelining stages learn the P2P shapes once; there is no metadata "
         "cache to switch"),
        ("overlap_p2p", t["overlap_p2p"], True,
         "torch.distributed.pipelining issues the stage P2P itself"),
        ("overlap_allgather", t["overlap_allgather"], False,
         "the ZeRO parameter all-gather runs after the step, not overlapped with the next "
         "forward"),
        ("dp_outside", t["dp_outside"], True,
         "fp8boost lays ranks out (dp, pp, tp) with dp outermost"),
        ("make_vocab_size_divisible_by", vocab_div, 64,
         "fp8boost does not pad the vocabulary (embedding and lm_head keep the model's size, "
         "which tp_size must divide)"),
        ("inner_ring_size", inner_ring_size, None,
         "it shapes Colossal-AI's 2D ring attention only"),
        ("broadcast_buffers", t["broadcast_buffers"], True, _DDP_INSTEAD),
        ("ddp_bucket_cap_mb", t["ddp_bucket_cap_mb"], 25, _DDP_INSTEAD),
        ("find_unused_parameters", t["find_unused_parameters"], False, _DDP_INSTEAD),
        ("check_reduction", t["check_reduction"], False, _DDP_INSTEAD),
        ("gradient_as_bucket_view", t["gradient_as_bucket_view"], False, _DDP_INSTEAD),
        ("static_graph", t["static_graph"], False, _DDP_INSTEAD),
    ])


# ----------------------------------------------------------------------- low level zero
def low_level_zero_args(*, precision: str, norm_type: float, communication_dtype: object,
                        overlap_allgather: bool, verbose: bool, cast_inputs: bool,
                        extra_dp_size: int) -> None:
    """Validate Colossal-AI's extra ``LowLevelZeroPlugin`` arguments (no collectives)."""
    check_type("norm_type", norm_type, (int, float), "a number")
    check_bools(overlap_allgather=overlap_allgather, verbose=verbose, cast_inputs=cast_inputs)
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
    _check_comm_dtype("low_level_zero", communication_dtype, precision)
    log_tuning("low_level_zero", [
        ("overlap_allgather", overlap_allgather, False,
         "the ZeRO parameter all-gather runs after the step, not overlapped with the next "
         "forward"),
        ("verbose", verbose, False,
         "fp8boost reports through the 'fp8boost' loggers (plugin.comm_report for FP8 comm)"),
    ])


# -------------------------------------------------------------------------------- ddp
def ddp_args(*, check_reduction: bool) -> None:
    """Validate Colossal-AI's extra ``TorchDDPPlugin`` arguments (no collectives)."""
    check_bools(check_reduction=check_reduction)
    log_tuning("ddp", [("check_reduction", check_reduction, False,
                     "torch's DistributedDataParallel deprecated it and ignores it")])
