"""``colossalai.checkpoint_io``: Colossal-AI's checkpoint IO classes with Colossal-AI's
signatures, over fp8boost's checkpoint IO (``fp8boost.checkpoint_io``).

``GeneralCheckpointIO()`` saves and loads plain torch models, optimizers and schedulers in one
process, as Colossal-AI's does; ``GeneralCheckpointIO(plugin=...)`` does the same for what that
plugin boosted. ``HybridParallelCheckpointIO`` / ``MoECheckpointIO`` are what the Colossal-AI
``HybridParallelPlugin`` / ``MoeHybridParallelPlugin`` return from ``get_checkpoint_io()``;
:func:`checkpoint_io_for` picks the class for any plugin (``booster.checkpoint_io``).
``CheckpointIO`` is fp8boost's interface of a plugin's checkpoint IO;
``create_pinned_state_dict`` copies a state dict into pinned host memory
(``checkpoint_io.utils``).

Example:
    >>> from fp8boost.colossal.checkpoint_io import GeneralCheckpointIO
    >>> io = GeneralCheckpointIO()
"""
from fp8boost import plugins as _plugins
from fp8boost.checkpoint_io import CheckpointIO

from .general_checkpoint_io import GeneralCheckpointIO
from .hybrid_parallel_checkpoint_io import HybridParallelCheckpointIO
from .moe_checkpoint import MoECheckpointIO
from .utils import create_pinned_state_dict

__all__ = ["CheckpointIO", "GeneralCheckpointIO", "HybridParallelCheckpointIO",
           "MoECheckpointIO", "checkpoint_io_for", "create_pinned_state_dict"]


def checkpoint_io_for(plugin: _plugins.Plugin) -> GeneralCheckpointIO:
    """The checkpoint IO with Colossal-AI's signatures for what ``plugin`` boosts: the
    plugin's own where it is one (the Colossal-AI-facing hybrid plugins), else
    ``MoECheckpointIO`` / ``HybridParallelCheckpointIO`` for fp8boost's MoE / hybrid plugin,
    else ``GeneralCheckpointIO(plugin=plugin)``."""
    io = plugin.get_checkpoint_io()
    if isinstance(io, GeneralCheckpointIO):
        return io
    if isinstance(plugin, _plugins.MoeHybridParallelPlugin):
        return MoECheckpointIO(plugin, native=io)
    if isinstance(plugin, _plugins.HybridParallelPlugin):
        return HybridParallelCheckpointIO(plugin, native=io)
    return GeneralCheckpointIO(plugin=plugin)
