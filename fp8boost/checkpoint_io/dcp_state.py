"""DCP optimizer state: what the FSDP2 plugins' checkpoint IO (:mod:`.dcp`) and the replicated
plugins' loader (:func:`load_into_replicated`, from :mod:`.base`) share.

DCP keys optimizer state by parameter name (``state.<fqn>.exp_avg``); a directory written by
``DTensorCheckpointIO.save_optimizer`` holds DCP's files and :data:`OPTIM_MARKER` (format, how
it is keyed, the saving world size, the parameter names in the optimizer's order, and the
wrapper's fp16 loss-scale state).
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from fp8boost.parallel.fsdp.full_state_dict import local_of

from . import hf_sharded as hf
from .atomic import require
from .checksums import verify_checksums
from .formats import DCP_OPTIM_MARKER

OPTIM_MARKER = DCP_OPTIM_MARKER
OPTIM_FORMAT = "fp8boost-dcp-optimizer-v1"


def optimizer_marker(path: str) -> dict:
    """The marker of a DCP optimizer directory (its format checked; old formats filled in)."""
    require(path, "DCP optimizer", OPTIM_MARKER)
    with open(os.path.join(path, OPTIM_MARKER)) as f:
        marker = json.load(f)
    if marker.get("format") == "fp8boost-dcp-v1":  # first version: keyed by names
        marker.setdefault("keys", "fqn")
    elif marker.get("format") != OPTIM_FORMAT:
        raise ValueError(f"{path} has optimizer format {marker.get('format')!r}, expected "
                         f"{OPTIM_FORMAT!r}")
    return marker


def plain(obj):
    """The same nested state with weight-subclass locals (FP8 all-gather weights) replaced by
    their inner tensors.

    DCP pickles tensor types and refuses unknown ones on load; the inner tensor shares the
    parameter's storage, so an in-place DCP load into it still lands in the model.
    """
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if not torch.is_tensor(obj):
        return obj
    if hf.is_dtensor(obj):
        local = local_of(obj)
        if local is obj._local_tensor:
            return obj
        return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                  shape=obj.shape, stride=obj.stride())
    return local_of(obj)


def raw_optimizer(optimizer) -> torch.optim.Optimizer:
    inner = getattr(optimizer, "optim", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError("pass the optimizer returned by booster.boost() or a torch optimizer "
                        f"(got {type(optimizer).__name__})")
    return inner


def load_into_replicated(optimizer, path: str, group) -> None:
    """Load a DCP optimizer checkpoint (``GeminiPlugin``, ``TorchFSDPPlugin``) into an optimizer
    that steps the model's own full parameters (``TorchDDPPlugin``, no plugin): what
    Colossal-AI's ``test_gemini_torch_compability.py`` does. DCP gathers each saved shard into
    the full tensors; the saved parameter names (in the saving optimizer's order) are paired
    with this optimizer's parameters by position, as torch's ``load_state_dict`` pairs them.

    Raises:
        ValueError: the optimizer keeps master shards of its own (ZeRO), or the checkpoint
            predates the recorded names, or the parameter counts differ.
    """
    from fp8boost.parallel.wrappers import OptimizerWrapper  # the replicated plugins' wrapper

    marker = optimizer_marker(path)
    if not isinstance(optimizer, OptimizerWrapper):
        raise ValueError(f"{path} is a DCP optimizer checkpoint (GeminiPlugin/TorchFSDPPlugin); "
                         f"{type(optimizer).__name__} steps master shards of its own, so it "
                         "cannot take it: load it with GeminiPlugin or TorchFSDPPlugin (any "
                         "world size), or with TorchDDPPlugin")
    names = marker.get("params")
    raw = raw_optimizer(optimizer)
    params = [p for g in raw.param_groups for p in g["params"]]
    if names is None or len(names) != len(params):
        raise ValueError(f"{path}: " + ("saved by an earlier fp8boost, without parameter "
                                        "names: load it with GeminiPlugin or "
                                        "TorchFSDPPlugin" if names is None else
                                        f"{len(names)} parameters saved, this optimizer has "
                                        f"{len(params)}: same model and param groups needed"))
    verify_checksums(path, group)  # every rank raises alike, before DCP reads
    load_keyed_state(optimizer, _Named(names, params), marker, path, group)


def load_keyed_state(optimizer, module: nn.Module, marker: dict, path: str, group) -> None:
    """Load the DCP optimizer directory ``path`` into ``optimizer``, its state keyed by the
    parameter names of ``module`` (which holds the optimizer's parameters), then the wrapper's
    own state from ``marker``."""
    raw = raw_optimizer(optimizer)
    state = {"optim": prepared_optimizer_state(module, raw)}
    match_saved_state(state, path)
    dcp_load(state, path, group)
    set_optimizer_state_dict(module, raw, state["optim"], options=lenient())
    load_wrapper_state(optimizer, marker)


class _Named(nn.Module):
    """``params`` under the dotted ``names`` of the model that saved them (a module tree: DCP
    keys optimizer state by these names)."""

    def __init__(self, names: list[str], params: list[torch.Tensor]) -> None:
        super().__init__()
        for name, param in zip(names, params):
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            owner.register_parameter(leaf, param if isinstance(param, nn.Parameter)
                                     else nn.Parameter(param, requires_grad=False))


def param_names(module: nn.Module, raw: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters' names in ``module``, in the optimizer's order."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    return [names.get(id(p), f"p{i}") for i, p in
            enumerate(p for g in raw.param_groups for p in g["params"])]


def pg_args(group) -> dict:
    """DCP's process-group arguments: ``group``, or one process without a process group."""
    return {"process_group": group} if dist.is_initialized() else {"no_dist": True}


def dcp_load(state: dict, directory: str, group) -> None:
    if not os.path.exists(os.path.join(directory, ".metadata")):
        raise FileNotFoundError(f"no DCP checkpoint at {directory} (missing .metadata)")
    try:
        with quiet_single_process():
            dcp.load(state, storage_reader=dcp.FileSystemReader(directory), **pg_args(group))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - name the checkpoint
        why = first_failure(exc) if isinstance(exc, CheckpointException) else exc
        raise RuntimeError(f"cannot load the DCP checkpoint {directory} into this "
                           f"model/optimizer: {why}") from exc


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process even when told so (``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def first_failure(exc) -> BaseException:
    """The first rank's own exception inside DCP's ``CheckpointException``."""
    failures = getattr(exc, "failures", None) or {}
    if not failures:
        return exc
    cause = failures[min(failures)]
    return cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback)


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


def lenient():
    """Options of optimizer loads: parameters whose state the checkpoint legitimately lacks
    (``match_saved_state`` checked which) stay without state instead of failing."""
    return StateDictOptions(strict=False)


def prepared_optimizer_state(module: nn.Module, raw: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict, with state allocated (sharded like the parameters) so that
    DCP can load into it in place."""
    with _no_grads(raw):
        return plain(get_optimizer_state_dict(module, raw))


def _known(key: str, keys: set[str]) -> bool:
    """``key`` (DCP's flattened name) is one of ``keys`` or lies inside one of them."""
    while key:
        if key in keys:
            return True
        key = key.rpartition(".")[0]
    return False


def match_saved_state(state: dict, directory: str) -> None:
    """Check the checkpoint against what we load into; keep only optimizer state it holds.

    Saved tensors this model/optimizer has no place for mean another model or optimizer: an
    error (DCP itself would skip them silently). Parameters without optimizer state when the
    checkpoint was saved (frozen, unused, not stepped yet) stay without state, as in the run
    that saved.
    """
    if not os.path.exists(os.path.join(directory, ".metadata")):
        return  # dcp_load names the missing file
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


def wrapper_state(optimizer) -> dict:
    """State the plugin's wrapper keeps outside the torch optimizer (fp16 loss scale)."""
    scaler = getattr(optimizer, "loss_scaler", None)
    return {"loss_scaler": scaler.state_dict()} if hasattr(scaler, "state_dict") else {}


def load_wrapper_state(optimizer, saved: dict) -> None:
    scaler = getattr(optimizer, "loss_scaler", None)
    if saved.get("loss_scaler") is not None and hasattr(scaler, "load_state_dict"):
        scaler.load_state_dict(saved["loss_scaler"])
