"""Colossal-AI's FP8 casts over fp8boost's scaling math (:mod:`fp8boost.fp8.scaling`).

``cast_to_fp8`` / ``cast_from_fp8`` keep Colossal-AI's return convention: a cast returns the FP8
tensor and its FP32 *inverse* scale (multiply to decode), shaped ``[1]`` per tensor and
``[1, *leading_dims]`` per channel (one scale per last-dim row). The pipeline pair encodes a
``{"hidden_states": ...}`` dict in place for point-to-point sends, the FP8 format recorded in the
carrier dtype (bfloat16 for e4m3, float16 for e5m2), as Colossal-AI's pipeline schedule expects.

Scaling is fp8boost's current scaling: ``scale = fp8_max / amax`` (amax 0 gives scale 1), a
saturating cast computed in FP32, and a NaN/Inf amax gives a NaN scale, so corrupt input shows
up as NaN instead of being hidden.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Optional, Union

import torch

from fp8boost.fp8.scaling import E4M3, E5M2, FP8_DTYPES, amax, cast_to_fp8 as _scaled_cast
from fp8boost.fp8.scaling import dequantize, fp8_max, scale_from_amax

__all__ = ["fp8_dtype_of", "check_floating", "cast_to_fp8", "cast_from_fp8",
           "cast_to_fp8_pipeline", "cast_from_fp8_pipeline"]

FormatLike = Union[str, torch.dtype]
_FORMATS = (("e4m3", E4M3), ("e5m2", E5M2))
# The pipeline encoding names the FP8 format by the dtype the bytes travel as.
_CARRIER = ((E4M3, torch.bfloat16), (E5M2, torch.float16))


def fp8_dtype_of(fp8_format: FormatLike) -> torch.dtype:
    """The torch FP8 dtype of a Colossal-AI format name (``"e4m3"`` or ``"e5m2"``).

    The torch dtypes themselves are accepted too. Colossal-AI reads any other string as e5m2;
    here it is an error, since a typo would silently change the precision.

    Example:
        >>> fp8_dtype_of("e4m3")
        torch.float8_e4m3fn
    """
    for name, dtype in _FORMATS:
        if fp8_format == name or fp8_format is dtype:
            return dtype
    raise ValueError(f"fp8_format must be 'e4m3' or 'e5m2' (or torch.float8_e4m3fn / "
                     f"torch.float8_e5m2), got {fp8_format!r}")


def check_floating(t: Any, name: str) -> None:
    """Raise unless ``t`` is a high-precision floating-point tensor (what FP8 casts take)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype in FP8_DTYPES or t.dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        raise TypeError(f"{name} is already {t.dtype}; FP8 casts and collectives take "
                        "float32/bfloat16/float16 tensors (decode it with cast_from_fp8 first)")
    if not t.is_floating_point():
        raise TypeError(f"{name} has dtype {t.dtype}; FP8 casts and collectives take "
                        "float32/bfloat16/float16 tensors: convert it, e.g. t.float()")


def cast_to_fp8(inp: torch.Tensor, fp8_format: FormatLike = "e4m3", per_channel_scale: bool = False,
                out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast to FP8 with a scale from the tensor's own amax; return ``(fp8, inverse_scale)``.

    Args:
        inp: float32/bfloat16/float16 tensor.
        fp8_format: ``"e4m3"`` (precision: activations, weights) or ``"e5m2"`` (range: gradients).
        per_channel_scale: one scale per row (amax over the last dim) instead of one per tensor;
            finer where rows differ in magnitude (an outlier row no longer flattens the others).
        out: optional FP8 tensor of ``inp``'s shape and the format's dtype to write into; it is
            the tensor returned.

    Returns:
        The FP8 tensor and the FP32 inverse scale: ``[1]`` per tensor, ``[1, *inp.shape[:-1]]``
        per channel. ``cast_from_fp8(fp8, inverse_scale, dtype, per_channel_scale)`` decodes.

    Example:
        >>> import torch
        >>> q, inv = cast_to_fp8(torch.tensor([2.0, -7.0, 0.25]))   # exact in e4m3
        >>> q.dtype, inv.shape
        (torch.float8_e4m3fn, torch.Size([1]))
        >>> cast_from_fp8(q, inv, torch.float32)
        tensor([ 2.0000, -7.0000,  0.2500])
    """
    check_floating(inp, "inp")
    dtype = fp8_dtype_of(fp8_format)
    if per_channel_scale and inp.dim() == 0:
        raise ValueError("per_channel_scale=True scales each row (last dim) separately: pass a "
                         "tensor with at least one dim, or per_channel_scale=False")
    if out is not None:
        _check_out(out, inp, dtype)
    if inp.numel() == 0:
        empty = inp.to(dtype)
        return (out if out is not None else empty), torch.ones(1, device=inp.device)
    if per_channel_scale:
        a = inp.detach().abs().amax(dim=-1).float()
        scale = scale_from_amax(a, dtype).unsqueeze(-1)  # broadcast over each row
    else:
        scale = scale_from_amax(amax(inp), dtype)
    q = _scaled_cast(inp.detach(), scale, dtype)
    if out is not None:
        out.copy_(q)
        q = out
    inv = scale.reciprocal()
    return q, (inv.squeeze(-1) if per_channel_scale else inv).unsqueeze(0)


def _check_out(out: Any, inp: torch.Tensor, dtype: torch.dtype) -> None:
    if not isinstance(out, torch.Tensor) or out.dtype != dtype:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"out must be a {dtype} tensor for this fp8_format, got {got}")
    if out.shape != inp.shape:
        raise ValueError(f"out must have inp's shape {tuple(inp.shape)}, got {tuple(out.shape)}")


def cast_from_fp8(inp: torch.Tensor, scale_inv: torch.Tensor, ret_type: torch.dtype,
                  per_channel_scale: bool = False,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode an FP8 tensor: ``inp * scale_inv`` computed in FP32, returned as ``ret_type``.

    Args:
        inp: torch.float8_e4m3fn or torch.float8_e5m2 tensor.
        scale_inv: the inverse scale from :func:`cast_to_fp8`: one element per tensor, or (with
            ``per_channel_scale``) one per row, shaped ``[rows]`` or ``[1, rows]``.
        ret_type: dtype of the result (ignored when ``out`` is given).
        per_channel_scale: whether ``scale_inv`` holds one scale per row.
        out: optional tensor of ``inp``'s shape to write the result into (and return).

    Example:
        >>> import torch
        >>> q, inv = cast_to_fp8(torch.ones(2, 3), per_channel_scale=True)
        >>> cast_from_fp8(q, inv, torch.bfloat16, per_channel_scale=True).dtype
        torch.bfloat16
    """
    if not isinstance(inp, torch.Tensor) or inp.dtype not in FP8_DTYPES:
        got = inp.dtype if isinstance(inp, torch.Tensor) else type(inp).__name__
        raise TypeError(f"inp must be a torch.float8_e4m3fn or torch.float8_e5m2 tensor, got "
                        f"{got}; cast high-precision tensors with cast_to_fp8 first")
    if not isinstance(scale_inv, torch.Tensor):
        raise TypeError(f"scale_inv must be the tensor cast_to_fp8 returned, got "
                        f"{type(scale_inv).__name__}")
    if not isinstance(ret_type, torch.dtype) or not ret_type.is_floating_point:
        raise TypeError(f"ret_type must be a floating-point torch.dtype, got {ret_type!r}")
    rows = inp.shape[:-1] if inp.dim() else ()
    want = rows.numel() if per_channel_scale and inp.dim() else 1
    if scale_inv.numel() != want:
        kind = f"one per row ({want})" if per_channel_scale else "one"
        raise ValueError(f"scale_inv holds {scale_inv.numel()} scales, expected {kind} for inp "
                         f"of shape {tuple(inp.shape)}; pass the per_channel_scale that "
                         "cast_to_fp8 was called with")
    inv = scale_inv.reshape(*rows, 1) if per_channel_scale and inp.dim() else scale_inv.reshape(())
    if out is None:
        return dequantize(inp, inv, ret_type)
    if not isinstance(out, torch.Tensor) or out.shape != inp.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a tensor of inp's shape {tuple(inp.shape)}, got {got}")
    return out.copy_(dequantize(inp, inv, out.dtype))


def cast_to_fp8_pipeline(inp: Any) -> None:
    """Encode ``inp["hidden_states"]`` as FP8 in place, for a pipeline point-to-point send.

    The tensor's ``.data`` becomes its FP8 bytes viewed as bfloat16 (e4m3) or float16 (e5m2:
    chosen when the amax exceeds e4m3's 448), so the last dim halves (float32 input: it quarters
    in bytes). The inverse scale goes to ``inp["fp8_scale"]`` and a 0-dim tensor of the original
    dtype to ``inp["dtype"]``; :func:`cast_from_fp8_pipeline` undoes it on the receiver. A bare
    tensor and ``None`` are left as they are (pipeline stages pass those through unencoded).

    Example:
        >>> import torch
        >>> msg = {"hidden_states": torch.randn(2, 8, dtype=torch.bfloat16)}
        >>> cast_to_fp8_pipeline(msg)
        >>> msg["hidden_states"].shape
        torch.Size([2, 4])
        >>> cast_from_fp8_pipeline(msg)
        >>> msg["hidden_states"].shape, sorted(msg)
        (torch.Size([2, 8]), ['hidden_states'])
    """
    t = _hidden_states(inp, "cast_to_fp8_pipeline")
    if t is None:
        return
    check_floating(t, 'inp["hidden_states"]')
    if t.dim() == 0 or t.shape[-1] % 2:
        raise ValueError(f'inp["hidden_states"] has shape {tuple(t.shape)}: the FP8 bytes travel '
                         "as 2-byte carriers, so its last dim must be even (pad the hidden size)")
    a = amax(t)
    # One host sync: the format must be known now, since it is encoded in the carrier dtype.
    dtype = E5M2 if bool(a > fp8_max(E4M3)) else E4M3
    scale = scale_from_amax(a, dtype)
    carrier = dict(_CARRIER)[dtype]
    orig = t.dtype
    t.data = _scaled_cast(t.data, scale, dtype).view(carrier)
    inp["fp8_scale"] = scale.reciprocal()
    inp["dtype"] = torch.zeros((), dtype=orig, device=t.device)


def cast_from_fp8_pipeline(inp: Any, del_metadata: bool = True) -> None:
    """Decode what :func:`cast_to_fp8_pipeline` encoded, in place.

    Args:
        inp: the dict received (``hidden_states``, ``fp8_scale``, ``dtype``); a bare tensor or
            ``None`` is left as it is.
        del_metadata: remove ``fp8_scale`` and ``dtype`` afterwards (False keeps them, for a
            sender that decodes its own copy before sending).

    Example:
        >>> import torch
        >>> msg = {"hidden_states": torch.full((1, 4), 896.0)}
        >>> cast_to_fp8_pipeline(msg)               # > 448: e5m2, carried as float16
        >>> msg["hidden_states"].dtype
        torch.float16
        >>> cast_from_fp8_pipeline(msg)
        >>> msg["hidden_states"]
        tensor([[896., 896., 896., 896.]])
    """
    t = _hidden_states(inp, "cast_from_fp8_pipeline")
    if t is None:
        return
    missing = [k for k in ("fp8_scale", "dtype") if k not in inp]
    if missing:
        raise ValueError(f"inp lacks {missing}: it was not encoded by cast_to_fp8_pipeline (or "
                         "its metadata was deleted by an earlier cast_from_fp8_pipeline)")
    fp8 = {carrier: dtype for dtype, carrier in _CARRIER}.get(t.dtype)
    if fp8 is None:
        raise TypeError(f'inp["hidden_states"] is {t.dtype}; an FP8-encoded tensor travels as '
                        "torch.bfloat16 (e4m3) or torch.float16 (e5m2)")
    t.data = dequantize(t.data.view(fp8), inp["fp8_scale"], inp["dtype"].dtype)
    if del_metadata:
        del inp["fp8_scale"]
        del inp["dtype"]


def _hidden_states(inp: Any, fn: str) -> Optional[torch.Tensor]:
    """``inp["hidden_states"]``, or None for what the pipeline casts pass through."""
    if inp is None or isinstance(inp, torch.Tensor):
        return None
    if not isinstance(inp, MutableMapping):
        raise TypeError(f"{fn} takes a dict holding 'hidden_states' (or a tensor / None, left "
                        f"as they are), got {type(inp).__name__}")
    if "hidden_states" not in inp:
        raise ValueError(f"{fn}: the dict has no 'hidden_states' entry (keys: {sorted(inp)}); "
                         "pipeline FP8 communication encodes the activations under that key")
    return inp["hidden_states"]
