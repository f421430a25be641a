"""``colossalai.booster.mixed_precision``: ``MixedPrecision`` for ``Booster(mixed_precision=)``.

fp8boost's :class:`~fp8boost.booster.MixedPrecision` (``"fp32"``, ``"bf16"``, ``"fp16"``,
``"fp8"``) under Colossal-AI's path, ``mixed_precision_factory`` for the names
Colossal-AI's factory takes, and Colossal-AI's torch-AMP ``FP16TorchMixedPrecision``
(:mod:`.amp`).

Example:
    >>> from fp8boost.colossal.booster.mixed_precision import mixed_precision_factory
    >>> mixed_precision_factory("bf16").precision
    'bf16'
"""
from __future__ import annotations

from fp8boost.booster.mixed_precision import MixedPrecision

from .amp import FP16TorchMixedPrecision, TorchAMPModule, TorchAMPOptimizer

__all__ = ["FP16TorchMixedPrecision", "MixedPrecision", "TorchAMPModule", "TorchAMPOptimizer",
           "mixed_precision_factory"]

#: Colossal-AI's factory names that fp8boost trains (its apex and naive fp16 variants are
#: refused with the alternative: fp8boost's "fp16" is torch-native dynamic loss scaling)
FACTORY_NAMES = ("fp16", "bf16", "fp8")


def mixed_precision_factory(mixed_precision_type: str) -> MixedPrecision:
    """The :class:`MixedPrecision` of a Colossal-AI factory name.

    Raises:
        ValueError: a name fp8boost does not train, naming the ones it does.
    """
    if mixed_precision_type not in FACTORY_NAMES:
        raise ValueError(f"mixed precision {mixed_precision_type!r} is not supported; use one of "
                         f"{list(FACTORY_NAMES)} ('fp16' is torch-native loss scaling, in place "
                         "of 'fp16_apex' / 'fp16_naive')")
    return MixedPrecision(mixed_precision_type)
