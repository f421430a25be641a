"""Checkpoint IO: ``Plugin.get_checkpoint_io()`` returns one of these.

A layer between ``parallel/`` and ``plugins/`` (DESIGN.md "Layers"): it uses the FP8 core and
the parallel engines (``parallel/ep``, the optimizers' checkpoint protocol) and knows a plugin
only through the object it is handed (its groups, topology and options), never by import; the
plugins, the Booster and ``export/`` build on it.

``formats``  the on-disk formats shared by every plugin (HF-layout safetensors models, the
             re-shardable optimizer format): file names and index keys;
``coordination``, ``atomic``, ``checksums``  what every save and load goes through: rank 0
             writes, failures raise on every rank alike, directories are swapped in
             atomically and their files' SHA-256 verified before a load reads them;
``tensor_files``, ``model_io``, ``optimizer_io``  safetensors model and optimizer I/O of
             replicated models and of the re-shardable optimizer format;
``base``     the ``CheckpointIO`` interface and ``GeneralCheckpointIO`` (replicated models:
             no plugin, DDP, ZeRO-1/2);
``dcp``      ``DTensorCheckpointIO`` for FSDP2/DTensor models (Gemini, TorchFSDP, hybrid):
             HF export gathered one parameter at a time, sharded resumable state through
             ``torch.distributed.checkpoint``, HF loads that read only each rank's part.
``single_file``  one-file model checkpoints (``Booster.save_model(..., shard=False)`` to a
             file name, as Colossal-AI writes them) through any plugin's own export and load;
``moe``      ``MoeCheckpointIO`` for ``MoeHybridParallelPlugin``: HF exports with every expert
             (load at any ep size), optimizer state per ep rank in the re-shardable format
             (loads at any ep and dp size);
``resume``   ``latest_checkpoint``: the newest complete checkpoint of a folder (auto-resume).
``hybrid``   ``HybridCheckpointIO`` for ``HybridParallelPlugin`` (tp-split plain tensors x
             ZeRO): HF export gathered over tp a parameter at a time, tp-sliced HF loads,
             resumable state as DCP DTensors on the (dp, pp, tp) mesh (reshards on load);
             ``hybrid_tp``: its tensor-parallel split (``TpLayout``), ``hybrid_pp``: its
             pipeline stages.
"""
from .base import CheckpointIO, GeneralCheckpointIO
from .checksums import checksum_files, verify_checksums
from .coordination import raise_if_failed
from .errors import CheckpointCorruptError, CheckpointSaveError
from .formats import CHECKSUM_KEY
from .hybrid import HybridCheckpointIO
from .resume import complete_checkpoints, latest_checkpoint

__all__ = ["CheckpointIO", "GeneralCheckpointIO", "HybridCheckpointIO", "CheckpointCorruptError",
           "CheckpointSaveError", "verify_checksums", "complete_checkpoints",
           "latest_checkpoint", "checksum_files", "raise_if_failed", "CHECKSUM_KEY"]
