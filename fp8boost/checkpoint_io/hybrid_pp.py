"""Pipeline-parallel parts of ``HybridCheckpointIO``: every stage holds different parameters.

Names stay the HF names at every split (``parallel/pipeline/split.py`` keeps the global layer
index, and a tied embedding keeps its canonical name ``model.embed_tokens.weight`` on the last
stage too), so DCP state written at one (pp, tp, dp) split loads by name into another: each
rank simply asks for the keys it holds. What pp changes:

* ``save_model``: global rank 0 writes the HF files, but holds only the first stage. Each
  tensor is gathered over tp onto its stage's first rank of data-parallel replica 0 (its
  *owner*) and sent to rank 0, one tensor at a time (never the whole model on one rank).
* key checks: a key a rank does not hold may belong to another stage, so "unexpected key"
  checks use the union of all ranks' keys (:func:`all_keys`, one ``all_gather_object``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from . import hf_sharded as hf
from .hybrid_tp import TpLayout
from .model_io import dedup_state_dict

__all__ = ["all_keys", "write_hf_gathered_pp", "merge_optimizer_index", "local_param_groups"]


def all_keys(plugin, module: nn.Module, dedup: bool = True) -> set[str]:
    """Union over every rank of ``module``'s state-dict keys (collective over the world)."""
    sd = module.state_dict(keep_vars=True)
    keys = list(dedup_state_dict(sd) if dedup else sd)
    out: list = [None] * dist.get_world_size(plugin.checkpoint_group)
    dist.all_gather_object(out, keys, group=plugin.checkpoint_group)
    return set().union(*out)


def _owned_entries(plugin, sd: dict, tp: TpLayout) -> list:
    """(key, full shape, dtype name) of the tensors this rank owns for the export."""
    coords = plugin.topology().dims.coords(dist.get_rank())
    if coords["dp"] or coords["tp"]:
        return []
    return [(k, tp.full_shape(k, t), str(t.dtype).removeprefix("torch."))
            for k, t in sd.items()]


def write_hf_gathered_pp(plugin, model: nn.Module, directory: str, shard: bool,
                         size_mb: float) -> None:
    """``write_hf_gathered`` under pipeline parallelism (collective over the world)."""
    module = plugin.unwrap_model(model)
    overrides = plugin.exact_weights(model)  # collective over dp: before the per-rank paths
    tp = TpLayout.of(plugin)
    sd = dedup_state_dict(module.state_dict(keep_vars=True))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _owned_entries(plugin, sd, tp))
    owner: dict[str, int] = {}
    shapes: dict[str, torch.Tensor] = {}
    for rank, entries in enumerate(gathered):  # pipeline order; a tied key: first stage wins
        for k, shape, dtype in entries:
            if k not in owner:
                owner[k] = rank
                shapes[k] = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
    me = dist.get_rank()
    my_pp = plugin.topology().rank("pp")
    pp_of = plugin.topology().dims.coords
    plan = hf.plan_files(shapes, shard, size_mb)
    names = hf.file_names(plan, shard)
    sink = hf.Sink(directory) if me == 0 else None
    device = _device(module)
    with torch.no_grad():
        for fname, keys in zip(names, plan):
            if sink is not None:
                sink.open(fname, [(k, shapes[k]) for k in keys])
            for k in keys:
                t = _fetch(k, owner[k], pp_of(owner[k])["pp"] == my_pp and plugin.dp_rank == 0,
                           sd, overrides, tp, shapes[k], device)
                if sink is not None:
                    sink.write(k, t)
                del t
            if sink is not None:
                sink.close()
    hf.finish(sink, module, directory, names, plan, shapes, shard)


def _fetch(k: str, owner: int, in_owner_group: bool, sd: dict, overrides: dict, tp: TpLayout,
           meta: torch.Tensor, device: torch.device) -> Optional[torch.Tensor]:
    """The full tensor ``k`` on global rank 0 (None elsewhere)."""
    me = dist.get_rank()
    t = None
    if in_owner_group:
        t = overrides.get(id(sd[k]), sd[k]).detach()
        if tp.size > 1 and k in tp.shard_dims:
            t = tp.gather(k, t, dst=owner)
    if owner == 0:
        return t if me == 0 else None
    if me == owner:
        dist.send(t.contiguous(), 0)
    elif me == 0:
        t = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        dist.recv(t, owner)
        return t
    return None


def _device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")



def merge_optimizer_index(plugin, index: dict) -> dict:
    """One optimizer index for the whole pipeline: every stage's parameters, by name.

    Each rank's ZeRO optimizer knows only its stages' parameters; rank 0 writes the index, so
    it must list all of them (param groups keep their order: stage by stage).
    """
    parts: list = [None] * dist.get_world_size(plugin.checkpoint_group)
    dist.all_gather_object(parts, index, group=plugin.checkpoint_group)
    params: dict = {}
    groups = [dict(g, params=[]) for g in parts[0]["param_groups"]]
    for part in parts:
        params.update(part["params"])
        for g, mine in zip(groups, part["param_groups"]):
            g["params"] += [n for n in mine["params"] if n not in g["params"]]
    return {"params": params, "param_groups": groups, "extra": parts[0]["extra"]}


def local_param_groups(plugin, groups: list[dict], held: set) -> list[dict]:
    """The saved param groups cut to the parameter names this rank ``held`` (collective: the
    names are checked against every rank's, so one that no stage holds raises ``ValueError``)."""
    parts: list = [None] * dist.get_world_size(plugin.checkpoint_group)
    dist.all_gather_object(parts, sorted(held), group=plugin.checkpoint_group)
    everywhere = set().union(*parts)
    unknown = [n for g in groups for n in g["params"] if n not in everywhere]
    if unknown:
        raise ValueError(f"the checkpoint's optimizer holds parameters {unknown[:3]} that no "
                         "pipeline stage's optimizer does: build it on the same model parameters")
    return [{**g, "params": [n for n in g["params"] if n in held]} for g in groups]
