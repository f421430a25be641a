"""The errors every rank raises alike when a checkpoint cannot be saved or loaded."""


class CheckpointSaveError(OSError, RuntimeError):
    """A save failed (on this or another rank); the previous checkpoint, if any, is intact."""


class CheckpointCorruptError(OSError, ValueError):
    """A checkpoint file is missing, truncated or altered since it was saved."""
