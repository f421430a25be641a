"""Sort token-expert pairs by expert once: the row layout every grouped GEMM of a layer shares.

For ``top_k_index [T, k]`` there are ``S = T*k`` (token, expert) pairs. Pair ``f`` (token
``f // k``, its ``f % k``-th choice) goes to row ``pos[f]`` of a buffer of ``rows`` rows in
which expert ``e``'s pairs are contiguous, starting at a multiple of ``ALIGN`` (16: the FP8
grouped GEMM reads each group's token range with 16-byte aligned loads in its weight-gradient
form), in their original order (a stable sort, so results do not depend on sort ties).
``offsets[e]`` is the end of expert e's (padded) group, int32, as ``torch._grouped_mm`` and
``torch._scaled_grouped_mm`` take it. ``rows`` is a bound fixed by (S, E) alone,
``S + E*(ALIGN-1)`` rounded up to ``ALIGN``, so nothing waits for the GPU to know a group size
(no host sync). Rows past ``offsets[-1]`` and padding rows hold zeros and belong to no
expert (``group[r] == E``).

Every shape here depends on (S, E) alone, never on the routing, and ``offsets`` is a tensor
(never a Python list): under ``torch.compile`` each step's routing is new data in the same
graph, with no graph break (no data-dependent size, no ``.item()``) and no recompile.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 16


@dataclass(frozen=True)
class Routing:
    """Row layout of one MoE layer's grouped GEMMs (see the module docstring).

    Attributes:
        pos: ``[S]`` int64, the row of each (token, choice) pair.
        offsets: ``[E]`` int32, cumulative end row of each expert's padded group.
        group: ``[rows]`` int64, each row's expert (E for padding and tail rows).
        local: ``[rows]`` int64, each row's index within its group (0 for padding and tail).
        rows: the buffer's row count.
        num_experts: E.
    """

    pos: torch.Tensor
    offsets: torch.Tensor
    group: torch.Tensor
    local: torch.Tensor
    rows: int
    num_experts: int


def route(expert_ids: torch.Tensor, num_experts: int) -> Routing:
    """Lay out ``expert_ids`` (any shape, int, values in ``[0, num_experts)``) by expert.

    Args:
        expert_ids: the experts chosen per token, e.g. ``top_k_index [T, k]``.
        num_experts: E.

    Returns:
        The :class:`Routing` of the ``expert_ids.numel()`` pairs, flattened in row-major order.

    Example:
        >>> r = route(torch.tensor([[1, 0], [1, 1]]), 2)
        >>> r.pos.tolist(), r.offsets.tolist(), r.rows
        ([16, 0, 17, 18], [16, 32], 48)
    """
    if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
        raise TypeError(f"expert ids must be an integer tensor, got {expert_ids.dtype}")
    ids = expert_ids.reshape(-1).long()
    dev, s, e = ids.device, ids.numel(), num_experts
    # A scatter-add, not bincount: bincount's output size depends on the data (a graph break
    # under torch.compile); this one is [E] whatever the ids.
    counts = torch.zeros(e, dtype=torch.long, device=dev).scatter_add_(0, ids,
                                                                       torch.ones_like(ids))
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    pend = torch.cumsum(padded, 0)
    pstart = pend - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.sort(ids, stable=True).indices
    sorted_ids = ids[order]
    rank = torch.arange(s, device=dev) - start[sorted_ids]
    dest = pstart[sorted_ids] + rank
    pos = torch.empty_like(ids)
    pos[order] = dest
    rows = -(-(s + e * (ALIGN - 1)) // ALIGN) * ALIGN
    group = torch.full((rows,), e, dtype=torch.long, device=dev)
    group[dest] = sorted_ids
    local = torch.zeros(rows, dtype=torch.long, device=dev)
    local[dest] = rank
    return Routing(pos, pend.to(torch.int32), group, local, rows, e)
