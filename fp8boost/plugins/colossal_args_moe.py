"""Colossal-AI's ``MoeHybridParallelPlugin`` arguments: validation and mapping (no collectives).

Colossal-AI v0.5.0's ``MoeHybridParallelPlugin`` takes ``HybridParallelPlugin``'s arguments
(less ``enable_sequence_overlap``, ``dp_outside``, ``inner_ring_size``) plus ``ep_size`` and
``moe_dp_outside``. The shared ones are checked, mapped or logged by the same code as
``HybridParallelPlugin``'s (:func:`~fp8boost.plugins.colossal_args.hybrid_args`, the sequence-
and pipeline-argument checks), under the log-key prefix ``colossal-args.moe_hybrid``; this
module adds what differs for expert parallelism:

* ``enable_sequence_parallelism=True`` raises a ``ValueError`` (not implemented with
  experts: ``HybridParallelPlugin`` keeps MoE blocks whole on its tp ranks and runs SP for
  MoE models);
* ``pp_size > 1`` takes ``HybridParallelPlugin``'s pipeline rules (``check_pipeline_args``:
  zero_stage <= 1, one of num_microbatches / microbatch_size, the pp_style rules), less
  ``pp_style="zbv"`` (``ValueError``: its split weight-gradient pass fails through the expert
  dispatch);
* ``moe_dp_outside=False`` is accepted: it moves the pipeline axis outside the moe-dp axis
  (``ParallelDims``' ``moe_dp_outside``), so with ``pp_size=1`` its rank layout is
  ``moe_dp_outside=True``'s;
* ``overlap_communication=True`` logs once: gradients are reduced after the backward
  (Colossal-AI turns it off for MoE as well, because unrouted experts would hang it);
* the pipeline options (``num_microbatches`` ...) are ignored at ``pp_size=1`` with one INFO
  line, as in ``HybridParallelPlugin`` and Colossal-AI.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from fp8boost.parallel.pipeline.hybrid import check_pipeline_args
from fp8boost.parallel.sp.setup import check_sp_args

from .colossal_args import check_bools, hybrid_args, log_info

PLUGIN = "moe_hybrid"  # log keys: colossal-args.moe_hybrid.<argument>
NOT_IMPLEMENTED = "MoeHybridParallelPlugin runs dp x pp x ep x tp (no sequence parallelism)"


@dataclass(frozen=True, kw_only=True)
class MoeColossalArgs:
    """What :func:`moe_args` maps Colossal-AI's ``MoeHybridParallelPlugin`` arguments to."""

    reduce_bucket_size_in_m: Optional[float] = None
    """ZeRO bucket size in millions of elements (``zero_bucket_size_in_m``; None: fp8boost's)."""
    loss_scale: Any = None
    """``DynamicLossScaler`` keywords from ``min_scale``/``growth_factor``/... (fp16 only)."""
    gradient_checkpoint_config: Any = None
    """The ``GradientCheckpointConfig`` applied at ``boost`` (``plugins/grad_ckpt.py``)."""
    pipeline: Any = None
    """``parallel.pipeline.hybrid.PipelineOptions`` (None when ``pp_size == 1``)."""


def check_moe_layout(*, tp_size: int, pp_size: int, ep_size: int, zero_stage: int,
                     moe_dp_outside: bool) -> None:
    """Sizes and layout: positive ints, ZeRO 0/1/2 (before any collective).

    Raises:
        ValueError: a bad size or ``zero_stage`` outside 0/1/2.
        TypeError: ``moe_dp_outside`` is not a bool.
    """
    for name, value in (("tp_size", tp_size), ("pp_size", pp_size), ("ep_size", ep_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2):
        raise ValueError(f"MoeHybridParallelPlugin: zero_stage must be 0, 1 or 2, got "
                         f"{zero_stage!r}")
    check_bools(moe_dp_outside=moe_dp_outside)


def moe_args(*, tp_size: int, pp_size: int, sp_size: Optional[int], precision: str,
             zero_stage: int, enable_sequence_parallelism: bool,
             sequence_parallelism_mode: Optional[str], parallel_output: bool,
             pipeline: dict, zero_bucket_size_in_m: Optional[float], communication_dtype: object,
             scheduler_nodes: object, gradient_checkpoint_config: object,
             make_vocab_size_divisible_by: int, overlap_communication: bool, cpu_offload: bool,
             loss_scale: dict, tuning: dict) -> MoeColossalArgs:
    """Validate Colossal-AI's extra ``MoeHybridParallelPlugin`` arguments (no collectives).

    Args:
        pipeline: ``num_microbatches``, ``microbatch_size``, ``pp_style``,
            ``num_model_chunks``, ``num_layers_per_stage`` (ignored at ``pp_size=1``: INFO;
            checked as ``HybridParallelPlugin``'s otherwise).
        loss_scale: the fp16 loss-scaling keywords (``colossal_args.loss_scale_args``).
        tuning: the arguments that only tune Colossal-AI internals, by name (INFO when not
            their default; ``HybridParallelPlugin``'s messages).

    Raises:
        ValueError: sequence parallelism (any mode), bad pipeline options, ``pp_style="zbv"``,
            or what ``hybrid_args`` refuses.
    """
    check_bools(enable_sequence_parallelism=enable_sequence_parallelism,
                overlap_communication=overlap_communication, cpu_offload=cpu_offload)
    # HybridParallelPlugin's rules first (a bad mode names its own fix), then the MoE refusal.
    check_sp_args(enable_sequence_parallelism, sequence_parallelism_mode, sp_size, tp_size,
                  pp_size, plugin="MoeHybridParallelPlugin")
    if enable_sequence_parallelism:
        raise ValueError(
            "MoeHybridParallelPlugin(enable_sequence_parallelism=True): sequence parallelism "
            f"with expert parallelism is not implemented ({NOT_IMPLEMENTED}); use "
            "enable_sequence_parallelism=False, or HybridParallelPlugin with sequence "
            "parallelism (MoE blocks whole on every rank)")
    # pp_size=1: INFO if pipeline options are given; else HybridParallelPlugin's rules
    pipeline_options = check_pipeline_args(pp_size, zero_stage, **pipeline)
    if pipeline_options is not None and pipeline_options.pp_style == "zbv":
        # torch's ZBV splits each backward into an input and a weight pass; through the
        # expert dispatch (EpExperts) the weight pass meets freed saved tensors (measured:
        # RuntimeError "backward through the graph a second time", at ep_size 1 and 2)
        raise ValueError("MoeHybridParallelPlugin(pp_style='zbv') is not supported: the "
                         "zero-bubble schedule's split weight-gradient pass fails through the "
                         "expert dispatch; use pp_style='1f1b' or 'interleaved'")
    if overlap_communication:
        log_info(PLUGIN, "overlap_communication",
                 "overlap_communication=True is not used: MoeHybridParallelPlugin reduces "
                 "gradients after the backward, not overlapped with it (Colossal-AI's MoE plugin "
                 "turns it off as well: experts that get no token would hang the overlap)")
    mapped = hybrid_args(
        tp_size=tp_size, pp_size=pp_size, pp_style=pipeline["pp_style"], precision=precision,
        reduce_bucket_size_in_m=None, zero_bucket_size_in_m=zero_bucket_size_in_m,
        communication_dtype=communication_dtype, scheduler_nodes=scheduler_nodes,
        gradient_checkpoint_config=gradient_checkpoint_config, parallel_output=parallel_output,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, inner_ring_size=None,
        loss_scale=loss_scale, plugin=PLUGIN,
        tuning=dict(enable_sequence_overlap=False, dp_outside=True, **tuning))
    return MoeColossalArgs(reduce_bucket_size_in_m=mapped.reduce_bucket_size_in_m,
                           loss_scale=mapped.loss_scale,
                           gradient_checkpoint_config=mapped.gradient_checkpoint_config,
                           pipeline=pipeline_options)
