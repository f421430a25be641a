"""``colossalai.booster.plugin.dp_plugin_base``: ``DPPluginBase``, the base of a plugin whose
every rank is one data-parallel replica.

Example:
    >>> from fp8boost.colossal.booster.plugin.dp_plugin_base import DPPluginBase
    >>> issubclass(DPPluginBase, __import__("fp8boost").plugins.Plugin)
    True
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fp8boost.plugins import Plugin

__all__ = ["DPPluginBase"]


class DPPluginBase(Plugin):
    """fp8boost's :class:`~fp8boost.plugins.Plugin` as Colossal-AI's data-parallel base:
    ``rank`` / ``world_size`` of the initialised job, ``prepare_dataloader`` sharding the
    data over every rank. Subclass it and override ``configure``'s steps (or ``configure``).

    Args:
        **options: fp8boost's shared plugin options (precision, use_fp8, max_norm, ...).

    Raises:
        RuntimeError: the process group is not initialised (``launch_from_torch`` first).
    """

    def __init__(self, **options: Any) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DPPluginBase needs the process group: call "
                               "colossalai.launch_from_torch() (or launch()) first")
        super().__init__(**options)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
