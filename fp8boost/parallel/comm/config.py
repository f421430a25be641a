"""Configuration of FP8 communication: one frozen, validated object shared by every rank.

Every rank of a group must use an equal :class:`Fp8CommConfig` (same dtypes, threshold and
scale mode): the sender's choices decide what bytes go on the wire, and the receiver decodes
them with its own copy of the config.

Field names say what they apply to, so that no name means two things across fp8boost's
configs: ``min_payload_numel`` is a collective's payload size (``Fp8Config.min_numel`` is a
layer's weight size), ``power_of_2_wire_scale`` rounds the wire scales (``Fp8Config.
power_of_2_scale`` rounds the FP8 GEMM operands' scales). The former names ``min_numel`` and
``power_of_2_scale`` are still accepted (and readable) with a DeprecationWarning.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch

FP8_COMM_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
ALL_GATHER_SCALE_MODES = ("per_rank", "shared")
CAST_IMPLS = ("auto", "torch", "triton")

# Provisional: below 64 Ki elements (128 KiB of BF16) a collective is latency-bound and the extra
# cast kernels cannot pay for themselves. Replace with the crossover measured by bench/comm.py on
# the target machine (it prints a suggested value).
DEFAULT_MIN_PAYLOAD_NUMEL = 65536
# One stage by default: on 2xH200 (NVLink, bench/results/comm_2gpu_2026-11-22.json) the single-stage
# FP8 collectives were faster than the 8 MiB-stage pipelined ones at every size from 16 MB to
# 1 GB (e.g. all-gather 1 GB: 2.65 ms vs 3.92 ms), since every stage adds fixed launch costs.
DEFAULT_PIPELINE_BYTES = 0
MAX_PIPELINE_STAGES = 8
# Former field name -> current one (accepted by the constructor and replace(), readable as a
# property; each use warns DeprecationWarning).
RENAMED_FIELDS: Mapping[str, str] = MappingProxyType({
    "min_numel": "min_payload_numel",
    "power_of_2_scale": "power_of_2_wire_scale",
})


@dataclass(frozen=True, kw_only=True)
class Fp8CommConfig:
    """How FP8 collectives and communication hooks put tensors on the wire.

    This config tunes FP8 communication; it does not switch it on or off. The one switch is
    the plugins' ``fp8_communication`` argument (and, calling the collectives directly, the
    choice of an ``*_fp8`` collective over the plain ``torch.distributed`` one). A plugin with
    ``fp8_communication=False`` ignores its ``comm_config``. ``enabled`` stays accepted, so
    existing code constructs as before, and ``enabled=False`` still runs every FP8 collective as
    the plain one, but that is deprecated (DeprecationWarning): pass
    ``fp8_communication=False`` to the plugin instead.

    Example:
        >>> import torch
        >>> from fp8boost.parallel.comm.config import Fp8CommConfig
        >>> cfg = Fp8CommConfig(min_payload_numel=1 << 20)
        >>> cfg.param_dtype, cfg.grad_dtype
        (torch.float8_e4m3fn, torch.float8_e5m2)
    """

    enabled: bool = True
    """Deprecated as a switch (see the class docstring; the plugins' ``fp8_communication`` is
    the switch). ``False`` runs every FP8 collective as the plain collective in the input's own
    dtype (logged once per collective) and warns DeprecationWarning at construction."""

    param_dtype: torch.dtype = torch.float8_e4m3fn
    """FP8 format for activations and parameters (all-gather, all-to-all, send/recv): e4m3 keeps
    3 mantissa bits (relative rounding error <= 2**-4)."""

    grad_dtype: torch.dtype = torch.float8_e5m2
    """FP8 format for gradients (reduce-scatter, all-reduce, the DDP hook): e5m2 trades one
    mantissa bit (relative error <= 2**-3) for a 2**32 dynamic range, which gradients of very
    different magnitudes sharing one scale need."""

    min_payload_numel: int = DEFAULT_MIN_PAYLOAD_NUMEL
    """Collectives whose payload has fewer elements than this run in the input dtype instead
    (logged once per collective): small messages are latency-bound, so the cast kernels cost more
    than the bytes they save. The payload is the full, unsharded tensor (all-gather output,
    reduce-scatter input, all-reduce tensor, send/recv tensor). all-to-all never applies it, since
    its payload differs between ranks and a per-rank choice could deadlock. Set 0 to always use
    FP8. (Formerly ``min_numel``, a name ``Fp8Config`` uses for a layer's weight size.)"""

    power_of_2_wire_scale: bool = True
    """Round every scale of the wire encoding down to a power of two. Scaling and de-scaling
    are then exact in BF16 and FP32, so the cast needs no FP32 temporary and dequantization
    writes the output dtype directly; the cost is at most one binade of the FP8 subnormal range
    (precision of normal values is unchanged). (Formerly ``power_of_2_scale``, the name of
    ``Fp8Config``'s rounding of the FP8 GEMM operands' scales; FSDP's direct FP8 weight
    all-gather follows that one, since its bytes are the GEMM operand.)"""

    all_gather_scale: str = "per_rank"
    """``per_rank``: each rank scales its shard by its own amax and the FP32 inverse scale travels
    in the same all-gather as the data (one collective, best precision). ``shared``: one scale
    from an all-reduce(MAX) of the amaxes first (an extra tiny collective), so the gathered bytes
    form one FP8 tensor with one scale, as an FP8 GEMM consumer needs."""

    pipeline_bytes: int = DEFAULT_PIPELINE_BYTES
    """Split all-gather, reduce-scatter and all-reduce into stages of about this many FP8 bytes
    of payload (at most 8 stages; 0 = one stage). Stage k+1 is cast while stage k is on the
    wire, and stage k is decoded while k+1 is: the casts, which cost as much memory traffic as
    the bytes they save, overlap the transfer instead of adding to it. Each stage also gets its
    own scale (finer than one per chunk)."""

    cast_impl: str = "auto"
    """Who quantizes/dequantizes: ``torch`` (reference ops, any device), ``triton`` (fused kernels,
    CUDA sm89+), ``auto`` (triton on CUDA sm89+, else torch)."""

    def __post_init__(self) -> None:
        for name in ("min_payload_numel", "pipeline_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Fp8CommConfig.{name} must be an int, "
                                f"got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"Fp8CommConfig.{name} must be >= 0, got {value}")
        for name in ("enabled", "power_of_2_wire_scale"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Fp8CommConfig.{name} must be a bool, "
                                f"got {type(getattr(self, name)).__name__}")
        for name in ("param_dtype", "grad_dtype"):
            value = getattr(self, name)
            if value not in FP8_COMM_DTYPES:
                raise ValueError(f"Fp8CommConfig.{name}={value!r} is not supported; use "
                                 "torch.float8_e4m3fn or torch.float8_e5m2")
        if self.all_gather_scale not in ALL_GATHER_SCALE_MODES:
            raise ValueError(f"Fp8CommConfig.all_gather_scale={self.all_gather_scale!r} is not "
                             f"supported; use one of {ALL_GATHER_SCALE_MODES}")
        if self.cast_impl not in CAST_IMPLS:
            raise ValueError(f"Fp8CommConfig.cast_impl={self.cast_impl!r} is not supported; "
                             f"use one of {CAST_IMPLS}")
        if not self.enabled:
            warnings.warn("Fp8CommConfig(enabled=False) is deprecated: Fp8CommConfig tunes FP8 "
                          "communication, the plugins' fp8_communication=False switches it off "
                          "(the FP8 collectives still run plain for now)", DeprecationWarning,
                          stacklevel=4)

    def replace(self, **changes) -> "Fp8CommConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **_current_names(changes))

    @property
    def min_numel(self) -> int:
        """Deprecated name of :attr:`min_payload_numel`."""
        _warn_renamed("min_numel", stacklevel=2)
        return self.min_payload_numel

    @property
    def power_of_2_scale(self) -> bool:
        """Deprecated name of :attr:`power_of_2_wire_scale`."""
        _warn_renamed("power_of_2_scale", stacklevel=2)
        return self.power_of_2_wire_scale


def _warn_renamed(old: str, stacklevel: int) -> None:
    """Warn that ``old`` is renamed; ``stacklevel`` 1 is this function's caller."""
    warnings.warn(f"Fp8CommConfig.{old} is deprecated: use {RENAMED_FIELDS[old]} (one name, one "
                  "meaning across fp8boost's configs)", DeprecationWarning,
                  stacklevel=stacklevel + 1)


def _current_names(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with former field names replaced by the current ones (warned)."""
    out = dict(kwargs)
    for old, new in RENAMED_FIELDS.items():
        if old in out:
            if new in out:
                raise TypeError(f"Fp8CommConfig got both {old}= and {new}=; pass {new} only")
            _warn_renamed(old, stacklevel=3)  # the caller of Fp8CommConfig() / replace()
            out[new] = out.pop(old)
    return out


# The dataclass-generated __init__ only knows the current names: accept the former ones too.
# (A class-body __init__ would replace the generated one, so it is wrapped here instead.)
_dataclass_init = Fp8CommConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self: Fp8CommConfig, **kwargs: Any) -> None:
    _dataclass_init(self, **_current_names(kwargs))


Fp8CommConfig.__init__ = _init
