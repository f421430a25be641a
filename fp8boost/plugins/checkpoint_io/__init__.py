"""Checkpoint IO owned by the plugins: ``Plugin.get_checkpoint_io()`` returns one of these.

``formats``  the on-disk formats shared by every plugin (HF-layout safetensors models, the
             re-shardable optimizer format, atomic directory swaps);
``base``     the ``CheckpointIO`` interface and ``GeneralCheckpointIO`` (replicated models:
             no plugin, DDP, ZeRO-1/2);
``dcp``      ``DTensorCheckpointIO`` for FSDP2/DTensor models (Gemini, TorchFSDP, hybrid):
             HF export gathered one parameter at a time, sharded resumable state through
             ``torch.distributed.checkpoint``, HF loads that read only each rank's part.
``hybrid``   ``HybridCheckpointIO`` for ``HybridParallelPlugin`` (tp-split plain tensors x
             ZeRO): HF export gathered over tp a parameter at a time, tp-sliced HF loads,
             resumable state as DCP DTensors on the (dp, pp, tp) mesh (reshards on load).
"""
from .base import CheckpointIO, GeneralCheckpointIO
from .hybrid import HybridCheckpointIO

__all__ = ["CheckpointIO", "GeneralCheckpointIO", "HybridCheckpointIO"]
