"""Colossal-AI's ``MoeHybridParallelPlugin`` arguments over fp8boost's: validation and mapping.

Colossal-AI v0.5.0's ``MoeHybridParallelPlugin`` takes ``HybridParallelPlugin``'s arguments
(less ``enable_sequence_overlap``, ``dp_outside``, ``inner_ring_size``) plus ``ep_size`` and
``moe_dp_outside``. The shared ones are checked, mapped or logged by the same code as
``HybridParallelPlugin``'s (:func:`.hybrid.hybrid_args`, the sequence-parallel
checks), under the log-key prefix ``colossal-args.moe_hybrid``; this module adds what differs
for expert parallelism (fp8boost's plugin checks the sizes and the pipeline options itself):

* ``enable_sequence_parallelism=True`` raises a ``ValueError`` (not implemented with
  experts: ``HybridParallelPlugin`` keeps MoE blocks whole on its tp ranks and runs SP for
  MoE models);
* ``moe_dp_outside=False`` is accepted: it moves the pipeline axis outside the moe-dp axis
  (``ParallelDims``' ``moe_dp_outside``), so with ``pp_size=1`` its rank layout is
  ``moe_dp_outside=True``'s;
* ``overlap_communication=True`` logs once: gradients are reduced after the backward
  (Colossal-AI turns it off for MoE as well, because unrouted experts would hang it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from fp8boost import plugins
from fp8boost.parallel.sp.setup import check_sp_args

from .common import LOSS_SCALE_DEFAULTS, check_bools, log_info, loss_scale_args, \
    map_fused_norm, pick, takes_colossal_args
from .hybrid import TUNING_NAMES, hybrid_args, zero_bucket

# The MoE plugin has neither sequence overlap nor a dp_outside switch (moe_args fixes both).
MOE_TUNING_NAMES = tuple(n for n in TUNING_NAMES if n not in ("enable_sequence_overlap",
                                                              "dp_outside")) + (
    "overlap_allgather",)  # the hybrid plugin takes it as its own option; here: logged

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
    """The ``GradientCheckpointConfig`` applied at ``boost`` (``fp8boost/plugins/grad_ckpt.py``)."""


def moe_args(*, tp_size: int, pp_size: int, pp_style: str, sp_size: Optional[int],
             precision: str, enable_sequence_parallelism: bool,
             sequence_parallelism_mode: Optional[str], parallel_output: bool,
             zero_bucket_size_in_m: Optional[float], communication_dtype: object,
             scheduler_nodes: object, gradient_checkpoint_config: object,
             make_vocab_size_divisible_by: int, overlap_communication: bool,
             loss_scale: dict, tuning: dict) -> MoeColossalArgs:
    """Validate Colossal-AI's extra ``MoeHybridParallelPlugin`` arguments (no collectives).

    Args:
        loss_scale: the fp16 loss-scaling keywords (``common.loss_scale_args``).
        tuning: the arguments that only tune Colossal-AI internals, by name (INFO when not
            their default; ``HybridParallelPlugin``'s messages).

    Raises:
        ValueError: sequence parallelism (any mode), or what ``hybrid_args`` refuses.
    """
    check_bools(enable_sequence_parallelism=enable_sequence_parallelism,
                overlap_communication=overlap_communication)
    # HybridParallelPlugin's rules first (a bad mode names its own fix), then the MoE refusal.
    check_sp_args(enable_sequence_parallelism, sequence_parallelism_mode, sp_size, tp_size,
                  pp_size, plugin="MoeHybridParallelPlugin")
    if enable_sequence_parallelism:
        raise ValueError(
            "MoeHybridParallelPlugin(enable_sequence_parallelism=True): sequence parallelism "
            f"with expert parallelism is not implemented ({NOT_IMPLEMENTED}); use "
            "enable_sequence_parallelism=False, or HybridParallelPlugin with sequence "
            "parallelism (MoE blocks whole on every rank)")
    if overlap_communication:
        log_info(PLUGIN, "overlap_communication",
                 "overlap_communication=True is not used: MoeHybridParallelPlugin reduces "
                 "gradients after the backward, not overlapped with it (Colossal-AI's MoE plugin "
                 "turns it off as well: experts that get no token would hang the overlap)")
    mapped = hybrid_args(
        tp_size=tp_size, pp_size=pp_size, pp_style=pp_style, precision=precision,
        reduce_bucket_size_in_m=None, zero_bucket_size_in_m=zero_bucket_size_in_m,
        communication_dtype=communication_dtype, scheduler_nodes=scheduler_nodes,
        gradient_checkpoint_config=gradient_checkpoint_config, parallel_output=parallel_output,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, inner_ring_size=None,
        loss_scale=loss_scale, plugin=PLUGIN,
        tuning=dict(enable_sequence_overlap=False, dp_outside=True, **tuning))
    return MoeColossalArgs(reduce_bucket_size_in_m=mapped.reduce_bucket_size_in_m,
                           loss_scale=mapped.loss_scale,
                           gradient_checkpoint_config=mapped.gradient_checkpoint_config)


@takes_colossal_args(positional=("tp_size", "pp_size", "ep_size", "sp_size", "precision",
                                 "zero_stage"))
class MoeHybridParallelPlugin(plugins.MoeHybridParallelPlugin):
    """fp8boost's ``MoeHybridParallelPlugin`` that also takes every argument of Colossal-AI
    v0.5.0's (by keyword; ``plugin.colossal`` holds what they map to).

    Args:
        sp_size: None or 1 (sequence parallelism is refused).
        enable_sequence_parallelism: True raises; sequence_parallelism_mode is then ignored
            (INFO).
        parallel_output, zero_bucket_size_in_m, communication_dtype, min_scale, growth_factor,
            backoff_factor, max_scale, hysteresis, scheduler_nodes: as in
            ``HybridParallelPlugin`` (:mod:`.hybrid`).
        overlap_communication: accepted; gradients are reduced after the backward (INFO when
            True; Colossal-AI turns it off for MoE too).
        enable_all_optimization, enable_fused_normalization, enable_flash_attention,
            enable_jit_fused, enable_metadata_cache, make_vocab_size_divisible_by,
            overlap_p2p, overlap_allgather, broadcast_buffers, ddp_bucket_cap_mb,
            find_unused_parameters, check_reduction, gradient_as_bucket_view, static_graph:
            Colossal-AI's internals: a non-default value logs once what fp8boost does instead.
        **native: ``fp8boost.plugins.MoeHybridParallelPlugin``'s arguments.
    """

    def __init__(self, *, sp_size: Optional[int] = None, enable_all_optimization: bool = False,
                 enable_fused_normalization: bool = False, enable_flash_attention: bool = False,
                 enable_jit_fused: bool = False, enable_sequence_parallelism: bool = False,
                 sequence_parallelism_mode: Optional[str] = None, parallel_output: bool = True,
                 min_scale: float = 1, growth_factor: float = 2, backoff_factor: float = 0.5,
                 hysteresis: int = 2, max_scale: float = 2 ** 32, broadcast_buffers: bool = True,
                 ddp_bucket_cap_mb: int = 25, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, zero_bucket_size_in_m: Optional[float] = None,
                 communication_dtype: Optional[torch.dtype] = None,
                 overlap_communication: bool = False, scheduler_nodes=None,
                 enable_metadata_cache: bool = True, make_vocab_size_divisible_by: int = 64,
                 overlap_p2p: bool = True, overlap_allgather: bool = False, **native) -> None:
        args = locals()  # this call's Colossal-AI arguments, handed on by name (pick)
        map_fused_norm(PLUGIN, native, enable_fused_normalization, enable_all_optimization)
        native["reduce_bucket_size_in_m"] = zero_bucket(native["reduce_bucket_size_in_m"],
                                                        zero_bucket_size_in_m)
        super().__init__(**native)
        self.colossal = moe_args(
            tp_size=native["tp_size"], pp_size=native["pp_size"], pp_style=native["pp_style"],
            sp_size=sp_size, precision=self.precision,
            enable_sequence_parallelism=enable_sequence_parallelism,
            sequence_parallelism_mode=sequence_parallelism_mode, parallel_output=parallel_output,
            zero_bucket_size_in_m=zero_bucket_size_in_m, communication_dtype=communication_dtype,
            scheduler_nodes=scheduler_nodes,
            gradient_checkpoint_config=native["gradient_checkpoint_config"],
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            overlap_communication=overlap_communication,
            loss_scale=loss_scale_args("moe_hybrid", self.precision,
                                       **pick(args, LOSS_SCALE_DEFAULTS)),
            tuning=pick(args, MOE_TUNING_NAMES))
        self.loss_scale_kwargs = self.colossal.loss_scale
