"""``colossalai.testing.random``: ``seed_all``.

Example:
    >>> from fp8boost.colossal.testing.random import seed_all
    >>> seed_all(0)
"""
from __future__ import annotations

import torch

from fp8boost.colossal.utils import set_seed

__all__ = ["seed_all"]


def seed_all(seed: int, cuda_deterministic: bool = False) -> None:
    """Seed Python's ``random``, NumPy and torch (every device), as
    :func:`fp8boost.colossal.utils.set_seed`; ``cuda_deterministic=True`` also makes cuDNN
    pick deterministic kernels (slower), False lets it benchmark, as in Colossal-AI.
    """
    set_seed(seed)
    torch.backends.cudnn.deterministic = cuda_deterministic
    torch.backends.cudnn.benchmark = not cuda_deterministic
