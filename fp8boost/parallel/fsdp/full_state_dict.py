"""FSDP1's default state-dict type (``FULL_STATE_DICT``) on an FSDP2 model.

Torch's FSDP1 ``state_dict()`` gives every parameter as a plain tensor at its full shape, on
every rank, and its ``load_state_dict`` takes such tensors back; FSDP2's gives and wants
``DTensor`` shards. Colossal-AI's ``TorchFSDPPlugin`` is FSDP1, and its scripts compare,
``torch.save`` and reload ``model.state_dict()`` / ``model.unwrap().state_dict()`` as plain
tensors. :func:`enable_full_state_dict` gives an FSDP2 root that behaviour:

* ``state_dict()`` gathers every DTensor into a plain full tensor on the device of its shard
  (collective: every rank calls it, as with FSDP1). ``state_dict(keep_vars=True)`` still gives
  the live (sharded) parameters: a gathered copy is not the variable the caller asked for.
* ``load_state_dict`` cuts a plain tensor at a DTensor parameter's full shape to this rank's
  shard (locally, nothing is communicated); DTensors load as they are.

fp8boost's own checkpoint IO reads and writes the shards themselves (DCP): it works inside
:func:`sharded_state_dicts`, FSDP1's ``SHARDED_STATE_DICT`` context in spirit.

Example:
    >>> with sharded_state_dicts():  # hooks installed by enable_full_state_dict step aside
    ...     pass
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["enable_full_state_dict", "sharded_state_dicts", "full_state_dict_enabled", "local_of",
           "full_of", "shard_like"]

_MARK = "_fp8boost_full_state_dict"
# A context variable, not a module attribute: DCP's helpers call state_dict() on whatever
# module they are given (the root or a submodule), and all of them must see the shards.
_SHARDED = contextvars.ContextVar("fp8boost_sharded_state_dicts", default=False)


@contextlib.contextmanager
def sharded_state_dicts() -> Iterator[None]:
    """Inside the block, ``state_dict()`` of every root that :func:`enable_full_state_dict`
    changed gives FSDP2's DTensor shards again (what DCP saves and loads in place)."""
    token = _SHARDED.set(True)
    try:
        yield
    finally:
        _SHARDED.reset(token)


def full_state_dict_enabled(module: nn.Module) -> bool:
    """Whether :func:`enable_full_state_dict` was applied to ``module``."""
    return bool(getattr(module, _MARK, False))


def enable_full_state_dict(root: nn.Module) -> None:
    """Make ``root.state_dict()`` give plain full tensors and ``root.load_state_dict`` take
    them (see the module docstring). Idempotent.

    Args:
        root: the FSDP2 root module (``fully_shard`` applied), the user's model.
    """
    if full_state_dict_enabled(root):
        return
    root.register_state_dict_post_hook(_gather_hook)
    root.register_load_state_dict_pre_hook(_shard_hook)
    setattr(root, _MARK, True)


def _is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns this rank's data: the local shard of a DTensor (else ``t``),
    unwrapped from weight subclasses (FP8 all-gather weights keep it in ``inner_tensor``)."""
    local = t._local_tensor if _is_dtensor(t) else t
    if type(local) not in (torch.Tensor, nn.Parameter) and hasattr(local, "inner_tensor"):
        local = local.inner_tensor
    return local


def full_of(value):
    """A DTensor gathered into a plain tensor on the device of its shard (collective); else
    ``value``. The gather runs on the mesh's device (a CPU-offloaded shard of a CUDA mesh
    moves there) and sees through weight subclasses."""
    if not _is_dtensor(value):
        return value
    local = local_of(value)
    device = local.device
    local = local.detach().to(value.device_mesh.device_type)
    gatherable = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                    shape=value.shape, stride=value.stride())
    return gatherable.full_tensor().to(device)


def shard_like(value, param: Optional[torch.Tensor]):
    """A plain tensor at DTensor ``param``'s full shape, cut to this rank's piece of it (a
    DTensor laid out as ``param``; local, nothing is communicated); anything else as it is
    (a wrong shape is left for ``load_state_dict`` to report)."""
    if (not _is_dtensor(param) or _is_dtensor(value) or not torch.is_tensor(value)
            or value.shape != param.shape):
        return value
    mesh = param.device_mesh
    return distribute_tensor(value.detach().to(mesh.device_type), mesh, param.placements,
                             src_data_rank=None)  # every rank holds the full tensor


def _gather_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """``state_dict`` post-hook: DTensor copies (not the live parameters) become full."""
    if _SHARDED.get():
        return
    # The same keys in the same order on every rank: the gathers pair up.
    for key in [k for k in state_dict if k.startswith(prefix)]:
        value = state_dict[key]
        if not isinstance(value, nn.Parameter):
            state_dict[key] = full_of(value)


def _shard_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata, strict,
                missing_keys, unexpected_keys, error_msgs) -> None:
    """``load_state_dict`` pre-hook: a plain tensor at a DTensor parameter's full shape is
    replaced by this rank's shard of it (children load from the same, edited, dict)."""
    if _SHARDED.get():
        return
    for name, param in module.named_parameters(remove_duplicate=False):
        key = prefix + name
        value = state_dict.get(key)
        shard = shard_like(value, param)
        if shard is not value:
            state_dict[key] = shard.to(param.device)
