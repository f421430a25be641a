"""``DTensorCheckpointIO``: checkpoints of FSDP2 / DTensor models (Gemini, TorchFSDP).

* ``save_model``: HF-layout safetensors (``from_pretrained`` loads them), gathered one
  parameter at a time with ``full_tensor()``; rank 0 holds at most one shard file's worth.
* ``load_model``: each rank reads only the slice of every tensor that its shard holds
  (``safe_open(...).get_slice``), so a model built on the meta device is filled without a
  full copy anywhere.
* ``save_optimizer`` / ``save_checkpoint``: ``torch.distributed.checkpoint`` (each rank
  writes its own shards; loading reshards to another world size).

Example:
    >>> booster = Booster(plugin=GeminiPlugin())                          # doctest: +SKIP
    >>> booster.save_model(model, "export")            # HF folder       # doctest: +SKIP
    >>> booster.save_checkpoint("ckpt", model, optimizer, scheduler)      # doctest: +SKIP
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import nn

from . import formats as cio
from .base import CheckpointIO

OPTIM_MARKER = "fp8boost_dcp_optimizer.json"


def _local_slices(p: torch.Tensor) -> Optional[tuple[slice, ...]]:
    """Index of this rank's local shard in the full tensor (None: a plain, whole tensor)."""
    if not hasattr(p, "device_mesh"):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _plain(obj):
    """The same state with wrapper-subclass locals (FP8 all-gather weights) as plain tensors.

    DCP pickles tensor types and refuses unknown ones on load; the inner tensor shares the
    parameter's storage, so loading into it still loads into the model.
    """
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if not torch.is_tensor(obj):
        return obj
    local = getattr(obj, "_local_tensor", None)
    if local is not None and hasattr(local, "_tensor"):
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(local._tensor, obj.device_mesh, obj.placements,
                                  run_check=False, shape=obj.shape, stride=obj.stride())
    if hasattr(obj, "_tensor") and type(obj) is not torch.Tensor:
        return obj._tensor
    return obj


def _raw_optimizer(optimizer) -> torch.optim.Optimizer:
    inner = getattr(optimizer, "optim", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError("save/load the optimizer returned by booster.boost() (got "
                        f"{type(optimizer).__name__})")
    return inner


class DTensorCheckpointIO(CheckpointIO):
    """Checkpoint IO for models whose parameters are DTensors (see the module docstring)."""

    state_format = "fp8boost-dcp-v1"

    # ------------------------------------------------------------------ HF-layout export
    def save_model(self, model: nn.Module, path: str, shard: bool = True,
                   size_per_shard_mb: float = 1024) -> None:
        if not isinstance(size_per_shard_mb, (int, float)) or size_per_shard_mb <= 0:
            raise ValueError(f"size_per_shard_mb must be > 0, got {size_per_shard_mb!r}")
        cio.atomic_save_dir(path, self.group,
                            lambda tmp: self._write_model_into(model, tmp, shard, size_per_shard_mb),
                            (cio.MODEL_INDEX, cio.MODEL_SINGLE))

    def _write_model_into(self, model, directory: str, shard: bool, size_mb: float) -> None:
        from safetensors.torch import save_file

        module = self.plugin.unwrap_model(model)
        writer = cio._rank(self.group) == 0
        seen: set[int] = set()
        limit = int(size_mb * 1024 * 1024) if shard else None
        files: list[dict] = []
        pending: dict[str, torch.Tensor] = {}
        size = 0
        if writer:
            os.makedirs(directory, exist_ok=True)

        def flush() -> None:
            nonlocal pending, size
            if pending:
                files.append({"keys": list(pending), "bytes": size})
                save_file(pending, os.path.join(directory, f"part-{len(files):05d}.tmp"),
                          metadata={"format": "pt"})
            pending, size = {}, 0

        for key, t in module.state_dict(keep_vars=True).items():
            if id(t) in seen:  # tied weights: written once, as save_pretrained does
                continue
            seen.add(id(t))
            full = _plain(t.full_tensor() if hasattr(t, "full_tensor") else t)  # collective
            if not writer:
                continue
            cpu = full.detach().to("cpu", copy=True).contiguous()
            nbytes = cpu.numel() * cpu.element_size()
            if limit is not None and pending and size + nbytes > limit:
                flush()
            pending[key] = cpu
            size += nbytes
        if writer:
            flush()
            self._finish_files(module, directory, files, shard)

    @staticmethod
    def _finish_files(module: nn.Module, directory: str, files: list[dict], shard: bool) -> None:
        """Name the parts as HF does and write the index (total_size = tensor bytes)."""
        weight_map, total = {}, 0
        n = len(files)
        for i, f in enumerate(files, 1):
            name = f"model-{i:05d}-of-{n:05d}.safetensors" if shard else cio.MODEL_SINGLE
            os.replace(os.path.join(directory, f"part-{i:05d}.tmp"), os.path.join(directory, name))
            weight_map.update({k: name for k in f["keys"]})
            total += f["bytes"]
        if shard:
            with open(os.path.join(directory, cio.MODEL_INDEX), "w") as fh:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh,
                          indent=2)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)
        gen = getattr(module, "generation_config", None)
        if gen is not None and hasattr(gen, "save_pretrained"):
            gen.save_pretrained(directory)

    def load_model(self, model: nn.Module, path: str, strict: bool = True) -> None:
        from safetensors import safe_open

        module = self.plugin.unwrap_model(model)
        path = os.fspath(path)
        files = self._files(path)
        own = module.state_dict(keep_vars=True)
        where: dict[str, str] = {}
        shapes: dict[str, tuple] = {}
        for fname in files:
            with _open(path, fname) as f:
                for k in f.keys():
                    where[k] = fname
                    shapes[k] = tuple(f.get_slice(k).get_shape())
        unexpected = [k for k in shapes if k not in own]
        wrong = [f"{k}: {shapes[k]} vs {tuple(own[k].shape)}" for k in shapes
                 if k in own and shapes[k] != tuple(own[k].shape)]
        loaded_ids = {id(own[k]) for k in shapes if k in own}
        missing = [k for k in own if k not in shapes and id(own[k]) not in loaded_ids]
        if wrong or (strict and (missing or unexpected)):
            raise RuntimeError(f"checkpoint {path} does not match the model: shape mismatches "
                               f"{wrong[:5]}, missing keys {missing[:10]}, unexpected keys "
                               f"{unexpected[:10]} (strict=False allows missing/unexpected keys)")
        handles: dict[str, object] = {}
        try:
            with torch.no_grad():
                for key, t in own.items():
                    if key not in where:
                        continue
                    if where[key] not in handles:
                        handles[where[key]] = _open(path, where[key]).__enter__()
                    sl = handles[where[key]].get_slice(key)
                    idx = _local_slices(t)
                    local = t._local_tensor if hasattr(t, "_local_tensor") else t
                    part = sl[idx] if idx is not None else sl[:]
                    local.copy_(part.reshape(local.shape).to(local.dtype))
        finally:
            for h in handles.values():
                h.__exit__(None, None, None)
        from fp8boost.fp8.linear import invalidate_weight_caches
        invalidate_weight_caches(module)

    @staticmethod
    def _files(path: str) -> list[str]:
        if os.path.exists(os.path.join(path, cio.MODEL_INDEX)):
            with open(os.path.join(path, cio.MODEL_INDEX)) as f:
                return list(dict.fromkeys(json.load(f)["weight_map"].values()))
        cio._require(path, "model", cio.MODEL_SINGLE)
        return [cio.MODEL_SINGLE]

    # ------------------------------------------------------------ sharded optimizer state
    def save_optimizer(self, optimizer, path: str) -> None:
        cio.atomic_save_dir(path, self.group, lambda tmp: self._write_optimizer_into(optimizer, tmp),
                            (OPTIM_MARKER,))

    def _write_optimizer_into(self, optimizer, directory: str) -> None:
        import torch.distributed.checkpoint as dcp

        model = self._model_of(optimizer)
        state = {"optim": self._optim_sd(model, optimizer)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory))
        if cio._rank(self.group) == 0:
            with open(os.path.join(directory, OPTIM_MARKER), "w") as f:
                json.dump({"format": self.state_format}, f)

    def load_optimizer(self, optimizer, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        path = os.fspath(path)
        cio._require(path, "optimizer", OPTIM_MARKER)
        model = self._model_of(optimizer)
        state = {"optim": self._optim_sd(model, optimizer)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
        set_optimizer_state_dict(model, _raw_optimizer(optimizer), state["optim"])

    @staticmethod
    def _model_of(optimizer) -> nn.Module:
        model = getattr(optimizer, "model", None)
        if model is None:
            raise TypeError("save/load the optimizer returned by booster.boost() of this plugin")
        return model

    @staticmethod
    def _optim_sd(model: nn.Module, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        return _plain(get_optimizer_state_dict(model, _raw_optimizer(optimizer)))

    # --------------------------------------------------------------- resumable state
    def _write_state(self, tmp: str, model, optimizer, lr_scheduler) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        module = self.plugin.unwrap_model(model)
        state = {"model": _plain(get_model_state_dict(module))}
        if optimizer is not None:
            state["optim"] = self._optim_sd(module, optimizer)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(tmp, "dcp")))

    def _read_state(self, path: str, model, optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             set_model_state_dict,
                                                             set_optimizer_state_dict)

        module = self.plugin.unwrap_model(model)
        state = {"model": _plain(get_model_state_dict(module))}
        if optimizer is not None:
            state["optim"] = self._optim_sd(module, optimizer)
        dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(path, "dcp")))
        set_model_state_dict(module, state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(module, _raw_optimizer(optimizer), state["optim"])
        from fp8boost.fp8.linear import invalidate_weight_caches
        invalidate_weight_caches(module)


class _open:
    """``safe_open`` that names the file when it is missing or corrupt."""

    def __init__(self, directory: str, fname: str) -> None:
        self.file = os.path.join(directory, fname)
        self.handle = None

    def __enter__(self):
        from safetensors import safe_open
        try:
            self.handle = safe_open(self.file, "pt")
            return self.handle.__enter__()
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, ...
            raise OSError(f"cannot read checkpoint file {self.file}: {exc}; the file is missing "
                          "or corrupt: restore it or load an earlier checkpoint") from exc

    def __exit__(self, *exc):
        if self.handle is not None:
            self.handle.__exit__(*exc)
        return False
