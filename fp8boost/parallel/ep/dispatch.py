"""Token dispatch and combine: the uneven all-to-alls of expert parallelism.

An expert-parallel group of ``ep`` ranks holds ``E/ep`` experts each. A rank's (token, choice)
pairs are sorted by the rank that owns their expert (stable), the per-rank pair counts are
exchanged (one all-to-all of ints), and the pairs' hidden rows travel by an all-to-all with
uneven splits (:func:`dispatch`); the expert outputs come back by the inverse all-to-all and
are put back in pair order (:func:`combine`).

Both row all-to-alls are :class:`AllToAll` autograd functions whose backward is the inverse
all-to-all, in the gradient's dtype. With ``fp8`` the dispatched rows travel as e4m3 with one
FP32 scale per row (per token choice, :func:`fp8_rows_a2a`); the rows a rank keeps for itself
are never quantized. The combine and every backward stay in their dtype: the expert outputs
and gradients have no shared scale to lean on, and the combine feeds the residual stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

E4M3_MAX = 448.0


def uneven_all_to_all(x: torch.Tensor, send: list[int], recv: list[int],
                      group) -> torch.Tensor:
    """All-to-all over dim 0 of ``x``: ``send[r]`` rows to rank r, ``recv[r]`` rows from it.

    Args:
        x: the rows to send, grouped by destination rank (``sum(send)`` of them).
        send: rows sent to each rank of ``group``.
        recv: rows received from each rank of ``group`` (the peers' ``send`` entries for us).
        group: the process group (None: the default group).

    Returns:
        The ``sum(recv)`` received rows, grouped by source rank.
    """
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def fp8_rows_a2a(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """All-to-all of 2-D ``x`` with e4m3 rows, one FP32 scale per row (two all-to-alls: bytes
    and scales). The chunk this rank keeps is copied in full precision."""
    rank = dist.get_rank(group)
    amax = x.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    # uint8 on the wire: neither NCCL nor gloo has an FP8 type
    q = (x.detach().float() * (E4M3_MAX / amax)).to(torch.float8_e4m3fn).view(torch.uint8)
    rq = uneven_all_to_all(q, send, recv, group)
    ramax = uneven_all_to_all(amax, send, recv, group)
    out = (rq.view(torch.float8_e4m3fn).float() * (ramax / E4M3_MAX)).to(x.dtype)
    lo_in, lo_out = sum(send[:rank]), sum(recv[:rank])
    out[lo_out:lo_out + recv[rank]] = x.detach()[lo_in:lo_in + send[rank]]
    return out


class AllToAll(torch.autograd.Function):
    """Differentiable uneven all-to-all over dim 0; backward: the inverse, in the grad dtype."""

    @staticmethod
    def forward(ctx, x, send, recv, group, fp8):  # noqa: D102 - autograd protocol
        ctx.send, ctx.recv, ctx.group = send, recv, group
        if fp8 and x.dim() == 2:
            return fp8_rows_a2a(x, send, recv, group)
        return uneven_all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102 - autograd protocol
        return uneven_all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None, None


@dataclass(frozen=True, kw_only=True)
class Splits:
    """Where this rank's (token, choice) pairs go and how many come back, for one forward."""

    order: torch.Tensor
    """Permutation of the pairs that groups them by destination rank (stable sort)."""

    send: list[int]
    """Pairs sent to each rank of the ep group."""

    recv: list[int]
    """Pairs received from each rank of the ep group."""


def exchange_counts(counts: torch.Tensor, group) -> list[int]:
    """The peers' per-rank counts for this rank (one all-to-all of ints; collective).

    The split sizes go through the host (``tolist``): the row all-to-alls need them as ints.
    """
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    return recv.tolist()


def plan_splits(expert_ids: torch.Tensor, num_local: int, group) -> Splits:
    """Sort the pairs by owning rank (expert ``e`` lives on rank ``e // num_local``) and
    exchange the counts (collective over ``group``).

    Args:
        expert_ids: the global expert id of each pair, flat, every id in ``[0, E)``.
        num_local: experts per rank (``E / ep``).
        group: the expert-parallel process group.
    """
    dest = expert_ids // num_local
    order = torch.sort(dest, stable=True).indices
    counts = torch.bincount(dest, minlength=dist.get_world_size(group))
    recv = exchange_counts(counts, group)
    return Splits(order=order, send=counts.tolist(), recv=recv)


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, splits: Splits, *, top_k: int,
             num_local: int, group, fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each pair's hidden row and local expert id to the rank owning its expert.

    Args:
        x: ``[tokens, hidden]`` hidden rows (pair ``i`` reads token ``i // top_k``).
        expert_ids: the global expert id of each pair, flat (``tokens * top_k``).
        splits: from :func:`plan_splits` on ``expert_ids``.
        top_k: choices per token.
        num_local: experts per rank.
        group: the expert-parallel process group.
        fp8: send the rows in e4m3 with one scale per row.

    Returns:
        ``(rows, local_ids)``: the received rows (differentiable) and the receiving rank's
        expert index of each, grouped by source rank.
    """
    local_ids = uneven_all_to_all((expert_ids % num_local)[splits.order], splits.send,
                                  splits.recv, group)
    rows = AllToAll.apply(x.index_select(0, splits.order // top_k), splits.send, splits.recv,
                          group, fp8)
    return rows, local_ids


def combine(out: torch.Tensor, splits: Splits, group) -> torch.Tensor:
    """The expert outputs back to their senders, in the pairs' original order (in the
    outputs' dtype: never FP8, see the module docstring)."""
    back = AllToAll.apply(out, splits.recv, splits.send, group, False)
    return back[torch.argsort(splits.order)]
