"""Shared pieces of the plugin tests: a tiny model, deterministic data, a training loop.

Everything here is module-level so spawned ranks can import it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

GLOBAL_BATCH = 16


def make_mlp(seed: int = 0) -> torch.nn.Module:
    """An MLP whose dims are multiples of 16, so every linear converts to FP8."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 16))


def global_batch(step: int, size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, 32, generator=g), torch.randn(size, 16, generator=g)


def local_part(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    b = t.shape[0] // world
    return t[rank * b:(rank + 1) * b]


def train(booster, model, opt, rank: int, world: int, steps: int, start: int = 0,
          micro: int = 1) -> list[float]:
    """``steps`` optimizer steps on the global batches ``start..``; returns global mean losses.

    Each rank takes its 1/world of the global batch; with ``micro > 1`` that part is split into
    micro-batches, all but the last under ``no_sync`` (loss divided by ``micro``).
    """
    losses = []
    for s in range(start, start + steps):
        x, y = global_batch(s)
        x, y = local_part(x, rank, world), local_part(y, rank, world)
        total = torch.zeros(())
        for k, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            loss = F.mse_loss(model(xm).float(), ym) / micro
            if k < micro - 1:
                with booster.no_sync(model, opt):
                    booster.backward(loss, opt)
            else:
                booster.backward(loss, opt)
            total += loss.detach().float()
        opt.step()
        opt.zero_grad()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses


def true_weights(model, opt) -> list[torch.Tensor]:
    """The weights training really holds: FP32 masters where there are, else the params."""
    if hasattr(opt, "full_master_params"):
        return opt.full_master_params()
    return [p.detach().float().clone() for p in model.unwrap().parameters()]


def flat(ts) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in ts])


def rel_update_error(weights, ref_weights, init_weights) -> float:
    """||w - w_ref|| / ||w_ref - w_0||: the error relative to how far training moved."""
    w, r, w0 = flat(weights), flat(ref_weights), flat(init_weights)
    return ((w - r).norm() / (r - w0).norm()).item()


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))
