"""The FP8 wire format and the casts that produce and consume it.

A *segment* carries ``C`` elements of one tensor chunk quantized with one scale::

    [ C FP8 bytes | pad to a multiple of 16 | 16-byte trailer: FP32 inverse scale, 12 spare ]

Rows of a packed buffer are segments of equal ``C``, laid out back to back, so every row (and
every trailer) starts 16-byte aligned: GPU kernels can use vector loads and read the scale in
place. The whole buffer is ``torch.uint8`` because NCCL and gloo reject float8 dtypes; the
overhead is at most 31 bytes per segment. Padding bytes are left uninitialised (never read).

Scaling follows :mod:`fp8boost.fp8.scaling`: ``scale = fp8_max / amax`` (optionally rounded
down to a power of two), ``q = saturate(x * scale)``, ``x ~= q * inv_scale``; amax == 0 gives
scale 1, a non-finite amax a NaN scale so corruption stays visible.

Two implementations, chosen per call by the caller:
  * ``torch``: reference ops, any device. With power-of-two scales and BF16/FP32 data the
    scaling is exact in the data's own dtype, so no FP32 temporary is made.
  * ``triton``: one fused pass per cast (CUDA sm89+; runs under ``TRITON_INTERPRET=1`` too).
    ``triton`` is imported only when this implementation is first used.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8boost.fp8.scaling import fp8_max, scale_from_amax

ALIGN = 16
TRAILER = 16


def data_bytes(numel: int) -> int:
    """Bytes the FP8 data of ``numel`` elements occupies in a segment (padded to 16)."""
    return (numel + ALIGN - 1) // ALIGN * ALIGN


def segment_bytes(numel: int) -> int:
    """Wire size of one segment of ``numel`` elements (data, padding and scale trailer)."""
    return data_bytes(numel) + TRAILER


def row_amax(x2d: torch.Tensor) -> torch.Tensor:
    """FP32 ``max |x|`` of every row (0 for empty rows; NaN if a row holds a NaN).

    ``vector_norm(inf)`` is one reduction kernel with no ``abs`` temporary; max is exact in the
    input dtype, so computing it before the FP32 conversion loses nothing.
    """
    if x2d.shape[1] == 0:
        return torch.zeros(x2d.shape[0], dtype=torch.float32, device=x2d.device)
    return torch.linalg.vector_norm(x2d, float("inf"), dim=1).float()


def row_scales(x2d: torch.Tensor, fp8_dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """Per-row FP32 scales from the rows' own amax."""
    return scale_from_amax(row_amax(x2d), fp8_dtype, 0, power_of_2)


def num_stages(payload: int, pipeline_bytes: int, max_stages: int) -> int:
    """Pipeline stages for a collective moving ``payload`` FP8 bytes (same on every rank)."""
    if pipeline_bytes <= 0 or payload <= pipeline_bytes:
        return 1
    return min(max_stages, -(-payload // pipeline_bytes))


def stage_bounds(numel: int, stages: int) -> list[tuple[int, int]]:
    """Column ranges of the stages: equal widths (multiples of 128), the last one shorter."""
    width = -(-numel // max(stages, 1))
    width = max(128, -(-width // 128) * 128)
    return [(lo, min(numel, lo + width)) for lo in range(0, numel, width)] or [(0, 0)]


def stage_scales(x2d: torch.Tensor, bounds: list[tuple[int, int]], fp8_dtype: torch.dtype,
                 power_of_2: bool) -> torch.Tensor:
    """FP32 scales ``[R, stages]`` of every row piece, from two reductions in all."""
    rows = x2d.shape[0]
    width = bounds[0][1] - bounds[0][0]
    full = sum(1 for lo, hi in bounds if hi - lo == width)
    parts = []
    if full and width:
        pieces = x2d[:, :full * width].unflatten(1, (full, width))
        parts.append(torch.linalg.vector_norm(pieces, float("inf"), dim=2).float())
    if full < len(bounds):
        parts.append(row_amax(x2d[:, full * width:]).view(rows, 1))
    amax = torch.cat(parts, dim=1) if parts else torch.zeros(rows, 1, device=x2d.device)
    return scale_from_amax(amax, fp8_dtype, 0, power_of_2)


def read_inv_scales(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The FP32 inverse scales stored in the trailers of a packed ``[R, S]`` buffer."""
    off = data_bytes(numel)
    return packed[:, off:off + 4].contiguous().view(torch.float32).reshape(-1)


def cast_rows_into(x2d: torch.Tensor, scale: torch.Tensor, data: torch.Tensor,
                   fp8_dtype: torch.dtype, *, power_of_2: bool, impl: str) -> None:
    """``data[R, C] (uint8) = FP8 bytes of saturate(x2d * scale[R, None])``.

    The core cast, also used by the FSDP2 weight all-gather. ``scale`` is FP32 ``[R]``;
    ``power_of_2`` promises every scale is a power of two (enables the exact fast path).
    """
    if x2d.numel() == 0:
        return
    if impl == "triton":
        from . import wire_triton as fp8_wire_triton  # noqa: WPS433 (lazy: imports triton)
        fp8_wire_triton.cast_rows(x2d, scale, data, fp8_dtype)
        return
    out = data.view(fp8_dtype)
    if power_of_2 and x2d.dtype in (torch.bfloat16, torch.float32):
        # A power-of-two scale multiplies exactly in BF16/FP32, and scale <= fp8_max/amax keeps
        # |x * scale| <= fp8_max (up to one FP32 ulp from the division, which the cast rounds
        # back to fp8_max), so this equals the reference clamp-and-cast bit for bit.
        out.copy_(x2d * scale.to(x2d.dtype)[:, None])
    else:
        m = fp8_max(fp8_dtype)
        out.copy_((x2d.float() * scale[:, None]).clamp_(-m, m))


def decode_rows_into(data: torch.Tensor, inv: torch.Tensor, fp8_dtype: torch.dtype,
                     out: torch.Tensor, *, power_of_2: bool, impl: str) -> None:
    """``out[R, C] = FP8 bytes data[R, C] (uint8) * inv[R, None]``, in ``out``'s dtype."""
    if out.numel() == 0:
        return
    if impl == "triton":
        from . import wire_triton as fp8_wire_triton  # noqa: WPS433
        fp8_wire_triton.dequant_rows(data, inv, out, out.shape[1], fp8_dtype)
        return
    q = data.view(fp8_dtype)
    if power_of_2 and out.dtype in (torch.bfloat16, torch.float32):
        # FP8 values and power-of-two inverse scales are exact in BF16/FP32: one rounding-free
        # multiply in the output dtype, no FP32 temporary.
        torch.mul(q.to(out.dtype), inv.to(out.dtype)[:, None], out=out)
    else:
        out.copy_(q.float() * inv[:, None])


def quantize_rows(x2d: torch.Tensor, packed: torch.Tensor, fp8_dtype: torch.dtype, *,
                  power_of_2: bool, impl: str, scale: Optional[torch.Tensor] = None) -> None:
    """Quantize every row of ``x2d[R, C]`` into the segments of ``packed[R, >= S]`` (uint8).

    Args:
        x2d: high-precision rows; any row stride, unit column stride.
        packed: uint8 destination rows (a view into the send buffer).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        power_of_2: round scales down to powers of two (must match the receiver's setting).
        impl: ``torch`` or ``triton``.
        scale: optional FP32 scale, one per row (``[R]``) or shared (0-dim); default: each
            row's own amax (with ``impl="triton"``: two fused launches, amax then scale + cast
            + trailer, for all rows).
    """
    rows, cols = x2d.shape
    if scale is None and impl == "triton" and rows and cols:
        from . import wire_triton as fp8_wire_triton  # noqa: WPS433 (lazy: imports triton)
        fp8_wire_triton.quantize_rows(x2d, packed, data_bytes(cols), fp8_dtype, power_of_2)
        return
    if scale is None:
        scale = row_scales(x2d, fp8_dtype, power_of_2)
    scale = scale.float().reshape(-1).expand(rows).contiguous()
    off = data_bytes(cols)
    packed[:, off:off + 4].copy_(scale.reciprocal().view(torch.uint8).view(rows, 4))
    cast_rows_into(x2d, scale, packed[:, :cols], fp8_dtype, power_of_2=power_of_2, impl=impl)


def dequantize_rows(packed: torch.Tensor, numel: int, fp8_dtype: torch.dtype, out: torch.Tensor,
                    *, power_of_2: bool, impl: str) -> None:
    """Decode the ``R`` segments of ``packed`` into ``out[R, numel]`` (unit column stride)."""
    if numel == 0 or packed.shape[0] == 0:
        return
    decode_rows_into(packed[:, :numel], read_inv_scales(packed, numel), fp8_dtype, out,
                     power_of_2=power_of_2, impl=impl)


def dequantize_sum_rows(packed: torch.Tensor, numel: int, fp8_dtype: torch.dtype,
                        out: torch.Tensor, *, local: Optional[torch.Tensor], post_scale: float,
                        impl: str) -> None:
    """``out = post_scale * (local + sum_r dequant(packed[r]))``, accumulated in FP32.

    The receiver side of the FP8 reduce-scatter: ``local`` is this rank's own chunk, kept in high
    precision (it never went on the wire), and is added first; the received rows follow in rank
    order, so the result is deterministic.
    """
    if numel == 0:
        return
    if impl == "triton":
        from . import wire_triton as fp8_wire_triton  # noqa: WPS433
        inv = read_inv_scales(packed, numel)
        fp8_wire_triton.dequant_sum(packed, inv, local, out, numel, fp8_dtype, post_scale)
        return
    if local is not None:
        acc = local.to(torch.float32, copy=True).reshape(numel)
    else:
        acc = torch.zeros(numel, dtype=torch.float32, device=out.device)
    if packed.shape[0]:
        inv = read_inv_scales(packed, numel)
        data = packed[:, :numel].view(fp8_dtype)
        for r in range(packed.shape[0]):
            acc.addcmul_(data[r].float(), inv[r])
    if post_scale != 1.0:
        acc.mul_(post_scale)
    out.copy_(acc.view(out.shape))
