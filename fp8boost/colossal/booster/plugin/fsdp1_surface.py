"""What Colossal-AI's ``TorchFSDPPlugin`` (FSDP1) answers, on fp8boost's FSDP2 plugin.

Colossal-AI's ``TorchFSDPPlugin`` wraps the model in torch's FSDP1; fp8boost's shards it with
FSDP2 (``fully_shard``). A Colossal-AI script reads the boosted model and optimizer through
FSDP1's answers, and the boost of the Colossal-AI-facing plugin gives the same ones:

* ``model.state_dict()`` and ``model.unwrap().state_dict()`` hold plain full tensors on every
  rank (FSDP1's default ``FULL_STATE_DICT``), and ``load_state_dict`` takes them back
  (:func:`fp8boost.parallel.fsdp.full_state_dict.enable_full_state_dict`);
  ``booster.save_model`` / ``save_optimizer`` still write each rank's shards;
* ``FullyShardedDataParallel.full_optim_state_dict(model, optim)`` answers for the FSDP2 model
  too (:func:`full_optim_state_dict`): torch's FSDP1 function looks only for FSDP1 modules and
  fails on FSDP2 with an ``IndexError``. The torch function is replaced by one that calls it
  unchanged for every model holding FSDP1 modules (or no FSDP at all), at the first boost of
  this plugin, never at import.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from fp8boost import _state
from fp8boost.parallel.boosted_optimizer import OptimizerProxy
from fp8boost.parallel.fsdp.full_state_dict import enable_full_state_dict, sharded_state_dicts
from fp8boost.plugins import TorchFSDPPlugin as _Fp8boostTorchFSDPPlugin

__all__ = ["configure", "full_optim_state_dict", "install_full_optim_state_dict"]

#: torch's own ``FullyShardedDataParallel.full_optim_state_dict``, taken when this module is
#: imported (a reference, not a patch: the class is changed only at the first boost)
_TORCH_FULL_OPTIM_STATE_DICT = FSDP.full_optim_state_dict
_LOG = logging.getLogger("fp8boost.colossal")


def configure(self, model: nn.Module, *args, **kwargs):
    """fp8boost's ``TorchFSDPPlugin.configure``, then FSDP1's answers (module docstring) on
    the sharded model."""
    boosted = _Fp8boostTorchFSDPPlugin.configure(self, model, *args, **kwargs)
    enable_full_state_dict(boosted[0].unwrap())
    install_full_optim_state_dict()
    return boosted


def install_full_optim_state_dict() -> None:
    """Let ``FSDP.full_optim_state_dict`` answer for FSDP2 models (idempotent)."""
    if FSDP.full_optim_state_dict is not _TORCH_FULL_OPTIM_STATE_DICT:
        return  # already ours (or replaced by someone else: theirs is left in place)
    FSDP.full_optim_state_dict = staticmethod(full_optim_state_dict)
    _state.log_once(_LOG, "fsdp1-full-optim-state-dict",
                    "fp8boost.colossal: torch's FSDP.full_optim_state_dict now also answers "
                    "for FSDP2 models (Colossal-AI's TorchFSDPPlugin API); FSDP1 models still "
                    "get torch's own", level=logging.INFO)


def _is_fsdp2(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules()) and \
        not FSDP.fsdp_modules(model)


def full_optim_state_dict(model: nn.Module, optim, optim_input=None, rank0_only: bool = True,
                          group=None) -> dict:
    """FSDP1's ``FSDP.full_optim_state_dict``, also for a model sharded by FSDP2.

    For an FSDP2 model: the optimizer's whole state as plain tensors on the CPU, keyed as
    FSDP1 keys it (``state`` and the ``params`` of ``param_groups`` by parameter name, relative
    to ``model``). Collective over the model's ranks, as FSDP1's.

    Args:
        model: the model the optimizer steps (``optimizer.unwrap_model().unwrap()``).
        optim: the boosted optimizer, or the torch optimizer inside it.
        optim_input: FSDP1's deprecated argument; must be None for an FSDP2 model.
        rank0_only: only rank 0 of ``group`` gets the state; the others get ``{}``.
        group: the process group whose rank 0 receives it (None: the default group).

    Raises:
        ValueError: ``optim_input`` given for an FSDP2 model.
    """
    if not _is_fsdp2(model):
        return _TORCH_FULL_OPTIM_STATE_DICT(model, optim, optim_input, rank0_only, group)
    if optim_input is not None:
        raise ValueError("full_optim_state_dict(optim_input=...) is FSDP1's deprecated way to "
                         "name the parameters; for this FSDP2 model leave it None (the names "
                         "come from the model)")
    raw = optim.optim if isinstance(optim, OptimizerProxy) else optim
    with sharded_state_dicts():  # DCP reads the shards and gathers them itself
        state = get_optimizer_state_dict(model, raw,
                                         options=StateDictOptions(full_state_dict=True))
    if rank0_only and dist.is_initialized() and dist.get_rank(group) != 0:
        return {}
    return _to_cpu(state)


def _to_cpu(obj):
    """FSDP1 offloads the full optimizer state to the CPU."""
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj.cpu() if torch.is_tensor(obj) else obj
