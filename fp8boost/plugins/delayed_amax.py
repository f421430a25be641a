"""Delayed FP8 scaling over data-parallel replicas: one amax history on every rank.

A layer under ``Fp8Config(recipe="delayed")`` keeps its amax history and scales in buffers
(``fp8_amax_history``, ``fp8_scale``). Each rank sees its own micro-batch, so without a
reduction the histories (hence the scales of the input and gradient casts) drift apart per
rank, while a checkpoint stores one rank's copy: every other rank resumed with a history it
never had. Reducing each fresh amax with MAX over the replicas keeps one history everywhere
(also one scale for the replicated weight), so the saved copy is every rank's. The hybrid
plugin reduces the same amaxes over its dp x tp ranks; ZeRO and FSDP2 plugins use this helper.

Cost: one all-reduce of one element per operand (input, weight, gradient) per layer per step,
issued where the cast happens (latency-bound; batching them per step is not done yet).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fp8boost.fp8.record import fp8_entry, recorded_linears

__all__ = ["reduce_delayed_amax"]


def reduce_delayed_amax(model: nn.Module, group=None) -> int:
    """Make every delayed-scaling FP8 layer of ``model`` all-reduce (MAX) its fresh amaxes over
    ``group`` (the ranks holding replicas of the same layers). Returns how many layers.

    Nothing is done on one rank or without an initialised process group.

    Example:
        >>> reduce_delayed_amax(model, dp_group)    # doctest: +SKIP
        7
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0

    def reduce_max(a: torch.Tensor) -> None:
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)

    layers = [m for m in recorded_linears(model) if fp8_entry(m).recipe == "delayed"]
    for m in layers:
        m.set_amax_reduce_fn(reduce_max)
    return len(layers)
