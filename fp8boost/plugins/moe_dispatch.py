"""Expert parallelism: token dispatch and combine by all-to-all around a rank's local experts.

:class:`EpExperts` replaces a fused-expert module (HF ``MixtralExperts``-like, or its
:class:`~fp8boost.fp8.moe.Fp8Experts`) on each rank of an expert-parallel group of size ``ep``.
The rank keeps experts ``[r*E/ep, (r+1)*E/ep)`` of the layer: the 3-D Parameters are sliced in
place (same Parameter objects, same HF names, first dim E/ep). Forward, for the model's own
routing ``(top_k_index, top_k_weights)``:

1. the (token, choice) pairs are sorted by the rank owning their expert (stable);
2. the per-rank pair counts are exchanged (one all-to-all of ints), then the pairs' hidden
   rows and local expert ids are dispatched by an all-to-all with uneven splits;
3. the local experts run on the received rows (each row is one choice, weight 1);
4. the inverse all-to-all brings the expert outputs back, and each token sums its k outputs
   weighted by its routing weights (as HF's experts module: product, cast, sum over k).

Both all-to-alls are autograd functions whose backward is the inverse all-to-all, in the
gradient's dtype. With ``fp8`` the dispatched rows travel as e4m3 with one scale per row
(per token choice); the rows a rank keeps for itself are never quantized.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from fp8boost.fp8.moe import find_expert_spec, is_fp8_experts

E4M3_MAX = 448.0


def _plain_a2a(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def fp8_rows_a2a(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """All-to-all of 2-D ``x`` with e4m3 rows, one FP32 scale per row (two all-to-alls: bytes
    and scales). The chunk this rank keeps is copied in full precision."""
    rank = dist.get_rank(group)
    amax = x.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    q = (x.detach().float() * (E4M3_MAX / amax)).to(torch.float8_e4m3fn).view(torch.uint8)
    rq = _plain_a2a(q, send, recv, group)
    ramax = _plain_a2a(amax, send, recv, group)
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
        return _plain_a2a(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102 - autograd protocol
        return _plain_a2a(grad, ctx.recv, ctx.send, ctx.group), None, None, None, None


def expert_spec_of(module: nn.Module):
    """The :class:`ExpertSpec` of an HF fused-expert module or an ``Fp8Experts``, else None."""
    if is_fp8_experts(module):
        return module.spec
    found = find_expert_spec(module)
    return found if not isinstance(found, str) else None


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every fused-expert module of ``model``, in order."""
    return [(n, m) for n, m in model.named_modules() if expert_spec_of(m) is not None]


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
        hf = inner.hf_module if is_fp8_experts(inner) else inner
        if is_fp8_experts(inner):
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

    def _exchange(self, counts: torch.Tensor) -> list[int]:
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.ep_group)
        return recv.tolist()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden)
        t, k = x.shape[0], top_k_index.shape[-1]
        ids = top_k_index.reshape(-1).long()
        valid = (ids >= 0) & (ids < self.num_experts)
        ids = torch.where(valid, ids, 0)
        weights = torch.where(valid, top_k_weights.reshape(-1), 0).unsqueeze(1)
        dest = ids // self.local
        order = torch.sort(dest, stable=True).indices
        send = torch.bincount(dest, minlength=self.ep)
        recv = self._exchange(send)
        send = send.tolist()
        local_ids = _plain_a2a((ids % self.local)[order], send, recv, self.ep_group)
        rows = AllToAll.apply(x.index_select(0, order // k), send, recv, self.ep_group, self.fp8)
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        out = self.inner(rows, local_ids.unsqueeze(1), ones)
        if torch.is_grad_enabled():
            # Every rank runs both all-to-alls' backward (no rows here: connect them anyway),
            # and every local expert gets a gradient (zeros if it got no token: ZeRO buckets
            # must match across ranks).
            anchor = sum(getattr(self, n).reshape(-1)[0] for n in self.names) * 0
            out = out + anchor.to(out.dtype) + (rows * 0 if rows.shape[0] == 0 else 0)
        back = AllToAll.apply(out, recv, send, self.ep_group, False)
        pairs = back[torch.argsort(order)]
        return (pairs * weights).to(hidden_states.dtype).view(t, k, -1).sum(1).view(shape)

    def extra_repr(self) -> str:
        return (f"experts={self.local}/{self.num_experts} (ep rank {self.ep_rank} of {self.ep}), "
                f"fp8_dispatch={self.fp8}, inner={type(self.inner).__name__}")


def shard_experts(model: nn.Module, ep_group, fp8: bool = False) -> list[tuple[str, EpExperts]]:
    """Replace every fused-expert module of ``model`` by its :class:`EpExperts` (in place)."""
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


@contextlib.contextmanager
def whole_experts(modules: list[EpExperts]) -> Iterator[None]:
    """Inside the block each :class:`EpExperts`' Parameters hold all E experts (zeros but for
    this rank's); on exit each keeps its own experts' rows again (e.g. after a load)."""
    kept = []
    with torch.no_grad():
        for m in modules:
            for name in m.names:
                p = getattr(m, name)
                local = p.data
                full = local.new_zeros((m.num_experts,) + tuple(local.shape[1:]))
                full[m.ep_rank * m.local:(m.ep_rank + 1) * m.local] = local
                p.data = full
                kept.append((m, p, local))
    try:
        yield
    finally:
        with torch.no_grad():
            for m, p, local in kept:
                lo = m.ep_rank * m.local
                local.copy_(p.data[lo:lo + m.local])
                p.data = local


@contextlib.contextmanager
def gathered_experts(modules: list[EpExperts]) -> Iterator[None]:
    """Inside the block each :class:`EpExperts`' Parameters hold all E experts, all-gathered
    over its ep group (collective: every rank enters with the same modules, in order); on exit
    each keeps its own experts again. For exports that read ``state_dict()`` (the tp export
    of ``checkpoint_io/hybrid.py``): every rank holds the whole experts meanwhile."""
    kept = []
    with torch.no_grad():
        for m in modules:
            for name in m.names:
                p = getattr(m, name)
                full = m.full_param(name)
                kept.append((p, p.data))
                p.data = full
    try:
        yield
    finally:
        for p, local in kept:
            p.data = local
