"""One-file model checkpoints (Colossal-AI's ``save_model(..., shard=False)``), for every plugin.

Colossal-AI writes an unsharded model as one plain state-dict file at ``checkpoint``. Every
fp8boost ``CheckpointIO`` writes directories (HF layout, swapped in atomically and
checksummed); here the plugin's own unsharded export is written into a hidden temp directory
next to the file, and its ``model.safetensors`` renamed onto ``checkpoint`` (``os.replace``:
a save that dies midway leaves the previous file intact). The file is a safetensors state
dict (tied weights saved once); it has no checksum record beside it (safetensors still names
a truncated file on load) and no ``config.json`` (HF ``from_pretrained`` wants a directory:
save with ``shard=True`` or to a directory path for that).

Loading a file links it, as ``model.safetensors``, into a per-process temp directory and
loads that with the plugin's own ``load_model`` (each rank reads only its part, as for
directories). A ``torch.save`` state dict (what Colossal-AI writes with its default
``use_safetensors=False``) is read too: each process loads it (``weights_only=True``) and
writes it as safetensors into that temp directory first (a full copy per process, on disk).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Optional

import torch
from safetensors.torch import save_file
from torch import nn

from . import coordination as coord
from .formats import MODEL_SINGLE

#: names that ``Booster.save_model(..., shard=False)`` writes as one file (other paths get a
#: directory holding ``model.safetensors``)
FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def is_file_target(path: str) -> bool:
    """Whether an unsharded model save to ``path`` writes one file there (see ``Booster``)."""
    return os.path.isfile(path) or (not os.path.isdir(path)
                                    and path.lower().endswith(FILE_SUFFIXES))


def save_model_file(io, model: nn.Module, path: str) -> None:
    """Write ``model``'s unsharded state dict as one safetensors file at ``path``.
    Collective over ``io.group`` (every rank calls it)."""
    path = os.path.abspath(path)
    group = io.group
    parent, name = os.path.dirname(path), os.path.basename(path)
    tmp, err = None, None
    if coord.rank(group) == 0:
        if os.path.isdir(path):
            err = f"{path} is a directory; an unsharded model checkpoint is one file"
        else:
            tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp, err = coord.broadcast_object((tmp, err), group)
    if err is not None:
        raise ValueError(err)
    try:
        io.save_model(model, tmp, False, 1024)  # atomic, agreed on every rank
        failure: Optional[BaseException] = None
        if coord.rank(group) == 0:
            try:
                os.replace(os.path.join(tmp, MODEL_SINGLE), path)
            except OSError as exc:
                failure = exc
        coord.raise_if_failed(path, failure, group)
    finally:
        if coord.rank(group) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    coord.barrier(group)


def load_model_file(io, model: nn.Module, path: str, strict: bool = True) -> None:
    """Load a one-file safetensors state dict (``save_model_file``'s, or any plain one) with
    the plugin's own ``load_model``."""
    path = os.path.abspath(path)
    tmp = tempfile.mkdtemp(prefix=f"fp8boost-load-{os.path.basename(path)}-")
    try:
        if _is_torch_pickle(path):  # Colossal-AI's use_safetensors=False file
            _pickle_to_safetensors(path, os.path.join(tmp, MODEL_SINGLE))
        else:
            os.symlink(path, os.path.join(tmp, MODEL_SINGLE))
        try:
            io.load_model(model, tmp, strict)
        except Exception as exc:  # name the user's file, not the temp link
            if tmp not in str(exc):
                raise
            try:
                renamed = type(exc)(str(exc).replace(os.path.join(tmp, MODEL_SINGLE), path)
                                    .replace(tmp, path))
            except Exception:  # noqa: BLE001 - an exception type with another signature
                raise exc from None
            raise renamed from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _is_torch_pickle(path: str) -> bool:
    """``torch.save``'s zip format (safetensors files start with a little-endian length)."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _pickle_to_safetensors(src: str, dst: str) -> None:
    sd = torch.load(src, map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict) and len(sd) == 1:
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{src} is a torch.save file but not a model state dict (a dict of "
                         "tensors): load_model reads state dicts and safetensors checkpoints")
    seen: set = set()
    out = {}
    for k, t in sd.items():  # tied weights: once, as save_model writes them
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[k] = t.detach().contiguous().clone()
    save_file(out, dst, metadata={"format": "pt"})
