"""GEMMs of the rowwise and blockwise recipes: ``out[M, N] = a[M, K] . b[N, K]^T``.

Both operands are :class:`~fp8boost.fp8.granular.quantize.GranularFp8` in NT form (K last).
Paths, chosen by the backend's name:

* ``emulated`` (any device): dequantize each operand with its scales in FP32 and multiply in
  FP32. That is at least as precise as DeepSeek-V3's "promote to FP32 every 128 of K"
  (FP32 all the way), so it is the reference the GPU paths are held to.
* ``cublas`` and ``triton`` (no Triton rowwise/blockwise GEMM yet: the same cuBLAS call, the
  choice logged once): rowwise through ``torch._scaled_mm`` with ``scale_a`` ``[M, 1]`` and
  ``scale_b`` ``[1, N]`` FP32; blockwise through ``torch.nn.functional.scaled_mm`` with
  ``ScalingType.BlockWise1x128`` x ``BlockWise128x128`` (fprop, dgrad) or
  ``BlockWise1x128`` x ``BlockWise1x128`` (wgrad), where torch, cuBLASLt (CUDA 12.9+) and the
  GPU (sm90) have it, as found by a one-time probe. Where they do not, or for a block size
  other than 128, the operands are dequantized to BF16 and multiplied there, with a warning
  once saying why: never silently.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

from fp8boost._state import log_once, probe, warn_once

from .ops import blockwise_scaled_mm_op
from ..scaling import cast_result  # noqa: F401 - re-exported (granular.function)
from .quantize import GranularFp8

_LOG = logging.getLogger(__name__)


def _pad2(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    """Pad a 2-D tensor to ``[rows, cols]`` (FP8 through uint8: F.pad lacks FP8 kernels)."""
    if tuple(t.shape) == (rows, cols):
        return t
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        out = torch.zeros(rows, cols, dtype=torch.uint8, device=t.device)
        out[: t.shape[0], : t.shape[1]] = t.view(torch.uint8)
        return out.view(t.dtype)
    out = torch.full((rows, cols), value, dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def check_operands(a: GranularFp8, b: GranularFp8) -> None:
    """Raise ValueError unless ``a[M,K]`` and ``b[N,K]`` can be multiplied as one recipe."""
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"granular_mm needs a[M,K] and b[N,K] (NT form), got "
                         f"{tuple(a.data.shape)} and {tuple(b.data.shape)}")
    pair = (a.kind, b.kind)
    # (block, tile) never occurs in a linear layer (weights are always the second operand).
    ok = pair == ("row", "row") or (pair in (("tile", "block"), ("tile", "tile"))
                                    and a.block == b.block)
    if not ok:
        raise ValueError(f"granular_mm: operand kinds {pair} (blocks {a.block}, {b.block}) do "
                         "not form a recipe; use (row, row), (tile, block) or (tile, tile) of one size")


def emulated_mm(a: GranularFp8, b: GranularFp8, *, bias: Optional[torch.Tensor] = None,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Reference: dequantize both operands in FP32, FP32 matmul, bias in FP32, cast once."""
    out = a.dequantize() @ b.dequantize().t()
    if bias is not None:
        out = out + bias.float()
    return cast_result(out, out_dtype)


def rowwise_scaled_mm(a: GranularFp8, b: GranularFp8, bias: Optional[torch.Tensor] = None,
                      out_dtype: torch.dtype = torch.bfloat16,
                      use_fast_accum: bool = False) -> torch.Tensor:
    """The cuBLAS rowwise call: ``torch._scaled_mm(a[M,K], b[N,K].t(), scale_a=[M,1],
    scale_b=[1,N])``, FP32 scales, BF16 out; dims padded to multiples of 16 (zeros, scale 1)."""
    m, k = a.data.shape
    n = b.data.shape[0]
    mp, kp, np_ = _round_up(m, 16), _round_up(k, 16), _round_up(n, 16)
    sa = _pad2(a.inv_scale.float(), mp, 1, 1.0).contiguous()
    sb = _pad2(b.inv_scale.float(), np_, 1, 1.0).reshape(1, np_)
    # Rowwise scaled_mm is only guaranteed with BF16 output (the CUTLASS path); an FP32
    # result (an FP32 master's weight gradient) is that BF16 product cast up.
    out = torch._scaled_mm(_pad2(a.data, mp, kp), _pad2(b.data, np_, kp).t(), scale_a=sa,
                           scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)
    out = out[:m, :n]
    if bias is not None:
        out = out.float() + bias.float()
    return cast_result(out, out_dtype)


def blockwise_scale_args(a: GranularFp8, b: GranularFp8, m_pad: int, n_pad: int, k_pad: int):
    """The scale tensors of :func:`fp8boost.fp8.granular.ops.blockwise_scaled_mm_op`,
    contiguous: ``a``'s 1x128 scales as ``[K/128, M]``; ``b``'s 128x128 scales as
    ``[N/128, L4]`` (``L4 = round_up(K/128, 4)``, padding ignored) or its 1x128 scales as
    ``[K/128, N]``. The op views them into ``F.scaled_mm``'s layouts (torch 2.13,
    ``_meta_registrations.py``: ``[M, K/128]`` strides ``[1, M]``; ``[L4, N/128]`` strides
    ``[1, L4]``; ``[N, K/128]`` strides ``[1, N]``). All dims here are padded to multiples
    of 128.
    """
    kb = k_pad // 128
    sa = _pad2(a.inv_scale.float(), m_pad, kb, 1.0).t().contiguous()
    if b.kind == "block":
        sb = _pad2(b.inv_scale.float(), n_pad // 128, _round_up(kb, 4), 1.0).contiguous()
    else:
        sb = _pad2(b.inv_scale.float(), n_pad, kb, 1.0).t().contiguous()
    return sa, sb


def blockwise_scaled_mm(a: GranularFp8, b: GranularFp8, bias: Optional[torch.Tensor] = None,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The cuBLAS blockwise GEMM (``torch.nn.functional.scaled_mm`` inside the custom op
    ``fp8boost::blockwise_scaled_mm``, which ``torch.compile`` keeps as one node), dims
    zero-padded to multiples of 128; BF16 out."""
    m, k = a.data.shape
    n = b.data.shape[0]
    # Zero padding: padded elements contribute 0 whatever their (unit) scale.
    mp, kp, np_ = _round_up(m, 128), _round_up(k, 128), _round_up(n, 128)
    sa, sb = blockwise_scale_args(a, b, mp, np_, kp)
    out = blockwise_scaled_mm_op(_pad2(a.data, mp, kp), _pad2(b.data, np_, kp), sa, sb,
                                 b.kind == "block")
    out = out[:m, :n]
    if bias is not None:
        out = out.float() + bias.float()
    return cast_result(out, out_dtype)


def _try_blockwise(device: torch.device) -> Optional[str]:
    """None if cuBLAS blockwise runs on ``device``, else why not (a tiny call, once)."""
    if not hasattr(F, "scaled_mm") or "BlockWise128x128" not in getattr(
            getattr(F, "ScalingType", None), "__members__", {}):
        return f"torch {torch.__version__} has no nn.functional.scaled_mm with blockwise scaling"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "cuBLAS blockwise FP8 GEMMs run on sm90 (H100/H200) only"
    x = torch.ones(128, 128, device=device)
    q = GranularFp8(x.to(torch.float8_e4m3fn), torch.ones(128, 1, device=device), "tile", 128)
    w = GranularFp8(x.to(torch.float8_e4m3fn), torch.ones(1, 1, device=device), "block", 128)
    try:
        out = blockwise_scaled_mm(q, w, None, torch.float32)
    except (RuntimeError, ValueError, TypeError) as exc:  # e.g. cuBLASLt < 12.9: unsupported
        return f"torch's blockwise scaled_mm failed here ({str(exc).splitlines()[0]})"
    if not bool((out == 128).all()):
        return "torch's blockwise scaled_mm gave a wrong result in the self-test"
    return None


def blockwise_gemm_unavailable(device: torch.device) -> Optional[str]:
    """Why the cuBLAS blockwise GEMM cannot run on ``device`` (None: it can). Probed once."""
    device = torch.device(device)
    if device.type != "cuda":
        return "not a CUDA device"
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return probe(f"granular-blockwise-scaled-mm-cuda:{idx}",
                 lambda: _try_blockwise(torch.device("cuda", idx)))


_TRITON_USES_CUBLAS = ("fp8boost: rowwise/blockwise GEMMs run through cuBLAS (torch scaled_mm): "
                       "no Triton kernel for them yet")


def prepare(backend, recipe: str, device: torch.device) -> None:
    """What ``granular_mm`` decides once, done eagerly when a layer resolves its backend: log
    the GEMM choice and probe cuBLAS blockwise. A compiled forward then never traces a log
    or a probe (a lock or a trial GEMM there breaks dynamo's graph)."""
    name = backend if isinstance(backend, str) else getattr(backend, "name", None)
    if name == "triton":
        log_once(_LOG, "granular-triton-uses-cublas", _TRITON_USES_CUBLAS)
    if recipe == "blockwise" and name in ("cublas", "triton"):
        blockwise_gemm_unavailable(device)


def _dequant_bf16_mm(a: GranularFp8, b: GranularFp8, bias, out_dtype):
    out = torch.mm(a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16).t())
    if bias is not None:
        out = out.float() + bias.float()
    return cast_result(out, out_dtype)


def granular_mm(a: GranularFp8, b: GranularFp8, backend, *, bias: Optional[torch.Tensor] = None,
                out_dtype: torch.dtype = torch.bfloat16, use_fast_accum: bool = False
                ) -> torch.Tensor:
    """``a[M,K] . b[N,K]^T`` with each operand's row/tile/block scales (+ bias), ``[M, N]``.

    Args:
        a, b: operands of one recipe: (row, row), (tile, block) or (tile, tile).
        backend: an ``Fp8Backend`` (or its name): ``emulated`` dequantizes and multiplies in
            FP32; ``cublas``/``triton`` call cuBLAS (see the module docstring).
        bias: ``[N]``, added in FP32.
        out_dtype: dtype of the result.
        use_fast_accum: rowwise cuBLAS only; blockwise always promotes to FP32.

    Example:
        >>> from fp8boost.fp8.granular.quantize import quantize_rows
        >>> a, b = quantize_rows(torch.randn(8, 32)), quantize_rows(torch.randn(16, 32))
        >>> granular_mm(a, b, "emulated", out_dtype=torch.float32).shape
        torch.Size([8, 16])
    """
    check_operands(a, b)
    name = backend if isinstance(backend, str) else getattr(backend, "name", None)
    if name == "emulated":
        return emulated_mm(a, b, bias=bias, out_dtype=out_dtype)
    if name not in ("cublas", "triton"):
        raise ValueError(f"granular_mm: unknown backend {name!r}; use emulated|cublas|triton")
    if name == "triton" and not torch.compiler.is_compiling():  # logged eagerly: prepare()
        log_once(_LOG, "granular-triton-uses-cublas", _TRITON_USES_CUBLAS)
    if a.kind == "row":
        return rowwise_scaled_mm(a, b, bias, out_dtype, use_fast_accum)
    why = ("block size %d (cuBLAS takes 128)" % a.block if a.block != 128
           else blockwise_gemm_unavailable(a.data.device))
    if why is None:
        return blockwise_scaled_mm(a, b, bias, out_dtype)
    warn_once(f"granular-blockwise-fallback-{why}",
              f"fp8boost: blockwise FP8 GEMM unavailable ({why}); dequantizing to BF16 and "
              "multiplying there: FP8 numerics, no FP8 speed-up")
    return _dequant_bf16_mm(a, b, bias, out_dtype)
