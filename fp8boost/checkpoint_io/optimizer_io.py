"""Optimizer I/O: the re-shardable optimizer format (see ``formats``).

The optimizer returned by ``booster.boost()`` describes its state through the checkpoint
protocol (``parallel/boosted_optimizer.py``): ``checkpoint_state()``, ``checkpoint_layout()``
and ``load_checkpoint_state()``; this module stores it and reads it back at any world size.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from fp8boost.parallel.boosted_optimizer import ShardedCheckpointState

from . import tensor_files
from .atomic import require
from .coordination import agreed_read
from .formats import OPTIM_FORMAT, OPTIM_INDEX, OPTIM_REPLICATED
from .tensor_files import cpu_copy, open_checked


def check_optimizer(optimizer) -> None:
    """Raise ``TypeError`` unless ``optimizer`` is one ``booster.boost()`` returned."""
    if not isinstance(optimizer, ShardedCheckpointState):
        raise TypeError("save/load the optimizer returned by booster.boost(), not the raw torch "
                        f"optimizer (got {type(optimizer).__name__})")


def jsonable(value):
    """A param-group value as JSON can store it (tensors and tuples become lists)."""
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return value


def _shard_file(rank: int, world: int) -> str:
    return f"optimizer-rank{rank:05d}-of-{world:05d}.safetensors"


def write_optimizer(optimizer, directory: str, is_writer: bool) -> None:
    """Write this rank's part of the optimizer state (see ``formats``)."""
    sharded, replicated, groups, extra = optimizer.checkpoint_state()
    world, rank = optimizer.shard_world_size, optimizer.shard_rank
    if not is_writer:
        return
    tensors = {f"{i}/{k}": cpu_copy(v) for i, d in sharded.items() for k, v in d.items()
               if v.numel() > 0}
    tensor_files.save_file(tensors, os.path.join(directory, _shard_file(rank, world)))
    if rank != 0:
        return
    rep_tensors, params = {}, []
    for i, shard in enumerate(optimizer.checkpoint_layout()):
        values = {}
        for k, v in replicated.get(i, {}).items():
            if torch.is_tensor(v):
                rep_tensors[f"{i}/{k}"] = cpu_copy(v)
            else:
                json.dumps(v)  # raises TypeError for state we cannot store
                values[k] = v
        params.append({"shape": list(shard.shape), "numel": shard.numel,
                       "sharded": sorted(sharded.get(i, {})),
                       "replicated_tensors": sorted(k for k, v in replicated.get(i, {}).items()
                                                    if torch.is_tensor(v)),
                       "replicated_values": values})
    tensor_files.save_file(rep_tensors, os.path.join(directory, OPTIM_REPLICATED))
    groups = [{k: jsonable(v) for k, v in g.items()} for g in groups]
    index = {"format": OPTIM_FORMAT, "world_size": world, "param_groups": groups,
             "params": params, "extra": extra}
    with open(os.path.join(directory, OPTIM_INDEX), "w") as f:
        json.dump(index, f, indent=1)


def restore_types(saved_groups: list[dict], current_groups: list[dict]) -> list[dict]:
    """Saved (JSON) param groups with the tuple and tensor values of ``current_groups``."""
    out = []
    for saved, cur in zip(saved_groups, current_groups):
        g = dict(saved)
        for k, v in cur.items():
            if k in g and k != "params":
                if isinstance(v, tuple):
                    g[k] = tuple(g[k])
                elif torch.is_tensor(v):
                    g[k] = torch.tensor(g[k], dtype=v.dtype, device=v.device)
        out.append(g)
    return out


class ShardPieces:
    """Reads ranges of the flattened full-size state from one optimizer directory, whatever
    world size wrote it (each shard file opened once, on first use).

    Args:
        directory: an optimizer directory (``formats``).
        index: its parsed ``optimizer.index.json``.
    """

    def __init__(self, directory: str, index: dict) -> None:
        self.directory, self.metas = directory, index["params"]
        self.saved_world = index["world_size"]
        self.handles: dict[int, object] = {}

    def get(self, i: int, key: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of parameter ``i``'s flattened state ``key`` (1-D)."""
        numel, world = self.metas[i]["numel"], self.saved_world
        c = -(-numel // world)
        parts = []
        for q in range(start // c, -(-end // c)) if end > start else []:
            qs, qe = q * c, min(q * c + c, numel)
            a, b = max(start, qs), min(end, qe)
            if a >= b:
                continue
            if q not in self.handles:
                self.handles[q] = open_checked(
                    os.path.join(self.directory, _shard_file(q, world)),
                    lambda p: safe_open(p, "pt"))
            parts.append(self.handles[q].get_slice(f"{i}/{key}")[a - qs:b - qs])
        if not parts:
            return torch.zeros(0)
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def read_index(directory: str, what: str = "optimizer", name: str = OPTIM_INDEX,
               fmt: str = OPTIM_FORMAT) -> dict:
    """``directory``'s ``what`` index file ``name``, after checking it is there and in format
    ``fmt`` (default: the optimizer index of this module)."""
    require(directory, what, name)
    with open(os.path.join(directory, name)) as f:
        index = json.load(f)
    if index.get("format") != fmt:
        raise ValueError(f"{directory} has {what} format {index.get('format')!r}, "
                         f"expected {fmt!r}")
    return index


def check_saved_sizes(directory: str, metas: list[dict], numels: list[int]) -> None:
    """Raise ``ValueError`` unless the saved parameters (``metas``, the index's ``params``)
    match this optimizer's parameter sizes ``numels`` one for one."""
    if len(metas) != len(numels) or any(m["numel"] != n for m, n in zip(metas, numels)):
        raise ValueError(f"optimizer checkpoint {directory} holds {len(metas)} parameters "
                         f"{[m['numel'] for m in metas][:8]}..., this optimizer has {len(numels)} "
                         f"{numels[:8]}...: same model and param groups needed")


def open_replicated(directory: str):
    """The directory's replicated-state file, opened (a bad file raises naming it)."""
    return open_checked(os.path.join(directory, OPTIM_REPLICATED), lambda p: safe_open(p, "pt"))


def replicated_state(meta: dict, i: int, rep_file) -> dict:
    """Parameter ``i``'s replicated state: its JSON values and its tensors in ``rep_file``."""
    state = dict(meta["replicated_values"])
    state.update({k: rep_file.get_tensor(f"{i}/{k}") for k in meta["replicated_tensors"]})
    return state


def read_optimizer(optimizer, directory: str, group=None) -> None:
    """Load optimizer state saved by any world size into this rank's layout.

    ``group``: the ranks loading together (a read error on one raises on all).
    """
    index = read_index(directory)
    layout = optimizer.checkpoint_layout()
    metas = index["params"]
    check_saved_sizes(directory, metas, [s.numel for s in layout])
    pieces = ShardPieces(directory, index)
    sharded, replicated = {}, {}

    def read() -> None:
        rep_file = open_replicated(directory)
        for i, (meta, s) in enumerate(zip(metas, layout)):
            sharded[i] = {k: pieces.get(i, k, s.start, s.end) for k in meta["sharded"]}
            replicated[i] = replicated_state(meta, i, rep_file)

    # Ranks read different shards: a bad one (in a checkpoint without checksums) must stop
    # every rank here with its name, before load_checkpoint_state's collectives.
    agreed_read(read, group, directory)
    groups = restore_types(index["param_groups"], optimizer.param_groups)
    optimizer.load_checkpoint_state(sharded, replicated, groups, index.get("extra", {}))
