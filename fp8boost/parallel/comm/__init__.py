"""FP8 communication: the collectives, their wire format and their configuration.

``collectives`` (public as :mod:`fp8boost.parallel.fp8_comm`) casts, sends FP8 bytes and
decodes: the face of ``all_gather``, ``reduce`` (reduce-scatter, all-reduce), ``all_to_all``
and ``p2p``, over ``pipeline`` (stages, scales, buffers) and ``_utils`` (checks, async handle,
fallbacks); ``wire`` / ``wire_triton`` own the byte layout and the cast kernels; ``config`` holds
:class:`Fp8CommConfig`; ``report`` the :class:`CommReport` the data-parallel plugins fill.
Nothing here knows about plugins or models.
"""
from .config import Fp8CommConfig
from .report import CommReport

__all__ = ["Fp8CommConfig", "CommReport"]
