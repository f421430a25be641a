"""Whole experts for checkpoints and exports: every expert of a layer on one rank, for a while.

Each :class:`~fp8boost.parallel.ep.experts.EpExperts` holds ``E/ep`` experts. Saving and
loading HF files wants all ``E``: :func:`gathered_experts` all-gathers them over the ep group
(an export that reads ``state_dict()``), :func:`whole_experts` pads them with zeros (a load
that writes every expert and keeps this rank's rows), :func:`full_expert_weights` gathers one
Parameter at a time (an export that asks per Parameter).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from .experts import EpExperts


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


def full_expert_weights(model: nn.Module) -> dict[int, torch.Tensor]:
    """``{id(Parameter): all E experts}`` for every :class:`EpExperts` Parameter of ``model``
    (collective over each ep group: every rank calls it). Inside :func:`gathered_experts` the
    Parameters are whole already and are taken as they are."""
    out = {}
    for module in model.modules():
        if isinstance(module, EpExperts):
            for name in module.names:
                p = getattr(module, name)
                out[id(p)] = p.detach() if p.shape[0] == module.num_experts \
                    else module.full_param(name)
    return out
