"""torch's ``state_dict`` layout for the master-weight optimizers (ZeRO included).

``MasterWeightOptimizer.state_dict()`` returns what ``torch.optim.Optimizer.state_dict()``
returns for an unsharded optimizer over the model's parameters: ``param_groups`` and, per
parameter index, every state tensor at the parameter's full shape (gathered over the shard
ranks), plus ``"master_param"``, the FP32 master weight that the working (BF16) parameter
cannot hold exactly. ``load_state_dict`` cuts each full tensor back to this rank's chunk, so a
state dict saved at one data-parallel size loads at another, and a plain torch optimizer's
state dict (no ``master_param``) loads too: the masters then keep their values, so load the
model first (``model.load_state_dict`` refreshes them from the loaded weights). Under tensor or
pipeline parallelism "full" means this rank's tp slice / stage: the state is gathered over the
data-parallel (ZeRO) ranks only.

The gathers go through the optimizer's public ``full_tensor`` (exact, never on the FP8 wire).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional, Protocol

import torch

from fp8boost.parallel.optimizer_surface import LOSS_SCALER_KEY

from .sharding import ParamShard

__all__ = ["MASTER_KEY", "full_state_dict", "load_full_state_dict"]

#: the per-parameter state key holding the FP32 master weight (as in the checkpoint format)
MASTER_KEY = "master_param"


class ShardedMasters(Protocol):
    """What these functions read of a master-weight optimizer (``MasterWeightOptimizer``
    implements it); a protocol, so this module needs no import of ``master.py``, which imports
    it."""

    optim: torch.optim.Optimizer
    """The inner optimizer over the FP32 master chunks."""
    masters: Sequence[torch.Tensor]
    """This rank's FP32 master chunk of each parameter."""
    shards: Sequence[ParamShard]
    """Which part of each parameter the chunk holds."""
    loss_scaler: Optional[Any]
    """The FP16 loss scaler, or None."""

    def full_tensor(self, chunk: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s full tensor gathered from every rank's ``chunk``."""

    def load_loss_scaler_state(self, state: Optional[Mapping]) -> None:
        """Restore the loss scaler from its saved state (None: nothing saved)."""


def _is_chunk_state(key: str, value, master: torch.Tensor) -> bool:
    """A per-element state tensor of this rank's chunk (Adam's moments), not ``step``."""
    return (key != "step" and torch.is_tensor(value) and value.dim() == 1
            and value.shape == master.shape)


def full_state_dict(opt: ShardedMasters) -> dict:
    """torch's optimizer state dict at full parameter shapes (collective over the shard
    ranks: every rank calls it and gets the same result).

    Example:
        >>> import torch
        >>> from fp8boost.parallel.zero import ZeroOptimizer
        >>> layer = torch.nn.Linear(4, 2).to(torch.bfloat16)
        >>> opt = ZeroOptimizer(torch.optim.AdamW(layer.parameters()))
        >>> sd = full_state_dict(opt)
        >>> sd["state"][0]["master_param"].shape, sd["state"][0]["master_param"].dtype
        (torch.Size([2, 4]), torch.float32)
    """
    sd = opt.optim.state_dict()
    state: dict[int, dict] = {}
    for i, master in enumerate(opt.masters):
        local = sd["state"].get(i, {})
        entry = {}
        for key in sorted(local):  # the same order on every rank: the gathers pair up
            value = local[key]
            entry[key] = opt.full_tensor(value, i) if _is_chunk_state(key, value, master) \
                else value
        entry[MASTER_KEY] = opt.full_tensor(master, i)
        state[i] = entry
    out = {"state": state, "param_groups": sd["param_groups"]}
    if opt.loss_scaler is not None:
        out[LOSS_SCALER_KEY] = opt.loss_scaler.state_dict()
    return out


def _chunk_of(value: torch.Tensor, shard: ParamShard, master: torch.Tensor) -> torch.Tensor:
    """This rank's zero-padded chunk of a full-size tensor, on the master's device."""
    out = torch.zeros(shard.chunk, dtype=value.dtype, device=master.device)
    out[: shard.length].copy_(value.detach().reshape(-1)[shard.start:shard.end])
    return out


def load_full_state_dict(opt: ShardedMasters, state_dict: Mapping) -> bool:
    """Load a :func:`full_state_dict` (or a plain torch one) into ``opt``; returns whether
    master weights were loaded (the caller then writes them into the working parameters).

    Raises:
        ValueError: ``state_dict`` lacks torch's ``state`` / ``param_groups``.
    """
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("load_state_dict takes torch's optimizer state dict (a mapping with "
                         "'state' and 'param_groups'), e.g. what optimizer.state_dict() returned")
    saved = state_dict["state"]
    state: dict[int, dict] = {}
    masters_loaded = False
    for i, (shard, master) in enumerate(zip(opt.shards, opt.masters)):
        entry = dict(saved.get(i, {}))
        full_master = entry.pop(MASTER_KEY, None)
        for key, value in list(entry.items()):
            # Per-element state has the parameter's shape; anything else (the step counter,
            # factored statistics) is the same on every rank and stays whole, as saved.
            if key != "step" and torch.is_tensor(value) and tuple(value.shape) == shard.shape:
                entry[key] = _chunk_of(value, shard, master)
        if full_master is not None:
            with torch.no_grad():
                master.copy_(_chunk_of(full_master, shard, master))
            masters_loaded = True
        if entry:
            state[i] = entry
    opt.optim.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
    opt.load_loss_scaler_state(state_dict.get(LOSS_SCALER_KEY))
    return masters_loaded
