"""Model I/O of replicated models: HF-layout safetensors (see ``formats``)."""
from __future__ import annotations

import json
import os
from typing import Callable, Hashable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from . import tensor_files
from .atomic import require
from .formats import MODEL_INDEX, MODEL_SINGLE
from .tensor_files import cpu_copy, open_checked


def dedup_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop keys whose tensor is an exact alias of an earlier key (tied weights)."""
    seen: set[tuple] = set()
    out = {}
    for k, t in sd.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[k] = t
    return out


def plan_shards(sd: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Keys per file: state-dict order, a new file when the next tensor would pass
    ``max_bytes`` (a larger single tensor gets a file of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for k, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nbytes
    return shards


def write_model(model: nn.Module, directory: str, shard: bool, size_per_shard_mb: float,
                overrides: Optional[dict[int, torch.Tensor]] = None) -> None:
    """Write ``model``'s state into ``directory`` (HF layout; see ``formats``).

    ``overrides`` maps ``id(param)`` to the tensor to write in its place.
    """
    sd = dedup_state_dict(model.state_dict(keep_vars=True))
    if overrides:
        sd = {k: overrides.get(id(t), t) for k, t in sd.items()}
    if not shard:
        tensor_files.save_file({k: cpu_copy(t) for k, t in sd.items()},
                               os.path.join(directory, MODEL_SINGLE), metadata={"format": "pt"})
    else:
        plan = plan_shards(sd, int(size_per_shard_mb * 1024 * 1024))
        weight_map, total = {}, 0
        for n, keys in enumerate(plan, 1):
            fname = f"model-{n:05d}-of-{len(plan):05d}.safetensors"
            tensors = {k: cpu_copy(sd[k]) for k in keys}
            tensor_files.save_file(tensors, os.path.join(directory, fname),
                                   metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update({k: fname for k in keys})
        with open(os.path.join(directory, MODEL_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(directory)


def storage_key(t: torch.Tensor) -> tuple:
    """What tied tensors share: storage, offset and shape."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))


def check_keys(own: dict[str, torch.Tensor], shapes: dict[str, tuple], directory: str,
               strict: bool, identity: Callable[[torch.Tensor], Hashable] = storage_key) -> None:
    """Raise RuntimeError unless the checkpoint's ``{key: shape}`` fits the model's state dict
    ``own``: shapes must match; with ``strict``, no key may be missing or unexpected. A key
    missing from the files is fine when the model ties it to a loaded tensor (same
    ``identity``: storage by default)."""
    unexpected = [k for k in shapes if k not in own]
    wrong = [f"{k}: {shapes[k]} vs {tuple(own[k].shape)}" for k in shapes
             if k in own and shapes[k] != tuple(own[k].shape)]
    loaded = {identity(own[k]) for k in shapes if k in own}
    missing = [k for k in own if k not in shapes and identity(own[k]) not in loaded]
    if wrong or (strict and (missing or unexpected)):
        raise RuntimeError(f"checkpoint {directory} does not match the model: shape mismatches "
                           f"{wrong[:5]}, missing keys {missing[:10]}, unexpected keys "
                           f"{unexpected[:10]} (strict=False allows missing/unexpected keys)")


def read_model(model: nn.Module, directory: str, strict: bool = True) -> None:
    """Load a directory written by ``write_model`` (or by HF ``save_pretrained``).

    Keys and shapes are checked against the model before any weight is copied, so a mismatch
    leaves the model untouched.
    """
    if os.path.exists(os.path.join(directory, MODEL_INDEX)):
        with open(os.path.join(directory, MODEL_INDEX)) as f:
            files = list(dict.fromkeys(json.load(f)["weight_map"].values()))
    else:
        require(directory, "model", MODEL_SINGLE)
        files = [MODEL_SINGLE]
    own = model.state_dict()
    shapes: dict[str, tuple] = {}
    for fname in files:
        with open_checked(os.path.join(directory, fname), lambda p: safe_open(p, "pt")) as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    check_keys(own, shapes, directory, strict)
    for fname in files:
        part = open_checked(os.path.join(directory, fname), load_file)
        model.load_state_dict({k: v for k, v in part.items() if k in own}, strict=False)
