"""Which FP8 layers' weights an FP8 parameter all-gather carries, for rowwise/blockwise layers.

FSDP2's and ZeRO's FP8 all-gathers send a tensorwise weight as FP8 bytes with one scale per
tensor (the scale shared by the group). A layer under the ``rowwise`` or ``blockwise`` recipe
re-quantizes its weight with a scale per row or 128 x 128 block, so a per-tensor FP8 wire would
round it twice and lose what those recipes are for (an outlier sets the whole tensor's scale).
FSDP2 (GeminiPlugin, TorchFSDPPlugin) and ZeRO (LowLevelZeroPlugin, HybridParallelPlugin's
ZeRO) gather a blockwise weight whose even shards hold whole blocks as FP8 with its block
scales (``parallel/fsdp/block_gather.py``, ``parallel/zero/direct_blocks.py``); every other
rowwise/blockwise weight (rowwise ones, blockwise ones whose shards would split a block)
travels in the training dtype: the communication plan
(:func:`~fp8boost.parallel.comm.plan.build_comm_plan`) warns once and records why
(``plugin.comm_report.why_not['param_all_gather']``).

(It sits below the plugins, beside the plan that makes this decision; it used to be
``plugins/granular_comm.py``.)
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch.distributed as dist
from torch import nn

from fp8boost import _state
from fp8boost.fp8.record import fp8_entry, recorded_linears

from fp8boost.parallel.fsdp.block_gather import block_gather_unfit

from .config import Fp8CommConfig
from .report import PARAM_ALL_GATHER, CommReport

__all__ = ["GRANULAR_GATHER_WHY", "is_granular", "block_gathered", "ranks_of",
           "split_fp8_gather_layers", "report_granular_gather"]

GRANULAR_GATHER_WHY = (
    "weights of rowwise/blockwise Fp8Linear layers are all-gathered in the training dtype: the "
    "FP8 all-gather carries one scale per tensor and these recipes re-quantize per row/block, "
    "so an FP8 wire would round each weight twice (FSDP2 and ZeRO gather blockwise weights "
    "with their block scales when their even shards hold whole 128-row blocks)")
"""Why a rowwise/blockwise layer's weight is not all-gathered in FP8."""


def is_granular(module: Optional[nn.Module]) -> bool:
    """Whether the conversion's record has ``module`` (an FP8 layer or experts) under a
    rowwise or blockwise recipe.

    Example:
        >>> is_granular(nn.Linear(2, 2))
        False
    """
    entry = fp8_entry(module)
    return entry is not None and entry.granular


def block_gathered(module: Optional[nn.Module], shard_ranks: Optional[int],
                   comm_config=None, rows: Optional[int] = None) -> bool:
    """Whether FSDP2 or ZeRO over ``shard_ranks`` ranks gathers ``module``'s weight as
    block-scaled FP8 (None: no sharded FP8 gather, never). ``comm_config``: the plugin's
    ``Fp8CommConfig`` (None: the default); its wire format must be the layer's (e4m3), or the
    gather would fall back to one scale per weight and round the weight twice. ``rows``: the
    weight's rows after a tensor-parallel split still to come (None: as it is now)."""
    wire = (comm_config or Fp8CommConfig()).param_dtype
    return shard_ranks is not None and \
        block_gather_unfit(module, shard_ranks, wire, rows=rows) is None


def ranks_of(group) -> int:
    """The size of a process group (1 for None or without a process group)."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def split_fp8_gather_layers(layers: Iterable[nn.Module]) -> tuple[list, list]:
    """``(layers whose weights may travel in FP8, rowwise/blockwise layers)``."""
    keep, granular = [], []
    for layer in layers:
        entry = fp8_entry(layer)
        (granular if entry is not None and entry.granular else keep).append(layer)
    return keep, granular


def report_granular_gather(report: CommReport, where: str, model: nn.Module,
                           shard_ranks: Optional[int] = None, comm_config=None,
                           rows_of: Optional[Callable[[nn.Module], Optional[int]]] = None) -> int:
    """Record in ``report`` (and warn once, naming ``where``) that the weights of ``model``'s
    rowwise/blockwise layers are all-gathered in the training dtype; returns how many.

    ``shard_ranks``: FSDP2's or ZeRO's shard group size; the blockwise layers gathered with
    block scales (:func:`block_gathered` with ``comm_config``) are not counted. When every FP8 layer is left in the
    training dtype, ``report.fp8_param_all_gather`` becomes False. ``rows_of(layer)``: the
    rows a tensor-parallel split still to come leaves it (None: its own; see ``block_gathered``).
    """
    layers = recorded_linears(model)
    rows_of = rows_of or (lambda m: None)
    n_granular = sum(fp8_entry(m).granular
                     and not block_gathered(m, shard_ranks, comm_config, rows_of(m))
                     for m in layers)
    if not n_granular:
        return 0
    why = f"{n_granular} {GRANULAR_GATHER_WHY}"
    before = report.why_not.get(PARAM_ALL_GATHER)
    # Another reason (e.g. FP8 experts', recorded first by FSDP2's plugins) stays: keep both.
    report.not_fp8(PARAM_ALL_GATHER, why if not before else f"{before}; {why}")
    if n_granular == len(layers):
        report.fp8_param_all_gather = False
    _state.warn_once(("granular-fp8-param-gather", where), f"fp8boost {where}: {why}")
    return n_granular
