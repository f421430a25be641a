"""``MoeHybridParallelPlugin``'s process groups and gradient reduction (dp x ep x tp).

Rank layout (Colossal-AI's ``moe_dp_outside=True`` with ``pp_size=1``; tp innermost, as in
``parallel/mesh.py``)::

    rank = (moe_dp_index * ep + ep_index) * tp + tp_index,   dp_index = moe_dp_index * ep + ep_index

* tp group: ``tp`` consecutive ranks, one replica of the non-expert model split by the tp plan;
  its ranks read the same batch and, the MoE blocks being replicated over tp, route it alike;
* ep group: the ranks of one tp index whose dp indices differ only in ``ep_index``: they hold
  the ``ep`` different expert slices and exchange tokens by all-to-all;
* moe-dp group: the ranks of one tp index and one ep index: they hold the same experts.

Gradient scaling: each dp replica's loss is the mean over its own batch, the reference the
mean over the global batch (``dp`` equal batches). A non-expert gradient (tp shard or
replicated) is averaged over the dp group (same tp index). An expert's gradient on a rank
already sums the contributions of every rank of its ep group (they reach it through the
combine all-to-all's backward), so it is summed over the moe-dp group and divided by ``dp``.
Gradients of parameters replicated over tp (norms, routers, experts) are equal on the tp ranks
(their inputs are, and the column-parallel entry all-reduces its input gradient), so nothing
is reduced over tp; the optimizer counts them once in the global norm (``tp_replicated``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fp8boost.parallel.zero import ZeroOptimizer


def moe_groups(ep: int, tp: int) -> tuple[object, object]:
    """``(ep group, moe-dp group)`` of this rank (module docstring's layout).

    Collective: every rank creates every group, in one order.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    moe_dp = world // (ep * tp)
    mine = {}
    for kind, outer, inner in (("ep", moe_dp, ep), ("moe_dp", ep, moe_dp)):
        for a in range(outer):
            for t in range(tp):
                # ep groups vary the ep index (a: moe-dp index); moe-dp groups the moe-dp
                # index (a: ep index)
                ranks = [((a * ep + b) if kind == "ep" else (b * ep + a)) * tp + t
                         for b in range(inner)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine[kind] = group
    return mine["ep"], mine["moe_dp"]


def reduce_moe_gradients(params, expert_ids: set[int], dp_group, moe_dp_group,
                         dp_size: int) -> None:
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
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=moe_dp_group if expert else dp_group)
        flat.div_(dp_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


class Stage0Optimizer(ZeroOptimizer):
    """``zero_stage=0``'s optimizer: the plugin reduces gradients after a synchronised
    ``booster.backward``; after a plain ``loss.backward()`` (which no hook of stage 0 sees)
    ``step()`` reduces them first, so training does not depend on which one the script called.
    Collective-safe: every rank calls ``step()``."""

    def __init__(self, optimizer, *, reduce_fn, **kwargs) -> None:
        super().__init__(optimizer, **kwargs)
        self.reduce_fn = reduce_fn
        self.gradients_reduced = False

    def step(self, closure=None) -> None:
        if not self.gradients_reduced:
            self.reduce_fn()
        self.gradients_reduced = False
        super().step(closure)
