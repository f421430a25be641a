"""A replicated/ZeRO optimizer checkpoint (``optimizer.index.json``: ``TorchDDPPlugin``,
``LowLevelZeroPlugin``, no plugin) loaded into an FSDP2 plugin's optimizer (``GeminiPlugin``,
``TorchFSDPPlugin``): what Colossal-AI's ``test_gemini_torch_compability.py`` does when it moves
a torch Adam's state into Gemini.

The reverse of :func:`.dcp_state.load_into_replicated`. Every rank reads each parameter's full
state (the checkpoint stores ranges of the flattened full tensors, whatever world size wrote
it) and torch's ``set_optimizer_state_dict`` with full state dicts keeps this rank's shard.
The saved parameters are paired with this optimizer's by position, as torch's
``load_state_dict`` pairs them. A ZeRO checkpoint's FP32 ``master_param`` pieces are the exact
weights: they are loaded into the model, as the replicated loader does.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                     set_optimizer_state_dict)

from fp8boost.fp8.linear import weights_loaded

from .coordination import agreed_read
from .dcp_state import load_wrapper_state, param_names, raw_optimizer
from .optimizer_io import (ShardPieces, check_saved_sizes, open_replicated, read_index,
                           replicated_state, restore_types)

MASTER = "master_param"  # a ZeRO optimizer's FP32 weight piece (optimizer_io's format)


def load_replicated_into_dcp(optimizer, module: nn.Module, path: str, group) -> None:
    """Load the ``optimizer.index.json`` directory ``path`` into ``optimizer``, an optimizer
    over ``module``'s FSDP2-sharded parameters.

    Raises:
        ValueError: the parameter counts or sizes differ from the saving optimizer's (same model
            and param groups needed).
    """
    index = read_index(path)
    raw = raw_optimizer(optimizer)
    params = [p for g in raw.param_groups for p in g["params"]]
    metas = index["params"]
    check_saved_sizes(path, metas, [p.numel() for p in params])
    names = param_names(module, raw)
    state: dict[str, dict] = {}
    masters: dict[str, torch.Tensor] = {}

    def read() -> None:
        pieces = ShardPieces(path, index)
        rep_file = open_replicated(path)
        for i, (meta, name) in enumerate(zip(metas, names)):
            entry = replicated_state(meta, i, rep_file)
            for key in meta["sharded"]:
                full = pieces.get(i, key, 0, meta["numel"]).view(meta["shape"])
                if key == MASTER:
                    masters[name] = full
                else:
                    entry[key] = full
            if entry:
                state[name] = entry

    # A bad shard file (in a checkpoint without checksums) stops every rank here, by name.
    agreed_read(read, group, path)
    groups, start = [], 0
    for saved, current in zip(restore_types(index["param_groups"], raw.param_groups),
                              raw.param_groups):
        end = start + len(current["params"])
        groups.append({**saved, "params": names[start:end]})
        start = end
    full = StateDictOptions(full_state_dict=True, strict=False)
    tuples = [{k for k, v in g.items() if isinstance(v, tuple)} for g in raw.param_groups]
    set_optimizer_state_dict(module, raw, {"state": state, "param_groups": groups},
                             options=full)
    # torch flattens a full state dict's nested values to distribute it, and its unflatten gives
    # lists back: Adam's betas must stay a tuple (Colossal-AI's test compares them with ==).
    for group, keys in zip(raw.param_groups, tuples):
        group.update({k: tuple(group[k]) for k in keys if isinstance(group.get(k), list)})
    if masters:
        set_model_state_dict(module, masters, options=full)
        weights_loaded(module)  # written in place: cached FP8 casts of the old weights are stale
    load_wrapper_state(optimizer, index.get("extra") or {})
