"""``colossalai.checkpoint_io.utils``: ``create_pinned_state_dict``.

Example:
    >>> import torch
    >>> from fp8boost.colossal.checkpoint_io.utils import create_pinned_state_dict
    >>> pinned = create_pinned_state_dict({"w": torch.ones(2)})  # doctest: +SKIP
    >>> pinned["w"].is_pinned()  # doctest: +SKIP
    True
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["create_pinned_state_dict"]


def _pinned(tensor: torch.Tensor, empty: bool) -> torch.Tensor:
    if empty:
        return torch.empty_like(tensor, device="cpu", pin_memory=True)
    return tensor.detach().cpu().pin_memory()


def _map(obj: Any, empty: bool) -> Any:
    if torch.is_tensor(obj):
        return _pinned(obj, empty)
    if isinstance(obj, dict):
        return type(obj)((k, _map(v, empty)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, empty) for v in obj)
    return obj


def create_pinned_state_dict(state_dict: dict, empty: bool = True, num_threads: int = 1) -> dict:
    """A copy of ``state_dict`` (nested dicts, lists and tuples) whose tensors live in pinned
    (page-locked) host memory, for fast device-to-host copies.

    Args:
        state_dict: a model or optimizer state dict.
        empty: allocate uninitialised pinned tensors of the same shapes and dtypes (True), or
            pinned copies of the values (False).
        num_threads: Colossal-AI's thread count; the tensors are pinned one after another here
            (the result is the same).

    Raises:
        RuntimeError: no CUDA device (pinned memory is for copies to and from one).
        ValueError: ``num_threads < 1``.
    """
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("create_pinned_state_dict needs CUDA: pinned host memory serves copies "
                           "to and from a GPU; on the CPU use the state dict as it is")
    return _map(state_dict, empty)
