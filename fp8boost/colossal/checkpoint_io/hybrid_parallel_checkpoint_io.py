"""``colossalai.checkpoint_io.hybrid_parallel_checkpoint_io``: ``HybridParallelCheckpointIO``.

What ``HybridParallelPlugin.get_checkpoint_io()`` (and ``booster.checkpoint_io``) returns:
Colossal-AI's method names and signatures (``save_model(model, checkpoint, shard=False,
gather_dtensor, prefix, size_per_shard, use_safetensors, use_async)``, ``load_model``,
``save_optimizer`` / ``load_optimizer``, ``save_lr_scheduler`` / ``load_lr_scheduler``,
``_sync_d2h`` / ``_sync_io``) over the plugin's own fp8boost checkpoint IO (``native``:
:class:`fp8boost.checkpoint_io.HybridCheckpointIO`, HF exports gathered over tp and pp,
re-shardable optimizer state). The formats are that IO's:

* ``save_model``: one safetensors file with ``shard=False`` and a file name, else an HF folder
  (``shard=True``: split at ``size_per_shard`` MB), gathered from every tp rank and stage;
* ``save_optimizer``: always the plugin's re-shardable directory (``shard`` True or False alike:
  every tp rank, stage and ZeRO shard holds a different part of the state, which one
  ``torch.save`` file of rank 0's ``state_dict()`` would lose); it loads at another tp, pp, dp
  and ZeRO stage.

The same object is also the plugin's checkpoint IO for fp8boost's own ``Booster``, which calls
it as ``save_model(model, path, shard, size_per_shard_mb)`` (a number where Colossal-AI's
``gather_dtensor`` flag stands: such a call goes to ``native`` as it is), ``save_checkpoint`` /
``load_checkpoint`` and ``group``.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

from torch import nn

from fp8boost import _state
from fp8boost.plugins import Plugin
from fp8boost.plugins.options import check_bool

from .general_checkpoint_io import GeneralCheckpointIO

__all__ = ["HybridParallelCheckpointIO", "native_checkpoint_io"]


def native_checkpoint_io(plugin: Plugin):
    """The plugin's fp8boost checkpoint IO (under a Colossal-AI-facing one, the one it wraps)."""
    io = plugin.get_checkpoint_io()
    return io.native if isinstance(io, HybridParallelCheckpointIO) else io


_logger = logging.getLogger("fp8boost.colossal")
_FLAGS = ("gather_dtensor", "use_async", "low_cpu_mem_mode")


def _info_ignored(method: str, **args: tuple[Any, Any]) -> None:
    """Check Colossal-AI's flags and say once (INFO) which arguments were given a value that
    changes nothing here (``name=(value, default)``), as fp8boost's ``Booster`` does."""
    for name, (value, default) in args.items():
        if name in _FLAGS:
            check_bool(name, value)
        if value != default:
            _state.log_once(_logger, ("colossal-checkpoint-io-arg", method, name),
                            f"fp8boost: {method}({name}={value!r}) changes nothing here "
                            "(accepted for Colossal-AI scripts; see docs/PLUGINS.md, "
                            "Checkpoints)", level=logging.INFO)


def _native_size(value: Any) -> bool:
    """Whether ``save_model``'s 4th argument is fp8boost's shard size (a number) rather than
    Colossal-AI's ``gather_dtensor`` flag."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class HybridParallelCheckpointIO(GeneralCheckpointIO):
    """Colossal-AI's checkpoint IO of ``HybridParallelPlugin`` (see the module docstring).

    Args:
        plugin: the plugin that boosted what is saved.
        native: the plugin's fp8boost checkpoint IO (default: asked of ``plugin``).

    Attributes:
        native: the fp8boost checkpoint IO every save and load goes to.

    Example:
        >>> booster = Booster(plugin=HybridParallelPlugin(tp_size=2))           # doctest: +SKIP
        >>> io = booster.plugin.get_checkpoint_io()                              # doctest: +SKIP
        >>> io.save_model(model, "model.safetensors")   # one file, gathered    # doctest: +SKIP
        >>> io.save_optimizer(optimizer, "optim")       # re-shardable folder    # doctest: +SKIP
    """

    def __init__(self, plugin: Plugin, native: Optional[Any] = None) -> None:
        super().__init__(plugin=plugin)
        self.native = native if native is not None else native_checkpoint_io(plugin)

    # ------------------------------------------------------- fp8boost's interface, as is
    @property
    def group(self):
        """The process group that coordinates saves (the plugin's whole world)."""
        return self.native.group

    @property
    def state_format(self) -> str:
        return self.native.state_format

    def save_checkpoint(self, path: str, model: nn.Module, optimizer=None, lr_scheduler=None,
                        extra: Optional[dict] = None) -> None:
        """fp8boost's resumable directory (``booster.save_checkpoint``)."""
        self.native.save_checkpoint(path, model, optimizer, lr_scheduler, extra)

    def load_checkpoint(self, path: str, model: nn.Module, optimizer=None,
                        lr_scheduler=None) -> dict:
        """Restore a ``save_checkpoint`` directory; returns its ``extra`` dict."""
        return self.native.load_checkpoint(path, model, optimizer, lr_scheduler)

    # ---------------------------------------------------------------------------- models
    def save_model(self, model: nn.Module, checkpoint: str, shard: bool = False,
                   gather_dtensor: bool = True, prefix: Optional[str] = None,
                   size_per_shard: int = 1024, use_safetensors: bool = False,
                   use_async: bool = False) -> None:
        """One safetensors file at ``checkpoint`` (``shard=False`` and a file name), else an
        HF folder; the weights gathered over tp and pp either way. Collective."""
        if _native_size(gather_dtensor):  # fp8boost's call: (model, path, shard, size_mb)
            self.native.save_model(model, os.fspath(checkpoint), shard, gather_dtensor)
            return
        super().save_model(model, checkpoint, shard, gather_dtensor, prefix, size_per_shard,
                           use_safetensors, use_async)

    def load_model(self, model: nn.Module, checkpoint: str, strict: bool = True,
                   low_cpu_mem_mode: bool = True, num_threads: int = 1) -> nn.Module:
        """Load a file or folder written by :meth:`save_model` (or HF ``save_pretrained``'s
        folder): each rank reads its tp slices. Returns ``model``, as Colossal-AI's."""
        path = os.fspath(checkpoint)
        if os.path.isfile(path):  # the Booster unpacks the file, then loads the folder here
            super().load_model(model, path, strict, low_cpu_mem_mode, num_threads)
        else:
            _info_ignored("load_model", low_cpu_mem_mode=(low_cpu_mem_mode, True),
                          num_threads=(num_threads, 1))
            self.native.load_model(model, path, strict)
        return model

    # ------------------------------------------------------------------------ optimizers
    def save_optimizer(self, optimizer, checkpoint: str, shard: bool = False,
                       gather_dtensor: bool = True, prefix: Optional[str] = None,
                       size_per_shard: int = 1024, use_async: bool = False) -> None:
        """The plugin's re-shardable optimizer directory at ``checkpoint``, whatever ``shard``
        (see the module docstring). Collective: every rank calls it."""
        check_bool("shard", shard)
        _info_ignored("save_optimizer", gather_dtensor=(gather_dtensor, True),
                      prefix=(prefix, None), size_per_shard=(size_per_shard, 1024),
                      use_async=(use_async, False))
        self.native.save_optimizer(optimizer, os.fspath(checkpoint))

    def load_optimizer(self, optimizer, checkpoint: str, prefix: Optional[str] = None,
                       low_cpu_mem_mode: bool = True, num_threads: int = 1) -> None:
        """Load what :meth:`save_optimizer` wrote (at any tp, pp, dp and ZeRO stage)."""
        _info_ignored("load_optimizer", low_cpu_mem_mode=(low_cpu_mem_mode, True),
                      num_threads=(num_threads, 1))
        self.native.load_optimizer(optimizer, os.fspath(checkpoint))

    # --------------------------------------------------------------------- lr schedulers
    def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        """``lr_scheduler.state_dict()`` to the file ``checkpoint`` (one rank writes)."""
        self.native.save_lr_scheduler(lr_scheduler, os.fspath(checkpoint))

    def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        self.native.load_lr_scheduler(lr_scheduler, os.fspath(checkpoint))
