"""Gradient reduction under expert parallelism: expert and non-expert parameters differ.

Groups (from the topology, ``parallel/mesh.py``): dp = moe-dp x ep replicas of each stage;
the ep ranks hold different experts, the moe-dp ranks the same ones.

Gradient scaling: each dp replica's loss is the mean over its own batch, the reference the
mean over the global batch (``dp`` equal batches). A non-expert gradient (tp shard or
replicated) is averaged over the dp group (same tp index). An expert's gradient on a rank
already sums the contributions of every rank of its ep group (they reach it through the
combine all-to-all's backward), so it is summed over the moe-dp group and divided by ``dp``.
Gradients of parameters replicated over tp (norms, routers, experts) are equal on the tp ranks
(their inputs are, and the column-parallel entry all-reduces its input gradient), so nothing
is reduced over tp; the optimizer counts them once in the global norm (``tp_replicated``).
With ``pp_size > 1`` every stage does this over its own dp and moe-dp groups (they hold one
pp index), after the pipeline schedule.

Under ZeRO (over the moe-dp group) the same sums come from :func:`register_ep_hooks`: each
non-expert gradient is first averaged over ep and each expert gradient divided by ep, so the
optimizer's moe-dp average is the dp average.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from fp8boost.parallel.zero import ZeroOptimizer


def reduce_moe_gradients(params: Iterable[torch.Tensor], expert_ids: set[int], dp_group,
                         moe_dp_group, dp_size: int) -> None:
    """Average gradients as the module docstring says (collective over every rank): one flat
    all-reduce per (kind, dtype), non-expert over ``dp_group``, expert over ``moe_dp_group``.

    An expert that got no token on this rank still takes part (zero gradient): its moe-dp
    peers reduce the same buckets.
    """
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buckets.setdefault((id(p) in expert_ids, p.grad.dtype), []).append(p.grad)
    for (expert, _), grads in sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        _mean_flat(grads, moe_dp_group if expert else dp_group, dp_size)


def average_over_ep(params: Iterable[torch.Tensor], expert_ids: set[int], ep_group,
                    ep: int) -> None:
    """Average the non-expert gradients over the ep group, one flat all-reduce per dtype
    (collective over the ep group); what :func:`register_ep_hooks`' per-parameter hooks do, at
    once, after a pipeline schedule (expert gradients are divided by ep by their gradient
    hooks)."""
    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.requires_grad and id(p) not in expert_ids:
            if p.grad is None:  # a parameter without gradient here still takes part
                p.grad = torch.zeros_like(p)
            buckets.setdefault(p.grad.dtype, []).append(p.grad)
    for _, grads in sorted(buckets.items(), key=lambda kv: str(kv[0])):
        _mean_flat(grads, ep_group, ep)


def _mean_flat(grads: list[torch.Tensor], group, divisor: int) -> None:
    """Sum ``grads`` over ``group`` as one flat all-reduce, divide by ``divisor``, in place."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(divisor)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def register_ep_hooks(model: nn.Module, expert_ids: set[int], ep_group, ep: int,
                      synced: Callable[[], bool]) -> None:
    """Prepare gradients for ZeRO over moe-dp (module docstring): every non-expert gradient is
    averaged over ``ep_group`` once accumulated (a post-accumulate hook, so it runs before
    ZeRO's own), every expert gradient divided by ``ep`` (a gradient hook).

    Args:
        model: the model whose trainable Parameters get hooks.
        expert_ids: ids of the expert Parameters (:func:`~fp8boost.parallel.ep.expert_params`).
        ep_group: the expert-parallel process group.
        ep: its size.
        synced: whether this backward reduces (False inside ``no_sync`` and during a pipeline
            schedule, which calls :func:`average_over_ep` once at its end instead).
    """
    def average(p: torch.Tensor) -> None:
        if synced() and p.grad is not None:
            dist.all_reduce(p.grad, group=ep_group)
            p.grad.div_(ep)

    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in expert_ids:
            p.register_hook(lambda g: g / ep)
        else:
            p.register_post_accumulate_grad_hook(average)


def counted_elsewhere(model: nn.Module, expert_ids: set[int], ep_group) -> list[torch.Tensor]:
    """The Parameters the global gradient norm must not count on this rank: its non-expert
    ones unless it is ep rank 0 (the ep ranks hold equal copies of them)."""
    if dist.get_rank(ep_group) == 0:
        return []
    return [p for p in model.parameters() if id(p) not in expert_ids]


class Stage0Optimizer(ZeroOptimizer):
    """``zero_stage=0``'s optimizer: the plugin reduces gradients after a synchronised
    ``booster.backward``; after a plain ``loss.backward()`` (which no hook of stage 0 sees)
    ``step()`` reduces them first, so training does not depend on which one the script called.
    Collective-safe: every rank calls ``step()``."""

    def __init__(self, optimizer, *, reduce_fn: Callable[[], None], **kwargs) -> None:
        super().__init__(optimizer, **kwargs)
        self.reduce_fn = reduce_fn
        self.gradients_reduced = False

    def step(self, closure=None) -> None:
        if not self.gradients_reduced:
            self.reduce_fn()
        self.gradients_reduced = False
        super().step(closure)
