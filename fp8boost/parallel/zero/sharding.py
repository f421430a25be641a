"""How ZeRO splits each parameter over the data-parallel ranks.

Every parameter is flattened and split into ``world`` equal chunks of ``chunk = ceil(numel /
world)`` elements; rank ``r`` owns elements ``[r * chunk, min((r + 1) * chunk, numel))``. The
last rank's chunk is zero-padded up to ``chunk``, so every collective sees equal-sized pieces.
Per-parameter (rather than whole-model) chunks cost at most ``world - 1`` padding elements per
parameter and make the checkpoint layout trivially re-shardable: a chunk is a plain range of the
flattened parameter, whatever the world size was.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamShard:
    """This rank's slice of one parameter.

    Attributes:
        index: position of the parameter over all param groups (torch ``state_dict`` order).
        shape: full parameter shape.
        numel: full element count.
        chunk: padded per-rank slice length (``ceil(numel / world)``).
        start: first element of the flattened parameter this rank owns.
        end: one past the last owned element (``end - start <= chunk``; may be empty).
    """

    index: int
    shape: tuple[int, ...]
    numel: int
    chunk: int
    start: int
    end: int

    @property
    def length(self) -> int:
        """Number of real (unpadded) elements this rank owns."""
        return self.end - self.start


def chunk_size(numel: int, world: int) -> int:
    """Padded per-rank slice length: ``ceil(numel / world)``."""
    return -(-numel // world)


def make_shard(index: int, param: torch.Tensor, world: int, rank: int) -> ParamShard:
    """The slice of ``param`` that ``rank`` of ``world`` owns."""
    numel = param.numel()
    chunk = chunk_size(numel, world)
    start = min(rank * chunk, numel)
    end = min(start + chunk, numel)
    return ParamShard(index, tuple(param.shape), numel, chunk, start, end)


def padded_rows(flat: torch.Tensor, chunk: int, world: int, out: torch.Tensor) -> None:
    """Write ``flat`` (numel elements) into ``out`` ([world, chunk] view), zero-padding the tail.

    Row ``r`` of ``out`` receives rank ``r``'s chunk: the layout a reduce-scatter needs.
    """
    numel = flat.numel()
    full = numel // chunk if chunk else 0
    if full:
        out[:full].copy_(flat[: full * chunk].view(full, chunk))
    if full < world:
        rem = numel - full * chunk
        out[full, :rem].copy_(flat[full * chunk:])
        out[full, rem:].zero_()
        out[full + 1:].zero_()
