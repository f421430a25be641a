"""Colossal-AI's ``HybridParallelPlugin`` arguments over fp8boost's: validation and mapping.

:func:`hybrid_args` checks the arguments fp8boost's ``HybridParallelPlugin`` does not take
(``MoeHybridParallelPlugin`` shares them: :mod:`.moe`); :class:`HybridParallelPlugin` takes
them by keyword and hands the mapped values to fp8boost's plugin.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from fp8boost import plugins
from fp8boost.plugins.grad_ckpt import check_ckpt_config

from .common import LOSS_SCALE_DEFAULTS, SHARDFORMER_TUNING, check_bools, check_comm_dtype, \
    check_type, log_info, log_tuning, loss_scale_args, map_fused_norm, pick, \
    takes_colossal_args, tuning_rows


@dataclass(frozen=True, kw_only=True)
class HybridColossalArgs:
    """What ``hybrid_args`` maps Colossal-AI's ``HybridParallelPlugin`` arguments to."""

    reduce_bucket_size_in_m: Optional[float] = None
    """ZeRO bucket size (``zero_bucket_size_in_m`` or ``reduce_bucket_size_in_m``)."""
    loss_scale: Any = None
    """``DynamicLossScaler`` keywords from ``min_scale``/``growth_factor``/... (fp16 only)."""
    gradient_checkpoint_config: Any = None
    """The ``GradientCheckpointConfig`` applied at ``boost`` (``fp8boost/plugins/grad_ckpt.py``)."""


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
    (``MoeHybridParallelPlugin`` shares these arguments: :mod:`.moe`).
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
    bucket = zero_bucket(reduce_bucket_size_in_m, zero_bucket_size_in_m)
    check_comm_dtype(plugin, communication_dtype, precision)
    if not parallel_output and tp_size > 1:
        raise ValueError(
            "parallel_output=False (gather the logits over tp) is not supported: the model's "
            "logits stay this rank's vocabulary slice and the HF loss is computed from the "
            "slices; use parallel_output=True (the default) or tp_size=1")
    _check_scheduler_nodes(scheduler_nodes, pp_size, pp_style, plugin)
    ckpt = check_ckpt_config(gradient_checkpoint_config)
    _hybrid_tuning(tuning, make_vocab_size_divisible_by, inner_ring_size, plugin)
    return HybridColossalArgs(reduce_bucket_size_in_m=bucket, loss_scale=loss_scale,
                              gradient_checkpoint_config=ckpt)


def zero_bucket(reduce_bucket_size_in_m, zero_bucket_size_in_m) -> Optional[float]:
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


def _hybrid_tuning(t: dict, vocab_div: int, inner_ring_size: Optional[int],
                   plugin: str = "hybrid") -> None:
    log_tuning(plugin, tuning_rows(t, SHARDFORMER_TUNING) + [
        ("enable_sequence_overlap", t["enable_sequence_overlap"], False,
         "sequence-parallel collectives are issued in order, not overlapped"),
        ("enable_metadata_cache", t["enable_metadata_cache"], True,
         "torch.distributed.pipelining stages learn the P2P shapes once; there is no metadata "
         "cache to switch"),
        ("overlap_p2p", t["overlap_p2p"], True,
         "torch.distributed.pipelining issues the stage P2P itself"),
        # HybridParallelPlugin passes overlap_allgather on (fp8boost's own option); the MoE
        # plugin logs it.
        ("overlap_allgather", t.get("overlap_allgather", False), False,
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


# Colossal-AI's switches of its own internals that HybridParallelPlugin takes (hybrid_args logs
# what fp8boost does instead of each non-default one).
TUNING_NAMES = ("enable_all_optimization", "enable_fused_normalization", "enable_flash_attention",
                "enable_jit_fused", "enable_sequence_overlap", "broadcast_buffers",
                "ddp_bucket_cap_mb", "find_unused_parameters", "check_reduction",
                "gradient_as_bucket_view", "static_graph", "enable_metadata_cache", "dp_outside",
                "overlap_p2p")


@takes_colossal_args(positional=("tp_size", "pp_size", "precision", "zero_stage",
                                 "enable_sequence_parallelism", "sequence_parallelism_mode",
                                 "max_norm", "custom_policy", "use_fp8", "fp8_communication",
                                 "fp8_config"))
class HybridParallelPlugin(plugins.HybridParallelPlugin):
    """fp8boost's ``HybridParallelPlugin`` that also takes Colossal-AI's arguments (by keyword).

    ``plugin.colossal`` holds what they map to (:class:`HybridColossalArgs`).

    Args:
        zero_bucket_size_in_m: Colossal-AI's name of ``reduce_bucket_size_in_m`` (default None:
            fp8boost's 12, or 64 with FP8 communication). communication_dtype: None or the
            working dtype (another dtype raises: use ``fp8_communication``).
        min_scale, growth_factor, backoff_factor, max_scale: fp16 loss scaling, as Colossal-AI;
            hysteresis: only 1 is implemented (other values: INFO under fp16).
        scheduler_nodes: accepted with ``pp_style="zbv"`` but not replayed: torch's ZBV
            schedule runs (INFO; ``fp8boost.colossal.pipeline.schedule.v_schedule``).
        parallel_output: True (logits stay vocabulary-parallel); False raises with tp_size > 1.
        overlap_allgather: fp8boost's own option of that name (ZeRO's post-step all-gather
            overlapped with the next forward; zero_stage 1 or 2, pp_size=1).
        enable_all_optimization, enable_fused_normalization, enable_flash_attention,
            enable_jit_fused, enable_sequence_overlap, enable_metadata_cache, overlap_p2p,
            dp_outside, make_vocab_size_divisible_by, inner_ring_size,
            broadcast_buffers, ddp_bucket_cap_mb, find_unused_parameters, check_reduction,
            gradient_as_bucket_view, static_graph: Colossal-AI's tuning of its own internals
            (Shardformer kernels, its P2P, DDP): accepted; a non-default value logs once what
            fp8boost does instead (:func:`hybrid_args`).
        **native: ``fp8boost.plugins.HybridParallelPlugin``'s arguments.
    """

    def __init__(self, *, enable_all_optimization: bool = False,
                 enable_fused_normalization: bool = False, enable_flash_attention: bool = False,
                 enable_jit_fused: bool = False, enable_sequence_overlap: bool = False,
                 parallel_output: bool = True, min_scale: float = 1, growth_factor: float = 2,
                 backoff_factor: float = 0.5, hysteresis: int = 2, max_scale: float = 2 ** 32,
                 broadcast_buffers: bool = True, ddp_bucket_cap_mb: int = 25,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 zero_bucket_size_in_m: Optional[float] = None,
                 communication_dtype: Optional[torch.dtype] = None, scheduler_nodes=None,
                 enable_metadata_cache: bool = True, make_vocab_size_divisible_by: int = 64,
                 dp_outside: bool = True, overlap_p2p: bool = True,
                 overlap_allgather: bool = False, inner_ring_size: Optional[int] = None,
                 **native) -> None:
        args = locals()  # this call's Colossal-AI arguments, handed on by name (pick)
        map_fused_norm("hybrid", native, enable_fused_normalization, enable_all_optimization)
        reduce_bucket_size_in_m = native["reduce_bucket_size_in_m"]
        native["reduce_bucket_size_in_m"] = zero_bucket(reduce_bucket_size_in_m,
                                                        zero_bucket_size_in_m)
        super().__init__(overlap_allgather=overlap_allgather, **native)
        self.colossal = hybrid_args(
            tp_size=native["tp_size"], pp_size=native["pp_size"], pp_style=native["pp_style"],
            precision=self.precision, reduce_bucket_size_in_m=reduce_bucket_size_in_m,
            zero_bucket_size_in_m=zero_bucket_size_in_m, communication_dtype=communication_dtype,
            scheduler_nodes=scheduler_nodes,
            gradient_checkpoint_config=native["gradient_checkpoint_config"],
            parallel_output=parallel_output,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            inner_ring_size=inner_ring_size,
            loss_scale=loss_scale_args("hybrid", self.precision,
                                       **pick(args, LOSS_SCALE_DEFAULTS)),
            tuning=pick(args, TUNING_NAMES))
        self.loss_scale_kwargs = self.colossal.loss_scale
