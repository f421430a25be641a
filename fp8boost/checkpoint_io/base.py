"""The checkpoint interface every plugin implements, and the one for replicated models.

The Booster delegates every save/load to ``plugin.get_checkpoint_io()``; only the plugin knows
how its model and optimizer are laid out across ranks.

Two kinds of checkpoint:

* **exports** (``save_model``): HF-layout safetensors that ``from_pretrained`` loads, whatever
  the plugin; ``save_optimizer`` / ``save_lr_scheduler`` beside them;
* **resumable state** (``save_checkpoint(path, model, optimizer, lr_scheduler, extra)``): one
  directory holding everything needed to continue training, written atomically. Its layout
  is the plugin's business (``GeneralCheckpointIO``: an export + the re-shardable optimizer
  format; ``DTensorCheckpointIO``: ``torch.distributed.checkpoint``, each rank writing its own
  shards); every layout reloads into another world size.
"""
from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from typing import Optional

import torch
from torch import nn

from . import coordination as coord
from .atomic import atomic_save_dir, require
from .checksums import verify_checksums
from .dcp_state import load_into_replicated
from .formats import DCP_OPTIM_MARKER, MODEL_INDEX, MODEL_SINGLE, OPTIMIZER_MARKERS
from .model_io import read_model, write_model
from .optimizer_io import check_optimizer, read_optimizer, write_optimizer

STATE_MARKER = "fp8boost_checkpoint.json"


class CheckpointIO(ABC):
    """Saves and loads what one plugin trains. Every method is collective over the plugin's ranks."""

    def __init__(self, plugin) -> None:
        self.plugin = plugin

    @property
    def group(self):
        """Process group that coordinates saves (the plugin's whole world)."""
        return self.plugin.checkpoint_group

    # ------------------------------------------------------------------- export (HF layout)
    @abstractmethod
    def save_model(self, model: nn.Module, path: str, shard: bool = True,
                   size_per_shard_mb: float = 1024) -> None:
        """HF-layout safetensors directory (``from_pretrained`` loads it)."""

    @abstractmethod
    def load_model(self, model: nn.Module, path: str, strict: bool = True) -> None:
        """Load an HF-layout directory (ours or ``save_pretrained``'s)."""

    @abstractmethod
    def save_optimizer(self, optimizer, path: str) -> None:
        """Optimizer state, re-shardable to another world size."""

    @abstractmethod
    def load_optimizer(self, optimizer, path: str) -> None:
        """Load a state written by ``save_optimizer`` (any world size)."""

    def save_lr_scheduler(self, lr_scheduler, path: str) -> None:
        """``lr_scheduler.state_dict()`` to the file ``path`` (atomic; rank 0 writes)."""
        if not hasattr(lr_scheduler, "state_dict"):
            raise TypeError(f"lr_scheduler must have state_dict(), got {type(lr_scheduler).__name__}")
        path = os.path.abspath(path)
        failure = None
        if coord.rank(self.group) == 0:
            tmp = f"{path}.tmp-{os.getpid()}"
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save(lr_scheduler.state_dict(), tmp)
                os.replace(tmp, path)
            except OSError as exc:  # a full disk: every rank must hear of it, not hang
                failure = exc
                if os.path.exists(tmp):
                    os.remove(tmp)
        coord.raise_if_failed(path, failure, self.group)

    def load_lr_scheduler(self, lr_scheduler, path: str) -> None:
        lr_scheduler.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    # ----------------------------------------------------------------- resumable state
    def save_checkpoint(self, path: str, model: nn.Module, optimizer=None, lr_scheduler=None,
                        extra: Optional[dict] = None) -> None:
        """Everything needed to resume, in one directory, swapped in atomically.

        ``extra`` is a JSON-serialisable dict (step, data position, ...) returned by
        ``load_checkpoint``.
        """
        if extra is not None:
            json.dumps(extra)  # fail before any rank writes

        def write(tmp: str) -> None:
            self._write_state(tmp, model, optimizer, lr_scheduler)
            if coord.rank(self.group) == 0:
                if lr_scheduler is not None:
                    torch.save(lr_scheduler.state_dict(), os.path.join(tmp, "lr_scheduler.pt"))
                with open(os.path.join(tmp, STATE_MARKER), "w") as f:
                    json.dump({"format": self.state_format, "extra": extra or {}}, f, indent=1)

        atomic_save_dir(path, self.group, write, (STATE_MARKER,))

    def load_checkpoint(self, path: str, model: nn.Module, optimizer=None,
                        lr_scheduler=None) -> dict:
        """Restore a directory written by ``save_checkpoint``; returns its ``extra`` dict."""
        path = os.fspath(path)
        require(path, "resumable", STATE_MARKER)
        verify_checksums(path, self.group)  # every rank raises alike, before any read
        with open(os.path.join(path, STATE_MARKER)) as f:
            meta = json.load(f)
        if meta.get("format") != self.state_format:
            raise ValueError(f"{path} was written in format {meta.get('format')!r}; "
                             f"{type(self.plugin).__name__} reads {self.state_format!r}. Load the "
                             "model export (save_model) into this plugin instead, or resume with "
                             "the plugin that wrote it")
        self._read_state(path, model, optimizer)
        if lr_scheduler is not None:
            self.load_lr_scheduler(lr_scheduler, os.path.join(path, "lr_scheduler.pt"))
        return meta.get("extra", {})

    state_format = "fp8boost-general-v1"

    def _write_state(self, tmp: str, model, optimizer, lr_scheduler) -> None:
        """Write model (and optimizer) state into ``tmp`` (every rank calls it).

        Each part is agreed on before the next (``run_agreed``): the optimizer part starts
        with a barrier, which a rank whose model write failed would never reach.
        """
        coord.run_agreed(lambda: self._write_model_into(model, os.path.join(tmp, "model"), True,
                                                        1024), self.group)
        if optimizer is not None:
            coord.run_agreed(lambda: self._write_optimizer_into(
                optimizer, os.path.join(tmp, "optimizer")), self.group)

    def _read_state(self, path: str, model, optimizer) -> None:
        self.load_model(model, os.path.join(path, "model"))
        if optimizer is not None:
            self.load_optimizer(optimizer, os.path.join(path, "optimizer"))

    def _write_model_into(self, model, directory: str, shard: bool, size_mb: float) -> None:
        raise NotImplementedError

    def _write_optimizer_into(self, optimizer, directory: str) -> None:
        raise NotImplementedError


class GeneralCheckpointIO(CheckpointIO):
    """Replicated models (no plugin, DDP, ZeRO-1/2): data-parallel rank 0 writes the model;
    each rank that holds an optimizer shard writes it (see ``formats``)."""

    def save_model(self, model: nn.Module, path: str, shard: bool = True,
                   size_per_shard_mb: float = 1024) -> None:
        if not isinstance(size_per_shard_mb, (int, float)) or size_per_shard_mb <= 0:
            raise ValueError(f"size_per_shard_mb must be > 0, got {size_per_shard_mb!r}")
        atomic_save_dir(path, self.group,
                        lambda tmp: self._write_model_into(model, tmp, shard, size_per_shard_mb),
                        (MODEL_INDEX, MODEL_SINGLE))

    def _write_model_into(self, model, directory: str, shard: bool, size_mb: float) -> None:
        overrides = self.plugin.exact_weights(model)  # collective: before rank 0 writes alone
        if coord.rank(self.group) == 0:
            os.makedirs(directory, exist_ok=True)
            write_model(self.plugin.unwrap_model(model), directory, shard, size_mb, overrides)

    def load_model(self, model: nn.Module, path: str, strict: bool = True) -> None:
        verify_checksums(os.fspath(path), self.group)
        read_model(self.plugin.unwrap_model(model), os.fspath(path), strict)
        self.plugin.after_load_model(model)

    def save_optimizer(self, optimizer, path: str) -> None:
        check_optimizer(optimizer)
        atomic_save_dir(path, self.group, lambda tmp: self._write_optimizer_into(optimizer, tmp),
                        OPTIMIZER_MARKERS)

    def _write_optimizer_into(self, optimizer, directory: str) -> None:
        check_optimizer(optimizer)
        is_writer = optimizer.shard_world_size > 1 or coord.rank(self.group) == 0
        # Agreed instead of a bare barrier: a rank that cannot create the directory must not
        # leave the others waiting.
        coord.run_agreed(lambda: os.makedirs(directory, exist_ok=True) if is_writer else None,
                         self.group)
        write_optimizer(optimizer, directory, is_writer)

    def load_optimizer(self, optimizer, path: str) -> None:
        check_optimizer(optimizer)
        if os.path.exists(os.path.join(path, DCP_OPTIM_MARKER)):  # GeminiPlugin/TorchFSDPPlugin's
            load_into_replicated(optimizer, os.fspath(path), self.group)
            return
        # Collective: ranks read different shards, so one bad shard must stop every rank here.
        verify_checksums(os.fspath(path), self.group)
        read_optimizer(optimizer, os.fspath(path), self.group)

