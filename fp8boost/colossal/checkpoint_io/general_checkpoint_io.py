"""``colossalai.checkpoint_io.general_checkpoint_io``: ``GeneralCheckpointIO``.

Colossal-AI's checkpoint IO signatures mapped onto fp8boost's own save/load (the
:class:`fp8boost.booster.Booster` methods, which already take Colossal-AI's arguments), plus
what only this class needs:

* plain torch optimizers (no ``booster.boost``): saved through fp8boost's single-replica
  optimizer wrapper (directories), or as one ``torch.save`` file of ``state_dict()`` with
  ``shard=False`` and a file name (Colossal-AI's unsharded layout); the same one-file layout
  serves boosted optimizers whose ``state_dict()`` holds plain tensors (no-plugin, DDP, ZeRO:
  gathered to full shapes by every rank, written by one);
* ``_sync_d2h()`` / ``_sync_io()``: every save here is synchronous, so nothing is pending.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from fp8boost.booster import Booster
from fp8boost.checkpoint_io import coordination as coord
from fp8boost.checkpoint_io.single_file import is_file_target
from fp8boost.parallel import wrappers
from fp8boost.parallel.boosted_optimizer import OptimizerProxy, ShardedCheckpointState
from fp8boost.plugins import Plugin

__all__ = ["GeneralCheckpointIO"]


class GeneralCheckpointIO:
    """Save and load models, optimizers and lr schedulers with Colossal-AI's signatures.

    Args:
        plugin: the plugin that boosted what is saved (None: one process, plain torch objects
            or ``Booster()``-boosted ones, as Colossal-AI's ``GeneralCheckpointIO()``).

    Example:
        >>> import os, tempfile, torch
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> io, tmp = GeneralCheckpointIO(), tempfile.mkdtemp()
        >>> io.save_model(model, os.path.join(tmp, "model.safetensors"))
        >>> io.save_optimizer(opt, os.path.join(tmp, "optim.bin"))
        >>> new = torch.nn.Linear(2, 2); new_opt = torch.optim.Adam(new.parameters())
        >>> io.load_model(new, os.path.join(tmp, "model.safetensors")) is new
        True
        >>> io.load_optimizer(new_opt, os.path.join(tmp, "optim.bin"))
        >>> torch.equal(new.weight, model.weight), new_opt.state_dict()["state"][0]["step"]
        (True, tensor(1.))
    """

    def __init__(self, plugin: Optional[Plugin] = None) -> None:
        #: the fp8boost Booster whose save/load methods do the work
        self.booster = Booster(plugin=plugin)

    @property
    def plugin(self) -> Plugin:
        return self.booster.plugin

    # ---------------------------------------------------------------------------- models
    def save_model(self, model: nn.Module, checkpoint: str, shard: bool = False,
                   gather_dtensor: bool = True, prefix: Optional[str] = None,
                   size_per_shard: int = 1024, use_safetensors: bool = False,
                   use_async: bool = False) -> None:
        """One safetensors file at ``checkpoint`` (``shard=False`` and a file name), else an
        HF-layout directory (see :meth:`fp8boost.booster.Booster.save_model`)."""
        self.booster.save_model(model, checkpoint, shard, gather_dtensor, prefix, size_per_shard,
                                use_safetensors, use_async)

    def load_model(self, model: nn.Module, checkpoint: str, strict: bool = True,
                   low_cpu_mem_mode: bool = True, num_threads: int = 1) -> nn.Module:
        """Load a file or directory written by :meth:`save_model` (or a ``torch.save`` state
        dict, or HF ``save_pretrained``'s folder). Returns ``model``, as Colossal-AI's."""
        self.booster.load_model(model, checkpoint, strict, low_cpu_mem_mode, num_threads)
        return model

    # ------------------------------------------------------------------------ optimizers
    def save_optimizer(self, optimizer, checkpoint: str, shard: bool = False,
                       gather_dtensor: bool = True, prefix: Optional[str] = None,
                       size_per_shard: int = 1024, use_async: bool = False) -> None:
        """``shard=False`` and a file name: one ``torch.save`` file of ``state_dict()`` (plain
        tensors only: a plain torch optimizer, or a boosted one without FSDP); otherwise
        fp8boost's re-shardable directory. Collective: every rank calls it."""
        if not shard and is_file_target(os.fspath(checkpoint)) and _one_file_state(optimizer):
            self._save_state_file(optimizer.state_dict(), os.fspath(checkpoint))
            return
        self.booster.save_optimizer(_boosted(optimizer), checkpoint, shard, gather_dtensor,
                                    prefix, size_per_shard, use_async)

    def load_optimizer(self, optimizer, checkpoint: str, prefix: Optional[str] = None,
                       low_cpu_mem_mode: bool = True, num_threads: int = 1) -> None:
        """Load what :meth:`save_optimizer` wrote (a file: ``load_state_dict`` of it)."""
        path = os.fspath(checkpoint)
        if os.path.isfile(path):
            # a file object, not the path: newer torch (2.13) reads any path named
            # *.safetensors as safetensors, and save_optimizer writes torch.save's format
            # whatever the name (Colossal-AI's use_async tests name it .safetensors)
            with open(path, "rb") as f:
                state = torch.load(f, map_location="cpu", weights_only=True)
            optimizer.load_state_dict(state)
            return
        self.booster.load_optimizer(_boosted(optimizer), path, low_cpu_mem_mode, num_threads)

    def _save_state_file(self, state: dict, path: str) -> None:
        group = self.plugin.checkpoint_group
        failure: Optional[BaseException] = None
        if coord.rank(group) == 0:
            tmp = f"{path}.tmp-{os.getpid()}"
            try:  # a file replaced in one step: a failed save leaves the previous one whole
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                torch.save(state, tmp)
                os.replace(tmp, path)
            except OSError as exc:
                failure = exc
                if os.path.exists(tmp):
                    os.remove(tmp)
        coord.raise_if_failed(path, failure, group)

    # --------------------------------------------------------------------- lr schedulers
    def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        """``lr_scheduler.state_dict()`` to the file ``checkpoint`` (one rank writes)."""
        self.booster.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        self.booster.load_lr_scheduler(lr_scheduler, checkpoint)

    # ------------------------------------------------------- Colossal-AI's async saves
    def _sync_d2h(self) -> None:
        """Wait for device-to-host copies of async saves: saves here are synchronous."""

    def _sync_io(self) -> None:
        """Wait for the file writes of async saves: saves here are synchronous."""

    def synchronize(self) -> None:
        """Colossal-AI's wait before the weights change (``_sync_d2h``): nothing is pending."""
        self._sync_d2h()


def _one_file_state(optimizer) -> bool:
    """Whether ``optimizer.state_dict()`` holds plain tensors a ``torch.save`` file keeps (a
    torch optimizer, or a boosted one with the replicated/ZeRO layout, not FSDP's DTensors)."""
    if isinstance(optimizer, OptimizerProxy):
        return isinstance(optimizer, ShardedCheckpointState)
    return isinstance(optimizer, torch.optim.Optimizer)


def _boosted(optimizer):
    """A plain torch optimizer seen through fp8boost's single-replica wrapper (which saves and
    loads its state without changing it); a boosted one as it is."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return wrappers.OptimizerWrapper(optimizer)
    return optimizer
