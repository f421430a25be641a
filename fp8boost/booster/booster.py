"""Booster: the one object a training script talks to. It holds a Plugin and delegates."""
from __future__ import annotations

import os
from typing import ContextManager, Optional, Union

import torch
from torch import nn

from fp8boost.plugins.plugin_base import Plugin

from . import checkpoint_io as cio
from .mixed_precision import MixedPrecision, LocalPlugin


class Booster:
    """Boost a model, optimizer, criterion, dataloader and lr scheduler for training.

    Args:
        plugin: the training strategy (``TorchDDPPlugin``, ``LowLevelZeroPlugin``, ...). None
            trains in this one process.
        mixed_precision: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"fp8"`` (= bf16 + FP8 linear
            GEMMs), or a ``MixedPrecision``. Works without a plugin and with plugins that take
            their precision from the Booster (``TorchDDPPlugin(precision=None)``); plugins with
            their own ``precision`` argument refuse it.
        device: where the model lives (default: ``cuda:LOCAL_RANK`` with CUDA, else CPU).

    Example:
        >>> import torch
        >>> from fp8boost.booster import Booster
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> booster = Booster(mixed_precision="bf16", device="cpu")
        >>> model, opt, *_ = booster.boost(model, opt)
        >>> loss = model(torch.randn(8, 32)).float().pow(2).mean()
        >>> booster.backward(loss, opt); opt.step(); opt.zero_grad()
    """

    def __init__(self, plugin: Optional[Plugin] = None,
                 mixed_precision: Union[str, MixedPrecision, None] = None,
                 device: Union[str, torch.device, None] = None) -> None:
        if plugin is not None and not isinstance(plugin, Plugin):
            raise TypeError(f"plugin must be an fp8boost Plugin, got {type(plugin).__name__}")
        if mixed_precision is not None and not isinstance(mixed_precision, (str, MixedPrecision)):
            raise TypeError("mixed_precision must be 'fp32', 'bf16', 'fp16', 'fp8' or a "
                            f"MixedPrecision, got {type(mixed_precision).__name__}")
        if isinstance(mixed_precision, str):
            mixed_precision = MixedPrecision(mixed_precision)
        if device is not None:
            device = torch.device(device)
        if plugin is None:
            plugin = LocalPlugin(mixed_precision or MixedPrecision("fp32"))
        elif mixed_precision is not None:
            if mixed_precision.fp8_config is not None or mixed_precision.max_norm:
                raise ValueError("with a plugin, pass fp8_config/max_norm to the plugin, and "
                                 "mixed_precision as a plain string")
            plugin.set_precision(mixed_precision.precision)
        self.plugin = plugin
        self.device = device

    def __repr__(self) -> str:
        return f"Booster(plugin={self.plugin!r}, device={self.device})"

    def boost(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
              criterion=None, dataloader=None, lr_scheduler=None) -> tuple:
        """Wrap everything for training; returns the same five objects, boosted, in order.

        The returned model casts floating inputs to the training dtype; the returned optimizer
        must be used for ``backward``/``step`` (``booster.backward(loss, optimizer)``); the
        dataloader reads this rank's share of the data; the lr scheduler is returned unchanged
        (it keeps driving the wrapped optimizer's learning rates).
        """
        return self.plugin.configure(model, optimizer, criterion, dataloader, lr_scheduler,
                                     device=self.device)

    def backward(self, loss: torch.Tensor, optimizer) -> None:
        """Backpropagate ``loss`` (with loss scaling / gradient reduction as the plugin needs)."""
        self.plugin.backward(loss, optimizer)

    def no_sync(self, model: Optional[nn.Module] = None, optimizer=None) -> ContextManager:
        """Context manager: backward passes inside accumulate gradients without communication."""
        return self.plugin.no_sync(model, optimizer)

    def clip_grad_norm_(self, model: nn.Module, optimizer, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients to a global norm (over all shards); returns the norm before clipping."""
        return self.plugin.clip_grad_norm_(model, optimizer, max_norm, norm_type)

    # ------------------------------------------------------------------------- checkpoints
    def save_model(self, model: nn.Module, path: str, shard: bool = True,
                   size_per_shard_mb: float = 1024) -> None:
        """Save the model's weights as a safetensors directory ``from_pretrained`` can load.

        Args:
            model: the boosted model (or the raw one).
            path: target directory; replaced atomically if it holds an older checkpoint.
            shard: write ``model-0000x-of-0000y.safetensors`` + index (else one ``model.safetensors``).
            size_per_shard_mb: maximum shard size in MiB.
        """
        if not isinstance(size_per_shard_mb, (int, float)) or size_per_shard_mb <= 0:
            raise ValueError(f"size_per_shard_mb must be > 0, got {size_per_shard_mb!r}")
        module = self.plugin.unwrap_model(model)
        group = self.plugin.dp_group
        is_writer = cio._rank(group) == 0
        overrides = self.plugin.exact_weights(model)  # collective: before rank 0 writes alone

        def write(tmp: str) -> None:
            if is_writer:
                cio.write_model(module, tmp, shard, size_per_shard_mb, overrides)

        cio.atomic_save_dir(path, group, write, (cio.MODEL_INDEX, cio.MODEL_SINGLE))

    def load_model(self, model: nn.Module, path: str, strict: bool = True) -> None:
        """Load weights saved by ``save_model`` (or HF ``save_pretrained``) into every replica.

        Load the model before the optimizer: loading model weights re-derives ZeRO master
        weights from them, and ``load_optimizer`` then restores the exact FP32 masters.
        """
        cio.read_model(self.plugin.unwrap_model(model), os.fspath(path), strict)
        self.plugin.after_load_model(model)

    def save_optimizer(self, optimizer, path: str) -> None:
        """Save optimizer state (sharded per rank; reloadable into any world size)."""
        cio._check_optimizer(optimizer)
        group = self.plugin.dp_group
        is_writer = optimizer.shard_world_size > 1 or cio._rank(group) == 0
        cio.atomic_save_dir(path, group, lambda tmp: cio.write_optimizer(optimizer, tmp, is_writer),
                            (cio.OPTIM_INDEX,))

    def load_optimizer(self, optimizer, path: str) -> None:
        """Load optimizer state saved by ``save_optimizer`` with any world size."""
        cio._check_optimizer(optimizer)
        cio.read_optimizer(optimizer, os.fspath(path))

    def save_lr_scheduler(self, lr_scheduler, path: str) -> None:
        """Save ``lr_scheduler.state_dict()`` to the file ``path`` (atomically, rank 0 writes)."""
        if not hasattr(lr_scheduler, "state_dict"):
            raise TypeError(f"lr_scheduler must have state_dict(), got {type(lr_scheduler).__name__}")
        group = self.plugin.dp_group
        if cio._rank(group) == 0:
            path = os.path.abspath(path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}"
            torch.save(lr_scheduler.state_dict(), tmp)
            os.replace(tmp, path)
        cio._barrier(group)

    def load_lr_scheduler(self, lr_scheduler, path: str) -> None:
        """Load a scheduler state saved by ``save_lr_scheduler``."""
        lr_scheduler.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
