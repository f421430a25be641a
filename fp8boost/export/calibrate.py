"""Static activation and KV-cache scales from a few batches: amaxes observed in forward.

Forward hooks on every quantized linear record the amax of its input (``input_scale``) and,
on the attention projections, of the keys and values they produce (``k_scale``/``v_scale``;
GPT-2's fused ``c_attn`` output is split in three). Keys are observed before the rotary
embedding: the rotation mixes pairs of channels, so the post-RoPE amax can exceed this by up to
sqrt(2); the e4m3 cast saturates there rather than overflowing. Collective: every rank runs the
same batches and the amaxes are max-reduced over the world (tensor-parallel shards see parts).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..fp8.scaling import E4M3, fp8_max
from .quantize import QuantTarget


def _kv_roles(targets: list[QuantTarget]) -> dict[str, list[tuple[str, int, int]]]:
    """module name -> [(attention name + role, chunk index, chunks)] for k/v producers."""
    roles: dict[str, list] = {}
    for t in targets:
        parent, _, leaf = t.module.rpartition(".")
        if leaf == "k_proj":
            roles[t.module] = [(f"{parent}.k_scale", 0, 1)]
        elif leaf == "v_proj":
            roles[t.module] = [(f"{parent}.v_scale", 0, 1)]
        elif leaf == "c_attn":  # GPT-2: [q | k | v] along the last dim
            roles[t.module] = [(f"{parent}.k_scale", 1, 3), (f"{parent}.v_scale", 2, 3)]
    return roles


def _update(stats: dict, key: str, x: torch.Tensor) -> None:
    a = x.detach().abs().amax().float().cpu() if x.numel() else torch.zeros(())
    stats[key] = torch.maximum(stats[key], a) if key in stats else a


def observe(model: nn.Module, module: nn.Module, targets: list[QuantTarget],
            batches: Iterable, inputs: bool, kv: bool) -> dict[str, torch.Tensor]:
    """Run ``model`` on ``batches``; return ``{key: amax}`` for ``<linear>.input_scale`` and
    ``<attention>.k_scale`` / ``.v_scale`` (collective when distributed).

    Args:
        model: what to call (the boosted model: its forward runs the plugin's collectives).
        module: the unwrapped model whose submodules are named as in the checkpoint.
        targets: the quantized weights (:func:`quantize.find_targets`).
        batches: dicts of keyword inputs (or tensors passed positionally).
        inputs / kv: observe linear inputs / key and value outputs.

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> stats = observe(lin, lin, [QuantTarget("weight", "", False)],
        ...                 [torch.ones(1, 2)], True, False)
        >>> float(stats[".input_scale"])
        1.0
    """
    stats: dict[str, torch.Tensor] = {}
    names = {t.module for t in targets}
    roles = _kv_roles(targets) if kv else {}
    hooks = []
    for name, m in module.named_modules():
        if name not in names:
            continue
        if inputs:
            hooks.append(m.register_forward_pre_hook(
                lambda _m, args, n=name: _update(stats, f"{n}.input_scale", args[0])))
        if name in roles:
            def kv_hook(_m, _args, out, rs=roles[name]):
                for key, i, n in rs:
                    _update(stats, key, out.chunk(n, dim=-1)[i])
            hooks.append(m.register_forward_hook(kv_hook))
    modes = [(m, m.training) for m in module.modules()]
    try:
        module.eval()
        with torch.no_grad():
            for b in batches:
                model(**b) if isinstance(b, dict) else model(b)
    finally:
        for h in hooks:
            h.remove()
        for m, mode in modes:
            m.train(mode)
    return _reduce(stats)


def _reduce(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return stats
    keys = sorted(stats)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: float(stats[k]) for k in keys})
    merged: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            merged[k] = max(merged.get(k, v), v)
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in merged.items()}


def to_scale(a: torch.Tensor) -> torch.Tensor:
    """A static dequantization multiplier from an observed amax: ``amax / 448`` (1 for 0).

    Example:
        >>> float(to_scale(torch.tensor(448.0)))
        1.0
    """
    a = a.float()
    return torch.where(a > 0, a / fp8_max(E4M3), torch.ones_like(a))
