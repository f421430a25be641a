"""``DTensorCheckpointIO``: checkpoints of models whose parameters are DTensors.

Used by the FSDP2 plugins (Gemini, TorchFSDP) and meant for DTensor tensor parallelism too:
nothing here assumes a mesh shape or a placement.

* ``save_model``: HF-layout safetensors that ``from_pretrained`` loads, gathered one tensor
  at a time with ``full_tensor()`` and streamed to disk by rank 0 (``hf_sharded``).
* ``load_model``: each rank reads only the slice of every tensor that its shard holds, so a
  model built on the meta device and materialised with ``to_empty`` is filled without a full
  copy anywhere.
* ``save_optimizer`` and ``save_checkpoint``: ``torch.distributed.checkpoint`` (DCP), each
  rank writing its own shards; loading reshards to any other world size or mesh.

Every save goes through ``atomic.atomic_save_dir``: a save that dies midway leaves the
previous checkpoint loadable.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from fp8boost.fp8.linear import weights_loaded
from fp8boost.parallel.fsdp.full_state_dict import sharded_state_dicts

from . import coordination as coord
from . import hf_sharded as hf
from .atomic import atomic_save_dir
from .base import CheckpointIO
from .checksums import verify_checksums
from .dcp_from_replicated import load_replicated_into_dcp
from .dcp_state import (OPTIM_FORMAT, OPTIM_MARKER, dcp_load, first_failure, lenient,
                        load_keyed_state, load_wrapper_state, match_saved_state,
                        optimizer_marker, param_names, pg_args, plain, prepared_optimizer_state,
                        quiet_single_process, raw_optimizer, wrapper_state)
from .formats import MODEL_INDEX, MODEL_SINGLE, OPTIM_INDEX, OPTIMIZER_MARKERS

STATE_DIR = "dcp"            # the DCP files of save_checkpoint, beside base.STATE_MARKER
STATE_EXTRA = "optimizer_wrapper.json"


class _Positional(nn.Module):
    """The optimizer's parameters as ``p0, p1, ...``: keys for an optimizer whose model is not
    known (a raw torch optimizer passed to ``save_optimizer``)."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        super().__init__()
        for i, p in enumerate(p for g in optim.param_groups for p in g["params"]):
            self.register_parameter(f"p{i}", p)


class DTensorCheckpointIO(CheckpointIO):
    """Checkpoint IO for models whose parameters are DTensors (any mesh, any placements).

    Every method is collective over ``self.group``. The plugin provides ``unwrap_model`` and
    ``checkpoint_group``; optimizers are the plugin's wrapper (``.optim`` is the torch
    optimizer, ``.model`` its model) or a plain torch optimizer.

    Example:
        >>> from fp8boost.booster import Booster                              # doctest: +SKIP
        >>> from fp8boost.plugins import GeminiPlugin                         # doctest: +SKIP
        >>> booster = Booster(plugin=GeminiPlugin())                          # doctest: +SKIP
        >>> model, opt, *_ = booster.boost(model, opt)                        # doctest: +SKIP
        >>> booster.save_model(model, "export")  # from_pretrained loads it  # doctest: +SKIP
        >>> booster.save_checkpoint("ckpt", model, opt, extra={"step": 100})  # doctest: +SKIP
        >>> booster.load_checkpoint("ckpt", model, opt)  # any world size     # doctest: +SKIP
    """

    state_format = "fp8boost-dcp-v1"

    # ---------------------------------------------------------------- HF-layout export
    def save_model(self, model: nn.Module, path: str, shard: bool = True,
                   size_per_shard_mb: float = 1024) -> None:
        """HF folder, gathered a tensor at a time (see ``hf_sharded.write_gathered``)."""
        if not isinstance(size_per_shard_mb, (int, float)) or size_per_shard_mb <= 0:
            raise ValueError(f"size_per_shard_mb must be > 0, got {size_per_shard_mb!r}")

        def write(tmp: str) -> None:
            self._write_model_into(model, tmp, shard, size_per_shard_mb)

        atomic_save_dir(path, self.group, write, (MODEL_INDEX, MODEL_SINGLE))

    def _write_model_into(self, model, directory: str, shard: bool, size_mb: float) -> None:
        writer = coord.rank(self.group) == 0
        if writer:
            os.makedirs(directory, exist_ok=True)
        hf.write_gathered(self.plugin.unwrap_model(model), directory, shard, size_mb, writer)

    def load_model(self, model: nn.Module, path: str, strict: bool = True) -> None:
        """Fill every parameter and persistent buffer from an HF folder (ours or
        ``save_pretrained``'s), each rank reading only its shards' slices."""
        module = self.plugin.unwrap_model(model)
        verify_checksums(os.fspath(path), self.group)  # every rank raises alike
        hf.read_sharded(module, os.fspath(path), strict)
        _after_load(module)

    # ------------------------------------------------------------- optimizer (DCP)
    def save_optimizer(self, optimizer, path: str) -> None:
        """Sharded optimizer state (DCP): every rank writes its own part."""
        raw_optimizer(optimizer)  # fail before any rank writes
        atomic_save_dir(path, self.group, lambda tmp: self._write_optimizer_into(optimizer, tmp),
                        OPTIMIZER_MARKERS)

    @sharded_state_dicts()  # DCP reads/writes the shards themselves
    def _write_optimizer_into(self, optimizer, directory: str) -> None:
        module, keys = self._optimizer_model(optimizer, None)
        raw = raw_optimizer(optimizer)
        self._dcp_save({"optim": plain(get_optimizer_state_dict(module, raw))}, directory)
        if coord.rank(self.group) == 0:
            marker = {"format": OPTIM_FORMAT, "keys": keys,
                      "world_size": coord.world_size(self.group),
                      "params": param_names(module, raw), **wrapper_state(optimizer)}
            with open(os.path.join(directory, OPTIM_MARKER), "w") as f:
                json.dump(marker, f, indent=1)

    @sharded_state_dicts()  # DCP reads/writes the shards themselves
    def load_optimizer(self, optimizer, path: str) -> None:
        """Load a ``save_optimizer`` directory written at any world size (DCP reshards), or a
        replicated/ZeRO plugin's optimizer checkpoint (:mod:`.dcp_from_replicated`)."""
        path = os.fspath(path)
        if (not os.path.exists(os.path.join(path, OPTIM_MARKER))
                and os.path.exists(os.path.join(path, OPTIM_INDEX))):  # TorchDDP's, ZeRO's
            verify_checksums(path, self.group)
            module, _ = self._optimizer_model(optimizer, None)
            load_replicated_into_dcp(optimizer, module, path, self.group)
            return
        marker = optimizer_marker(path)
        verify_checksums(path, self.group)  # every rank raises alike, before DCP reads
        module, _ = self._optimizer_model(optimizer, marker["keys"])
        load_keyed_state(optimizer, module, marker, path, self.group)

    def _optimizer_model(self, optimizer, keys: Optional[str]) -> tuple[nn.Module, str]:
        """The module whose parameter names key the state: the optimizer's model (FQN keys,
        robust to regrouped params), else its parameters by position."""
        model = getattr(optimizer, "model", None)
        if keys == "position" or (keys is None and model is None):
            return _Positional(raw_optimizer(optimizer)), "position"
        if model is None:
            raise TypeError("this optimizer checkpoint is keyed by parameter names: load it "
                            "with the optimizer returned by booster.boost() (it knows its model), "
                            "not the raw torch optimizer")
        return self.plugin.unwrap_model(model), "fqn"

    # ---------------------------------------------------------------- resumable state
    @sharded_state_dicts()  # DCP reads/writes the shards themselves
    def _write_state(self, tmp: str, model, optimizer, lr_scheduler) -> None:
        """Model and optimizer as ONE DCP checkpoint ``{"model": ..., "optim": ...}``."""
        module = self.plugin.unwrap_model(model)
        if optimizer is None:
            state = {"model": get_model_state_dict(module)}
        else:
            msd, osd = get_state_dict(module, [raw_optimizer(optimizer)])
            state = {"model": msd, "optim": osd}
        self._dcp_save(plain(state), os.path.join(tmp, STATE_DIR))
        if optimizer is not None and coord.rank(self.group) == 0:
            with open(os.path.join(tmp, STATE_EXTRA), "w") as f:
                json.dump(wrapper_state(optimizer), f)

    @sharded_state_dicts()  # DCP reads/writes the shards themselves
    def _read_state(self, path: str, model, optimizer) -> None:
        module = self.plugin.unwrap_model(model)
        state = {"model": plain(get_model_state_dict(module))}
        if optimizer is not None:
            state["optim"] = prepared_optimizer_state(module, raw_optimizer(optimizer))
        match_saved_state(state, os.path.join(path, STATE_DIR))
        dcp_load(state, os.path.join(path, STATE_DIR), self.group)
        set_model_state_dict(module, state["model"])  # strict: every key
        if optimizer is not None:
            set_optimizer_state_dict(module, raw_optimizer(optimizer), state["optim"],
                                     options=lenient())
            extra = os.path.join(path, STATE_EXTRA)
            if os.path.exists(extra):
                with open(extra) as f:
                    load_wrapper_state(optimizer, json.load(f))
        _after_load(module)

    # --------------------------------------------------------------------------- DCP
    def _dcp_save(self, state: dict, directory: str) -> None:
        try:
            with quiet_single_process():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(directory),
                         **pg_args(self.group))
        except CheckpointException as exc:  # a BaseException: `except Exception` misses it
            raise RuntimeError(f"writing the DCP checkpoint failed on ranks "
                               f"{sorted(exc.failures)}: {first_failure(exc)}") from exc


def _after_load(module: nn.Module) -> None:
    # Both loaders write in place, past Fp8Linear._load_from_state_dict: cached FP8 weight casts
    # describe the old weights, and a loaded delayed-scaling history must not be re-seeded.
    weights_loaded(module)
