"""FP8 activations and gradients across pipeline stage boundaries.

``torch.distributed.pipelining`` sends whatever tensors a stage returns and sends back their
gradients. We do not replace its point-to-point code (private, and rewritten between torch
2.11 and 2.13); instead the tensor that crosses a boundary *is* the FP8 message:

* the sending stage ends with :class:`_Encode`: its output is the activation cast to e4m3 in
  the FP8 wire format of :mod:`fp8boost.parallel.comm.wire` (one segment: the FP8 bytes, padding
  to 16 bytes, a 16-byte trailer holding the FP32 inverse scale), the same bytes ``send_fp8``
  puts on the wire. The uint8 buffer is *viewed* as float32 (4 bytes per element, so the
  container is a quarter of the byte count) because autograd only sends gradients to floating
  tensors; send/recv copy bytes, so the view round-trips bit-exactly;
* the receiving stage starts with :class:`_Decode`, which dequantizes the bytes.

Backward mirrors it: the receiver's ``_Decode.backward`` casts the activation gradient to e5m2
in the same format, the container travels back as the "gradient" of the container, and the
sender's ``_Encode.backward`` dequantizes it. What crosses is therefore exactly "quantize, then
dequantize" of the boundary tensor in both directions (tested bit for bit).

Boundaries whose two stages share a rank (the turn of a V schedule) stay in the training dtype:
no wire, so nothing to save. So do payloads below ``Fp8CommConfig.min_payload_numel``; the
reason is logged once and kept in :attr:`BoundaryPlan.report`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from fp8boost import _state
from fp8boost.parallel.comm._utils import resolve_cast_impl
from fp8boost.parallel.comm.config import Fp8CommConfig
from fp8boost.parallel.comm.wire import dequantize_rows, quantize_rows, segment_bytes

__all__ = ["BoundaryPlan", "encode_fp8", "decode_fp8", "container_numel"]

logger = logging.getLogger("fp8boost.parallel.pipeline")


def container_numel(numel: int) -> int:
    """float32 elements of the container carrying ``numel`` FP8 values plus their scale."""
    return segment_bytes(numel) // 4  # segments are multiples of 16 bytes


def encode_fp8(x: torch.Tensor, fp8_dtype: torch.dtype, cfg: Fp8CommConfig) -> torch.Tensor:
    """``x`` as one FP8 wire segment (data + inverse scale), viewed as a 1-D float32 tensor."""
    n = x.numel()
    # The container is the base tensor and the bytes a view of it (not the other way round):
    # the schedules detach stage outputs in place, which views do not allow.
    container = torch.empty(container_numel(n), dtype=torch.float32, device=x.device)
    packed = container.view(torch.uint8).view(1, -1)
    # The padding bytes are never read; zero them so the container holds no stray NaN patterns.
    packed[:, n:].zero_()
    quantize_rows(x.detach().contiguous().view(1, n), packed, fp8_dtype,
                  power_of_2=cfg.power_of_2_wire_scale, impl=resolve_cast_impl(cfg, x.device))
    return container


def decode_fp8(container: torch.Tensor, shape: tuple, dtype: torch.dtype,
               fp8_dtype: torch.dtype, cfg: Fp8CommConfig) -> torch.Tensor:
    """Inverse of :func:`encode_fp8`: a ``shape`` tensor of ``dtype``."""
    n = 1
    for d in shape:
        n *= d
    packed = container.detach().contiguous().view(torch.uint8).view(1, -1)
    out = torch.empty(shape, dtype=dtype, device=container.device)
    dequantize_rows(packed, n, fp8_dtype, out.view(1, n), power_of_2=cfg.power_of_2_wire_scale,
                    impl=resolve_cast_impl(cfg, container.device))
    return out


class _Encode(torch.autograd.Function):
    """Sender side: forward e4m3-encodes, backward decodes the e5m2 gradient message."""

    @staticmethod
    def forward(ctx, x, cfg):
        ctx.shape, ctx.dtype, ctx.cfg = tuple(x.shape), x.dtype, cfg
        return encode_fp8(x, cfg.param_dtype, cfg)

    @staticmethod
    def backward(ctx, grad):
        return decode_fp8(grad, ctx.shape, ctx.dtype, ctx.cfg.grad_dtype, ctx.cfg), None


class _Decode(torch.autograd.Function):
    """Receiver side: forward decodes e4m3, backward e5m2-encodes the activation gradient."""

    @staticmethod
    def forward(ctx, container, shape, dtype, cfg):
        ctx.cfg = cfg
        return decode_fp8(container, shape, dtype, cfg.param_dtype, cfg)

    @staticmethod
    def backward(ctx, grad):
        return encode_fp8(grad, ctx.cfg.grad_dtype, ctx.cfg), None, None, None


@dataclass
class BoundaryPlan:
    """Which stage boundaries carry FP8, decided identically on both ends of each.

    Args:
        enabled: ``fp8_communication`` was asked for.
        cfg: the wire settings (dtypes, ``min_payload_numel``, power-of-two scales).
        same_rank: stage boundary index ``s`` (between stages ``s`` and ``s + 1``) -> both
            stages run on one rank (nothing crosses a wire).
    """

    enabled: bool
    cfg: Fp8CommConfig
    same_rank: dict[int, bool] = field(default_factory=dict)
    report: dict[str, str] = field(default_factory=dict)
    """``"stage s->s+1"`` -> what crosses and why (filled as boundaries are first used)."""

    def fp8(self, boundary: int, numel: int) -> bool:
        """Whether boundary ``boundary`` (after stage ``boundary``) carries FP8 for ``numel``."""
        key = f"stage {boundary}->{boundary + 1}"
        why = None
        if not self.enabled:
            why = "fp8_communication=False"
        elif not self.cfg.enabled:
            why = "Fp8CommConfig.enabled=False"
        elif self.same_rank.get(boundary, False):
            why = "both stages run on one rank (no wire)"
        elif numel < self.cfg.min_payload_numel:
            why = (f"payload {numel} elements < Fp8CommConfig.min_payload_numel="
                   f"{self.cfg.min_payload_numel}: "
                   "latency-bound, the casts would cost more than the bytes they save")
        if why is None:
            self.report[key] = (f"FP8: activations {self.cfg.param_dtype}, gradients "
                                f"{self.cfg.grad_dtype}, one scale per micro-batch tensor")
            return True
        self.report[key] = f"training dtype: {why}"
        if self.enabled:
            _state.log_once(logger, ("pp-fp8-boundary", key, why),
                            f"fp8boost: pipeline boundary {key} stays in the training dtype: {why}")
        return False

    def encode(self, x: torch.Tensor, boundary: int) -> torch.Tensor:
        """The tensor the stage before ``boundary`` returns (sends)."""
        if not self.fp8(boundary, x.numel()):
            return x
        return _Encode.apply(x, self.cfg)

    def decode(self, received: torch.Tensor, boundary: int, shape: tuple,
               dtype: torch.dtype) -> torch.Tensor:
        """The activation the stage after ``boundary`` computes on."""
        numel = 1
        for d in shape:
            numel *= d
        if not self.fp8(boundary, numel):
            return received
        return _Decode.apply(received, tuple(shape), dtype, self.cfg)

    def wire_meta(self, boundary: int, shape: tuple, dtype: torch.dtype) -> tuple[tuple, torch.dtype]:
        """(shape, dtype) of the tensor that crosses ``boundary`` for an activation ``shape``."""
        numel = 1
        for d in shape:
            numel *= d
        if self.fp8(boundary, numel):
            return (container_numel(numel),), torch.float32
        return tuple(shape), dtype


def default_comm_config(cfg: Optional[Fp8CommConfig]) -> Fp8CommConfig:
    return cfg if cfg is not None else Fp8CommConfig()
