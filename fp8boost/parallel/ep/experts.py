"""``EpExperts``: one rank's share of a fused-expert module, with dispatch and combine.

:class:`EpExperts` replaces a fused-expert module (HF ``MixtralExperts``-like, or its
:class:`~fp8boost.fp8.moe.Fp8Experts`) on each rank of an expert-parallel group of size ``ep``.
The rank keeps experts ``[r*E/ep, (r+1)*E/ep)`` of the layer: the 3-D Parameters are sliced in
place (same Parameter objects, same HF names, first dim E/ep). Forward, for the model's own
routing ``(top_k_index, top_k_weights)``:

1. the (token, choice) pairs are sorted by the rank owning their expert and dispatched
   (:mod:`~fp8boost.parallel.ep.dispatch`);
2. the local experts run on the received rows (each row is one choice, weight 1);
3. the combine brings the expert outputs back, and each token sums its k outputs weighted by
   its routing weights (as HF's experts module: product, cast, sum over k).

Under ``torch.compile`` (``fp8boost.compile.compile_blocks``) the forward runs eager: the
all-to-alls size their splits on the host (``plan_splits``), which dynamo cannot trace
without a graph break anyway, so the block compiles around it (attention, router, norms in
graphs; the exchange and the local experts, with their fused FP8 cast kernels, eager). One
deliberate graph break per MoE block (``torch.compiler.disable``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost.fp8.moe import find_expert_spec
from fp8boost.fp8.record import recorded_experts
from fp8boost.parallel.comm.plan import CommPlan

from .dispatch import combine, dispatch, plan_splits


def expert_spec_of(module: nn.Module):
    """The :class:`ExpertSpec` of an HF fused-expert module or an ``Fp8Experts``, else None."""
    if recorded_experts(module):
        return module.spec
    found = find_expert_spec(module)
    return found if not isinstance(found, str) else None


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every fused-expert module of ``model``, in order."""
    return [(n, m) for n, m in model.named_modules() if expert_spec_of(m) is not None]


def check_expert_split(model: nn.Module, ep: int) -> None:
    """Whether ``model``'s experts can be split over ``ep`` ranks (no collective).

    Raises:
        ValueError: ``ep > 1`` on a model without fused experts, or an expert count that
            ``ep`` does not divide.
    """
    experts = find_experts(model)
    if ep > 1 and not experts:
        raise ValueError("ep_size > 1 but the model has no fused-expert MoE module "
                         "(3-D gate_up_proj/down_proj Parameters): use ep_size=1")
    for name, module in experts:
        n = expert_spec_of(module).num_experts
        if n % ep:
            raise ValueError(f"ep_size={ep} does not divide the {n} experts of {name}: "
                             "use an ep_size that divides the expert count")


class EpExperts(nn.Module):
    """One rank's share of a fused-expert module, with dispatch and combine (module docstring).

    Args:
        inner: the HF fused-expert module or its ``Fp8Experts`` (its Parameters are sliced in
            place to this rank's experts and registered here under the same names).
        ep_group: the expert-parallel process group (its size divides E).
        fp8: dispatch the hidden rows in e4m3 with per-row scales.
    """

    def __init__(self, inner: nn.Module, ep_group, fp8: bool = False) -> None:
        super().__init__()
        spec = expert_spec_of(inner)
        self.ep, self.ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        if spec is None or spec.num_experts % self.ep:
            raise ValueError(f"EpExperts needs a fused-expert module whose expert count divides "
                             f"ep={self.ep}, got {type(inner).__name__}")
        self.num_experts, self.local = spec.num_experts, spec.num_experts // self.ep
        self.hidden, self.names = spec.hidden, (spec.gate_up, spec.down)
        self.ep_group, self.fp8 = ep_group, fp8
        lo = self.ep_rank * self.local
        with torch.no_grad():
            for name in self.names:
                p = getattr(inner, name)
                p.data = p.data[lo:lo + self.local].clone()
                self.register_parameter(name, p)
        fp8_inner = recorded_experts(inner)
        hf = inner.hf_module if fp8_inner else inner
        if fp8_inner:
            inner.spec = replace(spec, num_experts=self.local)
        if hasattr(hf, "num_experts"):
            hf.num_experts = self.local
        object.__setattr__(self, "inner", inner)  # not a submodule: no duplicate state
        self.train(inner.training)

    def train(self, mode: bool = True):
        """Set train/eval on this module and on the wrapped experts module."""
        super().train(mode)
        self.__dict__["inner"].train(mode)
        return self

    def full_param(self, name: str) -> torch.Tensor:
        """Parameter ``name`` with every expert of the layer (all-gather over the ep group)."""
        p = getattr(self, name).detach().contiguous()
        parts = [torch.empty_like(p) for _ in range(self.ep)]
        dist.all_gather(parts, p, group=self.ep_group)
        return torch.cat(parts, 0)

    @torch.compiler.disable  # host-sized all-to-alls: eager inside a compiled block
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden)
        t, k = x.shape[0], top_k_index.shape[-1]
        ids = top_k_index.reshape(-1).long()
        valid = (ids >= 0) & (ids < self.num_experts)  # padding choices: weight 0, expert 0
        ids = torch.where(valid, ids, 0)
        weights = torch.where(valid, top_k_weights.reshape(-1), 0).unsqueeze(1)
        splits = plan_splits(ids, self.local, self.ep_group)
        rows, local_ids = dispatch(x, ids, splits, top_k=k, num_local=self.local,
                                   group=self.ep_group, fp8=self.fp8)
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        out = self.inner(rows, local_ids.unsqueeze(1), ones)
        if torch.is_grad_enabled():
            # Every rank runs both all-to-alls' backward (no rows here: connect them anyway),
            # and every local expert gets a gradient (zeros if it got no token: ZeRO buckets
            # must match across ranks).
            anchor = sum(getattr(self, n).reshape(-1)[0] for n in self.names) * 0
            out = out + anchor.to(out.dtype) + (rows * 0 if rows.shape[0] == 0 else 0)
        pairs = combine(out, splits, self.ep_group)
        return (pairs * weights).to(hidden_states.dtype).view(t, k, -1).sum(1).view(shape)

    def extra_repr(self) -> str:
        return (f"experts={self.local}/{self.num_experts} (ep rank {self.ep_rank} of {self.ep}), "
                f"fp8_dispatch={self.fp8}, inner={type(self.inner).__name__}")


def shard_experts(model: nn.Module, ep_group,
                  comm_plan: Optional[CommPlan] = None) -> list[tuple[str, EpExperts]]:
    """Replace every fused-expert module of ``model`` by its :class:`EpExperts` (in place).

    ``comm_plan`` (the plugin's :class:`~fp8boost.parallel.comm.plan.CommPlan`; None: plain
    all-to-alls): ``ep_dispatch.fp8`` dispatches the rows in e4m3 with per-row scales."""
    fp8 = comm_plan is not None and comm_plan.ep_dispatch.fp8
    done = []
    for name, module in find_experts(model):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapped = EpExperts(module, ep_group, fp8)
        setattr(parent, attr, wrapped)
        done.append((name, wrapped))
    return done


def expert_params(model: nn.Module) -> set[int]:
    """ids of the Parameters held by the :class:`EpExperts` of ``model``."""
    return {id(p) for m in model.modules() if isinstance(m, EpExperts)
            for p in m.parameters(recurse=False)}
