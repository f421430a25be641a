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

import contextlib
import json
import os
import warnings
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from fp8boost.fp8.linear import weights_loaded
from fp8boost.parallel.fsdp.full_state_dict import local_of, sharded_state_dicts

from . import coordination as coord
from . import hf_sharded as hf
from .atomic import atomic_save_dir, require
from .base import CheckpointIO
from .checksums import verify_checksums
from .formats import MODEL_INDEX, MODEL_SINGLE, OPTIM_INDEX

OPTIM_MARKER = "fp8boost_dcp_optimizer.json"
OPTIM_FORMAT = "fp8boost-dcp-optimizer-v1"
STATE_DIR = "dcp"            # the DCP files of save_checkpoint, beside base.STATE_MARKER
STATE_EXTRA = "optimizer_wrapper.json"


def _plain(obj):
    """The same nested state with weight-subclass locals (FP8 all-gather weights) replaced by
    their inner tensors.

    DCP pickles tensor types and refuses unknown ones on load; the inner tensor shares the
    parameter's storage, so an in-place DCP load into it still lands in the model.
    """
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if not torch.is_tensor(obj):
        return obj
    if hf.is_dtensor(obj):
        local = local_of(obj)
        if local is obj._local_tensor:
            return obj
        return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                  shape=obj.shape, stride=obj.stride())
    return local_of(obj)


def _raw_optimizer(optimizer) -> torch.optim.Optimizer:
    inner = getattr(optimizer, "optim", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError("pass the optimizer returned by booster.boost() or a torch optimizer "
                        f"(got {type(optimizer).__name__})")
    return inner


class _Positional(nn.Module):
    """The optimizer's parameters as ``p0, p1, ...``: keys for an optimizer whose model is not
    known (a raw torch optimizer passed to ``save_optimizer``)."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        super().__init__()
        for i, p in enumerate(p for g in optim.param_groups for p in g["params"]):
            self.register_parameter(f"p{i}", p)


@contextlib.contextmanager
def _no_grads(optim: torch.optim.Optimizer) -> Iterator[None]:
    """Hide gradients while DCP's ``get_optimizer_state_dict`` initialises a fresh optimizer:
    it skips the initialisation when any gradient exists, and the load would then fill
    nothing."""
    saved = [(p, p.grad) for g in optim.param_groups for p in g["params"]]
    if optim.state:
        yield
        return
    for p, _ in saved:
        p.grad = None
    try:
        yield
    finally:
        for p, g in saved:
            p.grad = g


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
        _raw_optimizer(optimizer)  # fail before any rank writes
        atomic_save_dir(path, self.group, lambda tmp: self._write_optimizer_into(optimizer, tmp),
                        (OPTIM_MARKER,))

    @sharded_state_dicts()  # DCP reads/writes the shards themselves
    def _write_optimizer_into(self, optimizer, directory: str) -> None:
        module, keys = self._optimizer_model(optimizer, None)
        raw = _raw_optimizer(optimizer)
        self._dcp_save({"optim": _plain(get_optimizer_state_dict(module, raw))}, directory)
        if coord.rank(self.group) == 0:
            marker = {"format": OPTIM_FORMAT, "keys": keys,
                      "world_size": coord.world_size(self.group), **_wrapper_state(optimizer)}
            with open(os.path.join(directory, OPTIM_MARKER), "w") as f:
                json.dump(marker, f, indent=1)

    @sharded_state_dicts()  # DCP reads/writes the shards themselves
    def load_optimizer(self, optimizer, path: str) -> None:
        """Load a ``save_optimizer`` directory written at any world size (DCP reshards)."""
        path = os.fspath(path)
        marker = self._optimizer_marker(path)
        verify_checksums(path, self.group)  # every rank raises alike, before DCP reads
        module, _ = self._optimizer_model(optimizer, marker["keys"])
        raw = _raw_optimizer(optimizer)
        state = {"optim": _prepared_optimizer_state(module, raw)}
        _match_saved_state(state, path)
        self._dcp_load(state, path)
        set_optimizer_state_dict(module, raw, state["optim"], options=_lenient())
        _load_wrapper_state(optimizer, marker)

    def _optimizer_model(self, optimizer, keys: Optional[str]) -> tuple[nn.Module, str]:
        """The module whose parameter names key the state: the optimizer's model (FQN keys,
        robust to regrouped params), else its parameters by position."""
        model = getattr(optimizer, "model", None)
        if keys == "position" or (keys is None and model is None):
            return _Positional(_raw_optimizer(optimizer)), "position"
        if model is None:
            raise TypeError("this optimizer checkpoint is keyed by parameter names: load it "
                            "with the optimizer returned by booster.boost() (it knows its model), "
                            "not the raw torch optimizer")
        return self.plugin.unwrap_model(model), "fqn"

    @staticmethod
    def _optimizer_marker(path: str) -> dict:
        if not os.path.exists(os.path.join(path, OPTIM_MARKER)) and \
                os.path.exists(os.path.join(path, OPTIM_INDEX)):
            raise ValueError(f"{path} is an optimizer checkpoint of a replicated/ZeRO plugin "
                             f"({OPTIM_INDEX}); this plugin reads DCP optimizer checkpoints "
                             f"({OPTIM_MARKER})")
        require(path, "DCP optimizer", OPTIM_MARKER)
        with open(os.path.join(path, OPTIM_MARKER)) as f:
            marker = json.load(f)
        if marker.get("format") == "fp8boost-dcp-v1":  # first version: keyed by names
            marker.setdefault("keys", "fqn")
        elif marker.get("format") != OPTIM_FORMAT:
            raise ValueError(f"{path} has optimizer format {marker.get('format')!r}, expected "
                             f"{OPTIM_FORMAT!r}")
        return marker

    # ---------------------------------------------------------------- resumable state
    @sharded_state_dicts()  # DCP reads/writes the shards themselves
    def _write_state(self, tmp: str, model, optimizer, lr_scheduler) -> None:
        """Model and optimizer as ONE DCP checkpoint ``{"model": ..., "optim": ...}``."""
        module = self.plugin.unwrap_model(model)
        if optimizer is None:
            state = {"model": get_model_state_dict(module)}
        else:
            msd, osd = get_state_dict(module, [_raw_optimizer(optimizer)])
            state = {"model": msd, "optim": osd}
        self._dcp_save(_plain(state), os.path.join(tmp, STATE_DIR))
        if optimizer is not None and coord.rank(self.group) == 0:
            with open(os.path.join(tmp, STATE_EXTRA), "w") as f:
                json.dump(_wrapper_state(optimizer), f)

    @sharded_state_dicts()  # DCP reads/writes the shards themselves
    def _read_state(self, path: str, model, optimizer) -> None:
        module = self.plugin.unwrap_model(model)
        state = {"model": _plain(get_model_state_dict(module))}
        if optimizer is not None:
            state["optim"] = _prepared_optimizer_state(module, _raw_optimizer(optimizer))
        _match_saved_state(state, os.path.join(path, STATE_DIR))
        self._dcp_load(state, os.path.join(path, STATE_DIR))
        set_model_state_dict(module, state["model"])  # strict: every key
        if optimizer is not None:
            set_optimizer_state_dict(module, _raw_optimizer(optimizer), state["optim"],
                                     options=_lenient())
            extra = os.path.join(path, STATE_EXTRA)
            if os.path.exists(extra):
                with open(extra) as f:
                    _load_wrapper_state(optimizer, json.load(f))
        _after_load(module)

    # --------------------------------------------------------------------------- DCP
    def _pg(self) -> dict:
        # Without a process group DCP runs in this one process.
        if dist.is_initialized():
            return {"process_group": self.group}
        return {"no_dist": True}

    def _dcp_save(self, state: dict, directory: str) -> None:
        try:
            with _quiet_single_process():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(directory), **self._pg())
        except CheckpointException as exc:  # a BaseException: `except Exception` misses it
            raise RuntimeError(f"writing the DCP checkpoint failed on ranks "
                               f"{sorted(exc.failures)}: {_first_failure(exc)}") from exc

    def _dcp_load(self, state: dict, directory: str) -> None:
        if not os.path.exists(os.path.join(directory, ".metadata")):
            raise FileNotFoundError(f"no DCP checkpoint at {directory} (missing .metadata)")
        try:
            with _quiet_single_process():
                dcp.load(state, storage_reader=dcp.FileSystemReader(directory), **self._pg())
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - name the checkpoint
            why = _first_failure(exc) if isinstance(exc, CheckpointException) else exc
            raise RuntimeError(f"cannot load the DCP checkpoint {directory} into this "
                               f"model/optimizer: {why}") from exc


# -------------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process even when told so (``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _first_failure(exc) -> BaseException:
    """The first rank's own exception inside DCP's ``CheckpointException``."""
    failures = getattr(exc, "failures", None) or {}
    if not failures:
        return exc
    cause = failures[min(failures)]
    return cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback)


def _lenient():
    """Options of optimizer loads: parameters whose state the checkpoint legitimately lacks
    (``_match_saved_state`` checked which) stay without state instead of failing."""
    return StateDictOptions(strict=False)


def _prepared_optimizer_state(module: nn.Module, raw: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict, with state allocated (sharded like the parameters) so that
    DCP can load into it in place."""
    with _no_grads(raw):
        return _plain(get_optimizer_state_dict(module, raw))


def _known(key: str, keys: set[str]) -> bool:
    """``key`` (DCP's flattened name) is one of ``keys`` or lies inside one of them."""
    while key:
        if key in keys:
            return True
        key = key.rpartition(".")[0]
    return False


def _match_saved_state(state: dict, directory: str) -> None:
    """Check the checkpoint against what we load into; keep only optimizer state it holds.

    Saved tensors this model/optimizer has no place for mean another model or optimizer: an
    error (DCP itself would skip them silently). Parameters without optimizer state when the
    checkpoint was saved (frozen, unused, not stepped yet) stay without state, as in the run
    that saved.
    """
    if not os.path.exists(os.path.join(directory, ".metadata")):
        return  # _dcp_load names the missing file
    saved = FileSystemReader(directory).read_metadata().state_dict_metadata
    if "optim" in state and not any(k.startswith("optim.") for k in saved):
        raise ValueError(f"{directory} was saved without an optimizer; load it with "
                         "optimizer=None (or pass the checkpoint that has one)")
    wanted = {f"model.{k}" for k in state.get("model", {})}
    per_param = state.get("optim", {}).get("state", {})
    wanted |= {f"optim.state.{fqn}.{k}" for fqn, st in per_param.items() for k in st}
    loading = tuple(f"{part}." for part in state)  # "model." and/or "optim."
    unknown = sorted(k for k in saved if k.startswith(loading) and
                     not k.startswith("optim.param_groups") and not _known(k, wanted))
    if unknown:
        raise RuntimeError(f"{directory} does not fit this model/optimizer: it holds "
                           f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}, which have no "
                           "place here (another model, optimizer or param-group layout?)")
    for fqn in list(per_param):
        keys = [k for k in per_param[fqn] if f"optim.state.{fqn}.{k}" in saved]
        if keys:
            per_param[fqn] = {k: per_param[fqn][k] for k in keys}
        else:
            del per_param[fqn]


def _wrapper_state(optimizer) -> dict:
    """State the plugin's wrapper keeps outside the torch optimizer (fp16 loss scale)."""
    scaler = getattr(optimizer, "loss_scaler", None)
    return {"loss_scaler": scaler.state_dict()} if hasattr(scaler, "state_dict") else {}


def _load_wrapper_state(optimizer, saved: dict) -> None:
    scaler = getattr(optimizer, "loss_scaler", None)
    if saved.get("loss_scaler") is not None and hasattr(scaler, "load_state_dict"):
        scaler.load_state_dict(saved["loss_scaler"])


def _after_load(module: nn.Module) -> None:
    # Both loaders write in place, past Fp8Linear._load_from_state_dict: cached FP8 weight casts
    # describe the old weights, and a loaded delayed-scaling history must not be re-seeded.
    weights_loaded(module)
