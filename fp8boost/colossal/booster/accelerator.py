"""``colossalai.booster.accelerator``: ``Accelerator``, the device a model is moved to.

Example:
    >>> import torch
    >>> from fp8boost.colossal.booster.accelerator import Accelerator
    >>> Accelerator("cpu").configure_model(torch.nn.Linear(2, 2)).weight.device.type
    'cpu'
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["Accelerator"]

#: the device types ``Accelerator`` takes (Colossal-AI's)
SUPPORTED_DEVICES = ("cpu", "cuda")


class Accelerator:
    """A device type and the two things Colossal-AI's booster asks of it.

    Args:
        device: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: another device type.
    """

    def __init__(self, device: str) -> None:
        if device not in SUPPORTED_DEVICES:
            raise ValueError(f"Accelerator({device!r}): use one of {list(SUPPORTED_DEVICES)}")
        self.device = device

    def bind(self) -> None:
        """Make the device current for this process (CUDA: the current CUDA device)."""
        if self.device == "cuda":
            torch.cuda.set_device(torch.cuda.current_device())

    def configure_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device; returns it."""
        return model.to(torch.device(self.device))
