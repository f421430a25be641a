"""Reference quantizers of the rowwise and blockwise recipes, in plain torch ops.

They serve the emulated backend, define the bytes every faster path must reproduce, and run
under ``torch.compile``, where inductor fuses them into the kernel that produced the tensor.

Every GEMM operand is described in its "NT" form: a 2-D row-major tensor whose last dim is
the GEMM's reduced dim (K-major, as Hopper FP8 tensor cores want). A :class:`GranularFp8`
holds the FP8 data in that form and FP32 *inverse* scales (``data.float() * inv_scale ~=
original``; the scale that multiplied on the way in is ``1 / inv_scale``, exactly so with
power-of-2 scales). Scale layouts, for an operand ``data[R, C]`` reduced over ``C``:

=========  ==================================  =============================================
kind       one scale per                        ``inv_scale`` shape
=========  ==================================  =============================================
``row``    row (amax over all of C)             ``[R, 1]``
``tile``   1 x b tile along C                   ``[R, ceil(C/b)]``
``block``  b x b block                          ``[ceil(R/b), ceil(C/b)]``
=========  ==================================  =============================================

(``torch._scaled_mm`` wants the second operand's rowwise scale as ``[1, N]``: that is the
``[N, 1]`` above transposed, which the GEMM dispatch does.) A dim that is not a multiple of
``b`` ends in a partial tile or block whose scale comes from its own elements (implemented by
zero padding, which cannot change an amax), so no shape is refused and none falls back.

Under ``torch.compile`` on CPU (torch 2.13's inductor C++ backend), a partial tile or block
compiles wrong: that backend miscompiles the element-to-tile index (``torch.compile(lambda:
torch.arange(200) // 128)()`` is garbage past 128). Eager CPU and full tiles are exact; the
GPU (Triton) codegen is checked by ``tests/fp8/test_granular_gpu.py``.

Scale math is :func:`fp8boost.fp8.scaling.scale_from_amax`, elementwise: amax 0 gives scale 1,
a NaN/Inf anywhere in a row/tile/block makes that row/tile/block's scale NaN and so all of its
FP8 values NaN (visible, and confined to it), the cast saturates in FP32.
"""
from __future__ import annotations

from typing import Optional

import logging

import torch

from ... import _state
from ..scaling import E4M3, cast_to_fp8, scale_from_amax
from .operand import KINDS, GranularFp8  # noqa: F401 - public here too (their first home)

# Backends whose eager CUDA casts take the Triton kernels (fp8boost.fp8.kernels.granular_cast).
FUSED_BACKENDS = ("triton", "cublas")
_LOG = logging.getLogger("fp8boost.fp8.granular")




def _check_2d(x: torch.Tensor, block: int = 0) -> None:
    if not torch.is_tensor(x) or x.dim() != 2:
        shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
        raise ValueError(f"expected a 2-D tensor, got {shape}; flatten leading dims first "
                         "(x.reshape(-1, x.shape[-1]))")
    if block and (block < 1 or block & (block - 1)):
        raise ValueError(f"block size must be a power of two, got {block}")


def _pad_cols(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = -x.shape[1] % block
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = E4M3, *, margin: int = 0,
                  power_of_2: bool = False, amax_group=None) -> GranularFp8:
    """One scale per row of ``x[R, C]`` (amax over C): the operand ``x`` reduced over C.

    ``amax_group``: a process group over which ``x`` is a shard along C (tensor
    parallelism): the row amaxes are all-reduced (MAX, ``R`` floats) so every row is scaled
    from all of its elements, as one process scales it, and the FP8 bytes are that process's.

    Example:
        >>> q = quantize_rows(torch.randn(4, 32))
        >>> tuple(q.data.shape), tuple(q.inv_scale.shape)
        ((4, 32), (4, 1))
    """
    _check_2d(x)
    a = x.detach().abs().amax(dim=1, keepdim=True).float() if x.shape[1] else \
        torch.zeros(x.shape[0], 1, device=x.device)
    if spans_ranks(amax_group):
        torch.distributed.all_reduce(a, op=torch.distributed.ReduceOp.MAX, group=amax_group)
    scale = scale_from_amax(a, dtype, margin, power_of_2)
    # contiguous: from quantize_cols_t, x is a transposed view and the cast keeps its strides;
    # GEMM operands must be row-major (1 byte/element to copy, not the 2-4 of the input).
    return GranularFp8(cast_to_fp8(x, scale, dtype).contiguous(), scale.reciprocal(), "row")


def quantize_cols_t(x: torch.Tensor, dtype: torch.dtype = E4M3, *, margin: int = 0,
                    power_of_2: bool = False, amax_group=None) -> GranularFp8:
    """One scale per column of ``x[R, C]`` (amax over R), emitted transposed: the operand
    ``x^T[C, R]`` reduced over R (wgrad's operands, scaled along the token axis; ``W^T`` in
    dgrad). ``amax_group``: ``x`` is a shard along R over it (see :func:`quantize_rows`)."""
    _check_2d(x)
    return quantize_rows(x.t(), dtype, margin=margin, power_of_2=power_of_2,
                         amax_group=amax_group)


def spans_ranks(group) -> bool:
    """Whether ``group`` (a process group or None) has more than one rank."""
    return group is not None and torch.distributed.get_world_size(group) > 1


def quantize_tiles(x: torch.Tensor, dtype: torch.dtype = E4M3, *, block: int = 128,
                   margin: int = 0, power_of_2: bool = False) -> GranularFp8:
    """1 x ``block`` tiles along the last dim of ``x[R, C]``; ``inv_scale`` ``[R, ceil(C/b)]``.

    Example:
        >>> q = quantize_tiles(torch.randn(4, 200), block=128)
        >>> tuple(q.inv_scale.shape)
        (4, 2)
    """
    _check_2d(x, block)
    r, c = x.shape
    xp = _pad_cols(x, block)
    tiles = xp.reshape(r, xp.shape[1] // block, block)  # explicit: r may be 0
    a = tiles.detach().abs().amax(dim=2).float() if tiles.numel() else \
        torch.zeros(r, tiles.shape[1], device=x.device)
    scale = scale_from_amax(a, dtype, margin, power_of_2)
    data = cast_to_fp8(tiles, scale.unsqueeze(2), dtype).reshape(r, xp.shape[1])[:, :c]
    return GranularFp8(data.contiguous(), scale.reciprocal(), "tile", block)


def quantize_tiles_t(x: torch.Tensor, dtype: torch.dtype = E4M3, *, block: int = 128,
                     margin: int = 0, power_of_2: bool = False) -> GranularFp8:
    """``block`` x 1 tiles along dim 0 of ``x[R, C]``, emitted transposed: the operand
    ``x^T[C, R]`` in 1 x ``block`` tiles along R; ``inv_scale`` ``[C, ceil(R/b)]``."""
    _check_2d(x, block)
    return quantize_tiles(x.t(), dtype, block=block, margin=margin, power_of_2=power_of_2)


def quantize_blocks(w: torch.Tensor, dtype: torch.dtype = E4M3, *, block: int = 128,
                    margin: int = 0, power_of_2: bool = False) -> GranularFp8:
    """``block`` x ``block`` blocks of ``w[N, K]``; ``inv_scale`` ``[ceil(N/b), ceil(K/b)]``.

    The dgrad operand ``W^T`` is the same blocks transposed (:meth:`GranularFp8.t`).

    Example:
        >>> q = quantize_blocks(torch.randn(300, 256), block=128)
        >>> tuple(q.inv_scale.shape), tuple(q.t().inv_scale.shape)
        ((3, 2), (2, 3))
    """
    _check_2d(w, block)
    n, k = w.shape
    pad_n, pad_k = -n % block, -k % block
    wp = torch.nn.functional.pad(w, (0, pad_k, 0, pad_n)) if pad_n or pad_k else w
    nb, kb = wp.shape[0] // block, wp.shape[1] // block
    blocks = wp.reshape(nb, block, kb, block)
    a = blocks.detach().abs().amax(dim=(1, 3)).float() if blocks.numel() else \
        torch.zeros(nb, kb, device=w.device)
    scale = scale_from_amax(a, dtype, margin, power_of_2)
    data = cast_to_fp8(blocks, scale[:, None, :, None], dtype).reshape(nb * block, kb * block)
    return GranularFp8(data[:n, :k].contiguous(), scale.reciprocal(), "block", block)


def _import_kernels():
    try:
        # lazy: the kernels import triton, which is optional
        from ..kernels import granular_cast
    except Exception as e:  # noqa: BLE001 (no/broken Triton: any import error means "no")
        _state.log_once(_LOG, "granular-cast-import", f"granular FP8 casts: Triton kernels "
                        f"unavailable ({type(e).__name__}: {e}); using the torch reference")
        return None
    return granular_cast


def fused_kernels(x: torch.Tensor, backend) -> Optional[object]:
    """The Triton cast module when ``x`` should take it, else None (use the torch ops).

    Taken in eager mode on CUDA under the ``triton``/``cublas`` backends, for plain tensors,
    once Triton imported (checked once per process). Under ``torch.compile`` the torch ops
    stay, so that inductor fuses them into the producer of ``x``.

    Args:
        x: the tensor to quantize.
        backend: an ``Fp8Backend`` or its name (None: the reference).
    """
    name = backend if backend is None or isinstance(backend, str) else \
        getattr(backend, "name", None)
    if name not in FUSED_BACKENDS or type(x) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if not x.is_cuda or torch.compiler.is_compiling():
        return None
    return _state.probe("granular-triton-cast", _import_kernels)


def quantize_operands(x: torch.Tensor, dtype: torch.dtype, recipe: str, *, weight: bool,
                      rows: bool = True, cols: bool = False, block: int = 128, margin: int = 0,
                      power_of_2: bool = False, backend=None, rows_group=None,
                      cols_group=None) -> tuple[Optional[GranularFp8], Optional[GranularFp8]]:
    """Every operand the GEMMs need from one tensor ``x[R, C]``, in one call.

    ``rows``: the operand reduced over C (``x`` itself: x and W in fprop, dy in dgrad).
    ``cols``: the operand reduced over R (``x^T``: W^T in dgrad, dy^T and x^T in wgrad).
    ``recipe`` ``rowwise``: per-row scales of each operand. ``blockwise``: activations and
    gradients (``weight=False``) in 1 x ``block`` tiles along each operand's reduced dim,
    weights in ``block`` x ``block`` blocks whose transpose is the ``cols`` operand (the same
    bytes and scales). ``backend`` (an ``Fp8Backend`` or its name): under ``triton`` or
    ``cublas``, eager CUDA calls take the Triton kernels of
    :mod:`fp8boost.fp8.kernels.granular_cast` (the same bytes, in fewer reads of ``x``; see
    :func:`fused_kernels`); otherwise these torch ops.

    ``rows_group`` / ``cols_group`` (``rowwise`` only; tensor parallelism): ``x`` is a shard
    along C / along R over that process group, so the ``rows`` / ``cols`` operand's per-row
    amaxes are all-reduced first (:func:`quantize_rows`). Such a cast takes these torch ops
    (the Triton kernels cast in the same pass that finds the amax). Blockwise tiles and blocks
    never need it: they stay within a shard whose split dim is a multiple of ``block``.

    Returns:
        ``(rows_operand or None, cols_operand or None)``.

    Example:
        >>> x = torch.randn(256, 64)
        >>> xq, xq_t = quantize_operands(x, E4M3, "blockwise", weight=False, cols=True)
        >>> tuple(xq.inv_scale.shape), tuple(xq_t.data.shape), tuple(xq_t.inv_scale.shape)
        ((256, 1), (64, 256), (64, 2))
    """
    kw = {"margin": margin, "power_of_2": power_of_2}
    reduced = (rows and spans_ranks(rows_group)) or (cols and spans_ranks(cols_group))
    if reduced and recipe != "rowwise":
        raise ValueError(f"quantize_operands: amax groups apply to the rowwise recipe only, "
                         f"got {recipe!r} (its tiles and blocks are scaled within a shard)")
    kernels = fused_kernels(x, backend)
    if kernels is not None and reduced:
        _state.log_once(_LOG, "granular-tp-rows-torch-cast", "fp8boost: rowwise casts of "
                        "operands whose rows span tensor-parallel shards use the torch ops, "
                        "not the Triton kernels (the row amax is all-reduced between the amax "
                        "pass and the cast)")
        kernels = None
    if kernels is not None and kernels.supports(x, dtype, recipe, block=block, **kw):
        return kernels.quantize_operands(x, dtype, recipe, weight=weight, rows=rows, cols=cols,
                                         block=block, **kw)
    if recipe == "rowwise":
        return (quantize_rows(x, dtype, amax_group=rows_group, **kw) if rows else None,
                quantize_cols_t(x, dtype, amax_group=cols_group, **kw) if cols else None)
    if recipe != "blockwise":
        raise ValueError(f"quantize_operands: recipe {recipe!r} is not granular; use "
                         "'rowwise' or 'blockwise' (tensorwise casts live in fp8.scaling)")
    if weight:
        q = quantize_blocks(x, dtype, block=block, **kw)
        return (q if rows else None), (q.t() if cols else None)
    return (quantize_tiles(x, dtype, block=block, **kw) if rows else None,
            quantize_tiles_t(x, dtype, block=block, **kw) if cols else None)
