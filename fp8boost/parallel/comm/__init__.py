"""FP8 communication: the collectives, their wire format and their configuration.

``collectives`` (public as :mod:`fp8boost.parallel.fp8_comm`) casts, sends FP8 bytes and
decodes: the face of ``all_gather``, ``reduce`` (reduce-scatter, all-reduce), ``all_to_all``
and ``p2p``, over ``pipeline`` (stages, scales, buffers) and ``_utils`` (checks, async handle,
fallbacks); ``wire`` / ``wire_triton`` own the byte layout and the cast kernels; ``config`` holds
:class:`Fp8CommConfig`; ``plan`` the :class:`~.plan.CommPlan` (which collectives go FP8, decided
once per boost, read by every engine); ``report`` the :class:`CommReport` derived from it.
Nothing here knows about plugins; the plan reads the converted model's FP8 layers.
"""
from .config import Fp8CommConfig
from .report import CommReport

__all__ = ["Fp8CommConfig", "CommReport"]
