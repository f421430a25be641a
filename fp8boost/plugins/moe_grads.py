"""``MoeHybridParallelPlugin``'s rank layout, process groups and gradient reduction.

Rank layout (Colossal-AI's ``MoeHybridParallelPlugin``: its ``ProcessGroupMesh`` axes
``(moe_dp, pp, ep, tp)`` with ``moe_dp_outside=True``, ``(pp, moe_dp, ep, tp)`` with
``moe_dp_outside=False``; tp innermost, as in ``parallel/mesh.py``)::

    moe_dp_outside=True:  rank = ((moe_dp_index * pp + pp_index) * ep + ep_index) * tp + tp_index
    moe_dp_outside=False: rank = ((pp_index * moe_dp + moe_dp_index) * ep + ep_index) * tp + tp_index
    dp_index = moe_dp_index * ep + ep_index

With ``pp_size=1`` both are ``(dp_index * tp + tp_index)``, ``ParallelDims``' layout.
:class:`MoeDims` gives these coordinates to everything that reads ``plugin.dims`` /
``plugin.topology()`` (the pipeline setup, the stage manager, the checkpoint export, the
data sharding), and its mesh's "dp"/"pp"/"tp" groups follow them.

* tp group: ``tp`` consecutive ranks, one replica stage of the non-expert model split by the
  tp plan; its ranks read the same batch and, the MoE blocks being replicated over tp, route
  it alike;
* pp group: the ranks of one (moe-dp, ep, tp) index: the stages of one pipeline;
* ep group: the ranks of one (moe-dp, pp, tp) index: the ``ep`` different expert slices of
  one stage's MoE layers, exchanging tokens by all-to-all;
* moe-dp group: the ranks of one (pp, ep, tp) index: they hold the same experts;
* dp group: the ranks of one (pp, tp) index (moe-dp x ep): the data-parallel replicas.

Gradient scaling: each dp replica's loss is the mean over its own batch, the reference the
mean over the global batch (``dp`` equal batches). A non-expert gradient (tp shard or
replicated) is averaged over the dp group (same tp index). An expert's gradient on a rank
already sums the contributions of every rank of its ep group (they reach it through the
combine all-to-all's backward), so it is summed over the moe-dp group and divided by ``dp``.
Gradients of parameters replicated over tp (norms, routers, experts) are equal on the tp ranks
(their inputs are, and the column-parallel entry all-reduces its input gradient), so nothing
is reduced over tp; the optimizer counts them once in the global norm (``tp_replicated``).
With ``pp_size > 1`` every stage does this over its own dp and moe-dp groups (they hold one
pp index), after the pipeline schedule (``MoeHybridParallelPlugin.execute_pipeline``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fp8boost.parallel.mesh import DIM_NAMES, ParallelDims, Topology
from fp8boost.parallel.zero import ZeroOptimizer


@dataclass(frozen=True, kw_only=True)
class MoeDims(ParallelDims):
    """``ParallelDims`` (dp = moe-dp x ep, pp, tp) with Colossal-AI's MoE rank layout
    (module docstring); ``coords`` adds ``"ep"`` and ``"moe_dp"``."""

    ep: int = 1
    """Expert-parallel ranks (dp = moe-dp x ep)."""

    moe_dp_outside: bool = True
    """Colossal-AI's switch: the moe-dp axis outside the pp axis (True) or inside it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sp != 1 or self.dp % self.ep:
            raise ValueError(f"MoeDims needs sp=1 and ep ({self.ep}) dividing dp ({self.dp})")

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        moe_dp = self.dp // self.ep
        tp_i, ep_i, outer = rank % self.tp, rank // self.tp % self.ep, rank // (self.tp * self.ep)
        if self.moe_dp_outside:
            pp_i, moe_i = outer % self.pp, outer // self.pp
        else:
            moe_i, pp_i = outer % moe_dp, outer // moe_dp
        return {"dp": moe_i * self.ep + ep_i, "pp": pp_i, "sp": 0, "tp": tp_i, "ep": ep_i,
                "moe_dp": moe_i}

    def build_mesh(self, device_type: Optional[str] = None) -> Topology:
        """The ("dp", "pp", "sp", "tp") DeviceMesh whose entry at (d, p, 0, t) is the rank
        with those coordinates (collective: every rank calls it)."""
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            raise ValueError(f"MoeDims is for {self.world_size} processes in an initialised "
                             "process group")
        ranks = torch.empty((self.dp, self.pp, 1, self.tp), dtype=torch.int64)
        for r in range(self.world_size):
            c = self.coords(r)
            ranks[c["dp"], c["pp"], 0, c["tp"]] = r
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return Topology(dims=self, mesh=DeviceMesh(device_type, ranks, mesh_dim_names=DIM_NAMES))


def moe_groups(dims: MoeDims) -> tuple[object, object, object]:
    """``(ep group, moe-dp group, pp x ep group)`` of this rank (module docstring's layout).

    The pp x ep group (the ranks of one (moe-dp, tp) index) holds one copy of every
    parameter (each stage's experts spread over its ep ranks): the gradient norm spans it.
    Collective: every rank creates every group, in one order.
    """
    from .hybrid_pipeline import new_groups

    ep = new_groups(dims, lambda c: (c["moe_dp"], c["pp"], c["tp"]))
    moe_dp = new_groups(dims, lambda c: (c["pp"], c["ep"], c["tp"]))
    model = new_groups(dims, lambda c: (c["moe_dp"], c["tp"]))
    return ep, moe_dp, model


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
        _mean_flat(grads, moe_dp_group if expert else dp_group, dp_size)


def average_over_ep(params, expert_ids: set[int], ep_group, ep: int) -> None:
    """Average the non-expert gradients over the ep group, one flat all-reduce per dtype
    (collective over the ep group); what ZeRO's per-parameter ep hooks do, at once, after a
    pipeline schedule (expert gradients are divided by ep by their gradient hooks)."""
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
