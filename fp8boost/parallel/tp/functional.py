"""The collectives of a tensor-parallel region, as autograd functions.

A tensor-parallel block (attention, MLP) is a region: column-parallel GEMMs at its entry, row-
parallel GEMMs at its exit. What crosses the region's borders depends on sequence parallelism:

=====================  =============================  ==============================
                       entry (before q/k/v, gate/up)  exit (after o, down)
=====================  =============================  ==============================
no sequence parallel   :func:`copy_to_tp`             :func:`reduce_from_tp`
                       (fwd identity, bwd all-reduce)  (fwd all-reduce, bwd identity)
sequence parallel      :func:`gather_seq`             :func:`reduce_scatter_seq`
                       (fwd all-gather, bwd           (fwd reduce-scatter, bwd
                       reduce-scatter)                 all-gather)
=====================  =============================  ==============================

Plain in-place ``torch.distributed`` calls on contiguous dim-0 buffers: they run on gloo and
NCCL alike, and dynamo traces them (it remaps them to functional collectives), so a compiled
decoder block keeps its collectives inside the graph.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fp8boost.parallel.comm._utils import all_gather_single, reduce_scatter_single

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_seq", "reduce_scatter_seq", "split_seq",
           "all_gather_dim", "reduce_scatter_dim"]


def _size(group) -> int:
    return dist.get_world_size(group)


def all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (equal shapes on every rank)."""
    n = _size(group)
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0],) + tuple(moved.shape[1:]), dtype=x.dtype,
                      device=x.device)
    all_gather_single(out, moved, group, async_op=False)
    return out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's ``1/n`` slice along ``dim``."""
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} is not divisible by the "
                         f"tensor-parallel size {n}")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // n,) + tuple(moved.shape[1:]), dtype=x.dtype,
                      device=x.device)
    reduce_scatter_single(out, moved, group, async_op=False)
    return out.movedim(0, dim)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _local_slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n, r = _size(group), dist.get_rank(group)
    if x.shape[dim] % n:
        raise ValueError(f"sequence parallelism needs the sequence length ({x.shape[dim]}) to be "
                         f"divisible by the tensor-parallel size ({n}): pad or trim the batch")
    return x.chunk(n, dim=dim)[r].contiguous()


class _CopyToTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy, ctx.group), None


class _ReduceFromTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, dy):
        return reduce_scatter_dim(dy, ctx.dim, ctx.group), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx, dy):
        return all_gather_dim(dy, ctx.dim, ctx.group), None, None


class _SplitSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _local_slice(x, dim, group)

    @staticmethod
    def backward(ctx, dy):
        return all_gather_dim(dy, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a region with a replicated input: identity forward, all-reduce of its gradient."""
    return _CopyToTp.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a region: sum the ranks' partial outputs (identity backward)."""
    return _ReduceFromTp.apply(x, group)


def gather_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Enter a region from sequence shards: all-gather along ``dim`` (bwd reduce-scatter)."""
    return _GatherSeq.apply(x, dim, group)


def reduce_scatter_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Leave a region into sequence shards: reduce-scatter along ``dim`` (bwd all-gather)."""
    return _ReduceScatterSeq.apply(x, dim, group)


def split_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Keep this rank's sequence shard of a replicated tensor (bwd all-gather)."""
    return _SplitSeq.apply(x, dim, group)
