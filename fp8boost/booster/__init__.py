"""The Booster: boost / backward / no_sync / clipping / checkpoints, delegating to one Plugin."""
from .booster import Booster
from .mixed_precision import MixedPrecision

__all__ = ["Booster", "MixedPrecision"]
