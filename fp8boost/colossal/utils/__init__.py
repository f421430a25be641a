"""``colossalai.utils``: the helpers Colossal-AI scripts import from here.

Example:
    >>> from fp8boost.colossal.utils import get_current_device, set_seed
    >>> set_seed(0); get_current_device().type in ("cuda", "cpu")
    True
"""
from __future__ import annotations

import random

import torch

from fp8boost.colossal.accelerator import get_accelerator

__all__ = ["get_current_device", "set_seed"]


def get_current_device() -> torch.device:
    """The device this process computes on: ``cuda:<current>`` with CUDA, else the CPU.

    Example:
        >>> get_current_device().type in ("cuda", "cpu")
        True
    """
    return get_accelerator().get_current_device()


def set_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy (when installed) and torch (CPU and every GPU).

    Example:
        >>> set_seed(42)
    """
    random.seed(seed)
    try:
        # lazy: NumPy is seeded only where it is installed
        import numpy as np
    except ImportError:  # NumPy is optional for fp8boost
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
