"""``colossalai.checkpoint_io.moe_checkpoint``: ``MoECheckpointIO``.

What ``MoeHybridParallelPlugin.get_checkpoint_io()`` (and ``booster.checkpoint_io``) returns:
:class:`~.hybrid_parallel_checkpoint_io.HybridParallelCheckpointIO`'s Colossal-AI signatures
over the MoE plugin's own fp8boost checkpoint IO (``native``:
:class:`fp8boost.checkpoint_io.moe.MoeCheckpointIO`): model files hold every expert
(gathered over ep; they load at any ep size), optimizer directories hold each ep rank's state in
the re-shardable format (they load at any ep and dp size).
"""
from __future__ import annotations

from .hybrid_parallel_checkpoint_io import HybridParallelCheckpointIO

__all__ = ["MoECheckpointIO"]


class MoECheckpointIO(HybridParallelCheckpointIO):
    """Colossal-AI's checkpoint IO of ``MoeHybridParallelPlugin`` (see the module docstring;
    the methods are :class:`HybridParallelCheckpointIO`'s).

    Args:
        plugin: the ``MoeHybridParallelPlugin`` that boosted what is saved.
        native: its fp8boost checkpoint IO (default: asked of ``plugin``).
    """
