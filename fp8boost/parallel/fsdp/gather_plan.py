"""Which path the gathered FP8 bytes of one FSDP2 weight take, and the direct path itself.

Split from :mod:`.fp8_all_gather` (which owns the weight subclass and FSDP's hooks) to keep
both short. See that module's docstring for the two paths.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from fp8boost import _state
from fp8boost.fp8.prequantized import Fp8WeightTensor
from fp8boost.fp8.record import recorded_linear
from fp8boost.fp8.scaling import scale_from_amax

from ..comm.config import Fp8CommConfig
from .block_gather import block_gather_unfit

logger = logging.getLogger("fp8boost.parallel.fsdp")


@dataclass(frozen=True)
class GatherPlan:
    """How one weight's gathered FP8 bytes are consumed, and the scale they are cast with.

    ``direct``: the unsharded parameter is an :class:`Fp8WeightTensor` whose bytes are the FP8
    GEMM operand of the owning ``Fp8Linear``, so the scale follows that layer's rule (its
    margin and power-of-two setting) and the bytes equal the cast it would have made itself.
    Otherwise the bytes are decoded into a plain ``param_dtype`` parameter and the scale follows
    the comm config; ``reason`` says why. ``block`` > 0 (direct only): the weight of a blockwise
    layer, cast per ``block`` x ``block`` block on each rank, no shared scale
    (:mod:`.block_gather`).
    """

    direct: bool
    fp8_dtype: torch.dtype
    margin: int
    power_of_2: bool
    reason: str = ""
    block: int = 0

    def scale(self, a: torch.Tensor) -> torch.Tensor:
        """FP32 scale from the weight's (global) amax."""
        return scale_from_amax(a, self.fp8_dtype, self.margin, self.power_of_2)


def choose_plan(config: Fp8CommConfig, tied: bool, module: Optional[nn.Module],
                outer_size: Optional[torch.Size], shard_ranks: Optional[int] = None
                ) -> GatherPlan:
    """Direct for a tensorwise Fp8Linear's own 2-D weight (or a blockwise one whose shards hold
    whole blocks), dequantize (with a reason) else.

    ``outer_size`` (the unsharded local size FSDP gathers) differs from the sharded parameter's
    global shape under tensor parallelism, where the unsharded parameter is a DTensor that
    Fp8Linear does not unwrap; ``None`` skips that check (provisional plans of precompute).
    ``shard_ranks``: the ranks FSDP shards over (blockwise: whole blocks per shard).
    """
    cfg, fp8cfg = config, getattr(module, "fp8_config", None)
    block_why = block_gather_unfit(module, shard_ranks, cfg.param_dtype, tied, outer_size)
    if block_why is None:
        return GatherPlan(True, fp8cfg.fwd_dtype, fp8cfg.margin, fp8cfg.power_of_2_scale,
                          block=fp8cfg.block_size)
    if not recorded_linear(module):
        why = f"its consumer is a {type(module).__name__}, not an Fp8Linear"
    elif fp8cfg.recipe == "blockwise":
        why = f"a block-scaled FP8 gather does not fit: {block_why}"
    elif fp8cfg.recipe != "tensorwise":
        why = (f"Fp8Linear recipe {fp8cfg.recipe!r} derives the weight scale from its own amax "
               "history; the direct path is for tensorwise scaling")
    elif cfg.param_dtype != fp8cfg.fwd_dtype:
        why = (f"Fp8CommConfig.param_dtype {cfg.param_dtype} != the FP8 GEMM's weight format "
               f"{fp8cfg.fwd_dtype}")
    elif tied:
        why = "the weight is tied to another module's"
    elif outer_size is not None and (
            len(outer_size) != 2 or tuple(getattr(module.weight, "shape", ())) != tuple(outer_size)):
        why = "the unsharded weight is a tensor-parallel DTensor or not 2-D"
    else:
        return GatherPlan(True, fp8cfg.fwd_dtype, fp8cfg.margin, fp8cfg.power_of_2_scale)
    return GatherPlan(False, cfg.param_dtype, 0, cfg.power_of_2_wire_scale, why)


def log_plan(plan: GatherPlan) -> None:
    """Log once which path weights take (the dequantize path once per reason)."""
    if plan.block:
        _state.log_once(logger, "fsdp-fp8-ag-block",
                        "fp8boost: FSDP FP8 all-gather sends blockwise weights as FP8 bytes with "
                        "their block scales, cast per shard, straight into the blockwise GEMMs",
                        level=logging.INFO)
    elif plan.direct:
        _state.log_once(logger, "fsdp-fp8-ag-direct",
                        "fp8boost: FSDP FP8 all-gather feeds Fp8Linear's FP8 GEMM directly "
                        "(no dequantize / re-quantize of the weight)", level=logging.INFO)
    else:
        _state.log_once(logger, ("fsdp-fp8-ag-dequantize", plan.reason),
                        "fp8boost: FSDP FP8 all-gather dequantizes a weight to param_dtype "
                        f"(its consumer re-quantizes it): {plan.reason}")


def post_all_gather_direct(data: torch.Tensor, inv: torch.Tensor, plan: GatherPlan,
                           param_dtype: torch.dtype, out: Optional[torch.Tensor]):
    """The gathered bytes become the unsharded parameter itself: an :class:`Fp8WeightTensor`.

    First gather: wrap FSDP's all-gather output (no copy); FSDP then narrows it to the weight's
    shape with ``as_strided`` and frees/reallocates the storage around each use. Later gathers
    (``out=``): FSDP copied the new bytes into that same storage, so only the scale changes.
    """
    fp8 = data.view(plan.fp8_dtype)
    if out is None:
        return Fp8WeightTensor(fp8, inv, param_dtype), (data,)
    if not isinstance(out, Fp8WeightTensor):
        raise RuntimeError(f"FP8 all-gather (direct plan) expected to refill an Fp8WeightTensor, "
                           f"got {type(out).__name__}")
    target = out.fp8_data
    n = target.numel()
    if n and target.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
        # Not FSDP's reused all-gather output (not seen with torch 2.13): copy, keeping the version
        # counter, since autograd may hold this weight for backward.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):
            target.view(torch.uint8).copy_(data.reshape(-1)[:n].view(target.shape))
    out.inv_scale = inv  # rebind, not copy_: a backward in flight keeps the tensor it saw
    return None
