"""``colossalai.booster.mixed_precision.fp16_torch``: torch AMP in FP16 with a gradient scaler.

Colossal-AI's :class:`FP16TorchMixedPrecision` keeps the model's weights in FP32, runs its
forward under ``torch.autocast(dtype=float16)`` and scales the loss with torch's
``GradScaler``; ``configure(model, optimizer, criterion)`` returns the wrapped three. That is
torch's own AMP, so these classes are thin wrappers over it (and over fp8boost's
``OptimizerWrapper`` for the rest of Colossal-AI's optimizer surface).

``Booster(mixed_precision=FP16TorchMixedPrecision())`` trains with fp8boost's ``"fp16"``
instead (FP16 weights, FP32 master copies, dynamic loss scaling: the same loss scale
arguments), said once at INFO: fp8boost's plugins shard and cast the model themselves.

Example:
    >>> import torch
    >>> amp = FP16TorchMixedPrecision()
    >>> model, opt, _ = amp.configure(torch.nn.Linear(4, 2),
    ...                               torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], 0.1))
    >>> type(model).__name__, type(opt).__name__
    ('TorchAMPModule', 'TorchAMPOptimizer')
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from fp8boost.colossal.interface import ModelWrapper, OptimizerWrapper

__all__ = ["FP16TorchMixedPrecision", "TorchAMPModule", "TorchAMPOptimizer"]


def _device_type(params) -> str:
    for p in params:
        return p.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


class TorchAMPOptimizer(OptimizerWrapper):
    """An optimizer whose loss is scaled by a ``torch.amp.GradScaler`` (Colossal-AI's).

    Args:
        optim: the torch optimizer (its parameters stay FP32).
        init_scale, growth_factor, backoff_factor, growth_interval: the ``GradScaler``'s.
    """

    def __init__(self, optim: torch.optim.Optimizer, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        super().__init__(optim)
        device = _device_type(p for g in optim.param_groups for p in g["params"])
        self.scaler = torch.amp.GradScaler(device, init_scale=init_scale,
                                           growth_factor=growth_factor,
                                           backoff_factor=backoff_factor,
                                           growth_interval=growth_interval)
        self._unscaled = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale."""
        return self.scaler.scale(loss)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, *,
                 inputs: Optional[Any] = None) -> None:
        """Backward of the scaled loss (the gradients stay scaled until :meth:`unscale_grad`
        or :meth:`step`)."""
        super().backward(self.scale_loss(loss), retain_graph, inputs=inputs)

    def unscale_grad(self) -> None:
        """Divide the gradients by the scale (once per step: clipping calls it first)."""
        if not self._unscaled:
            self.scaler.unscale_(self.optim)
            self._unscaled = True

    def clip_grad_by_norm(self, max_norm, norm_type=2.0, error_if_nonfinite=False, *args,
                          **kwargs) -> torch.Tensor:
        """Unscale, then clip (Colossal-AI's order)."""
        self.unscale_grad()
        return super().clip_grad_by_norm(max_norm, norm_type, error_if_nonfinite, *args,
                                         **kwargs)

    def clip_grad_by_value(self, clip_value, *args, **kwargs) -> None:
        """Unscale, then clamp."""
        self.unscale_grad()
        super().clip_grad_by_value(clip_value, *args, **kwargs)

    def step(self, *args, **kwargs):
        """The scaler's step (skipped when a gradient is not finite), then its update."""
        out = self.scaler.step(self.optim, *args, **kwargs)
        self.scaler.update()
        self._unscaled = False
        return out


class TorchAMPModule(ModelWrapper):
    """A module whose forward runs under ``torch.autocast`` in FP16 (on its weights' device)."""

    def forward(self, *args, **kwargs):
        # A criterion may be a plain function (Colossal-AI's tests pass a lambda).
        params = self.module.parameters() if isinstance(self.module, nn.Module) else ()
        device = _device_type(params)
        with torch.autocast(device, dtype=torch.float16):
            return self.module(*args, **kwargs)


class FP16TorchMixedPrecision:
    """Colossal-AI's FP16 torch-AMP precision: ``configure`` wraps model, optimizer and
    criterion (see the module docstring).

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval: the ``GradScaler``'s.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.torch_amp_kwargs = dict(init_scale=init_scale, growth_factor=growth_factor,
                                     backoff_factor=backoff_factor,
                                     growth_interval=growth_interval)

    def configure(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                  criterion: Optional[Callable] = None):
        """``(TorchAMPModule(model), TorchAMPOptimizer(optimizer) or None, criterion under
        autocast or None)``."""
        model = TorchAMPModule(model)
        if optimizer is not None:
            optimizer = TorchAMPOptimizer(optimizer, **self.torch_amp_kwargs)
        if criterion is not None:
            criterion = TorchAMPModule(criterion)
        return model, optimizer, criterion
