"""``colossalai.nn``: the optimizer and learning-rate scheduler Colossal-AI scripts import.

Example:
    >>> from fp8boost.colossal.nn.optimizer import HybridAdam
    >>> from fp8boost.colossal.nn.lr_scheduler import CosineAnnealingWarmupLR
"""
from fp8boost.colossal.nn import lr_scheduler, optimizer

__all__ = ["lr_scheduler", "optimizer"]
