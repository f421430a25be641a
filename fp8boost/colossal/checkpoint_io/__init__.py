"""``colossalai.checkpoint_io``: ``GeneralCheckpointIO`` with Colossal-AI's signatures, over
fp8boost's checkpoint IO (``fp8boost.plugins.checkpoint_io``).

``GeneralCheckpointIO()`` saves and loads plain torch models, optimizers and schedulers in one
process, as Colossal-AI's does; ``GeneralCheckpointIO(plugin=...)`` (what
``booster.checkpoint_io`` returns) does the same for what that plugin boosted. ``CheckpointIO``
is fp8boost's interface of a plugin's checkpoint IO; ``create_pinned_state_dict`` copies a
state dict into pinned host memory (``checkpoint_io.utils``).

Example:
    >>> from fp8boost.colossal.checkpoint_io import GeneralCheckpointIO
    >>> io = GeneralCheckpointIO()
"""
from fp8boost.plugins.checkpoint_io import CheckpointIO

from .general_checkpoint_io import GeneralCheckpointIO
from .utils import create_pinned_state_dict

__all__ = ["CheckpointIO", "GeneralCheckpointIO", "create_pinned_state_dict"]
