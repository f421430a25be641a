"""Persistent FP8 GEMM: ``out[M,N] = (a[M,K] @ b[N,K].T) * a_inv * b_inv (+ bias)``.

Both operands are K-major (row-major with K last), the only layout Hopper FP8 tensor cores take.
One program per SM walks the output tiles (GROUP_M swizzle for L2 reuse); the K loop is
software-pipelined by Triton (``num_stages``), no warp specialization. Where the installed
Triton has host-side tensor descriptors (``triton.tools.tensor_descriptor``, Triton >= 3.3) and
the strides are 16-byte aligned, operands are loaded and the output stored through TMA, which
also zero-fills ragged edges (M not a multiple of the tile, K not a multiple of BLOCK_K).
Otherwise a pointer-based variant of the same kernel runs (any shape).

Accumulation: ``use_fast_accum=True`` lets the tensor cores accumulate in their reduced-precision
FP8 mode over the whole K loop (fprop). ``use_fast_accum=False`` promotes into an FP32
accumulator after every ``BLOCK_K`` (=128, or 64) elements via ``max_num_imprecise_acc`` --
the same promotion interval cuBLAS and DeepSeek-V3 use -- for dgrad/wgrad, where K (tokens for
wgrad) is long.

The per-tensor inverse scales are applied in FP32 in the epilogue, then the bias, then one
rounding to the output dtype.
"""
from __future__ import annotations

import logging
from types import MappingProxyType
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from fp8boost import _state

from .tuning import ConfigCache, bucket, interpreting, num_sms

try:  # host-side TMA descriptors: Triton >= 3.3 (3.6 on the GPU machine, 3.9 on CI)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer kernel only
    TensorDescriptor = None

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.bfloat16, torch.float16, torch.float32)
_TL_OUT = MappingProxyType({torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                            torch.float32: tl.float32})


class GemmConfig(NamedTuple):
    """One kernel configuration (block sizes, swizzle group, pipeline depth, warps)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    stages: int
    warps: int
    subtile: bool  # store the epilogue in two BLOCK_N/2 halves (less shared memory)
    lagged: bool = False  # promoted mode only: add block i-1's partial while block i computes
    promote: int = 128  # promoted mode only: K elements per FP32 promotion (<= block_k)


# Candidates timed once per (M bucket, N, K, dtypes, accumulation, bias). 128x256x128 with 8
# warps is the Hopper sweet spot for fast accumulation (measured on an H200, bench/gemm.py:
# 0.93-1.08x torch._scaled_mm at M,N,K >= 4096, 1.78x BF16 cuBLAS at 8192^3). Promoted
# accumulation keeps a second accumulator in registers and must wait for the tensor cores
# before each FP32 add; the "lagged" variant (add block i-1 while block i computes) did not
# change that much: promoted Triton measured 0.69-0.77x of _scaled_mm(use_fast_accum=False),
# which is why TritonBackend lets the tuner time cuBLAS too (allow_cublas, see mm()).
FAST_CONFIGS = (
    GemmConfig(128, 256, 128, 8, 3, 8, True),
    GemmConfig(128, 256, 128, 8, 4, 8, True),
    GemmConfig(256, 128, 128, 8, 3, 8, True),
    GemmConfig(128, 128, 128, 8, 4, 8, False),
    GemmConfig(128, 128, 128, 8, 5, 4, False),
    GemmConfig(128, 256, 64, 8, 5, 8, True),
)
PRECISE_CONFIGS = (
    GemmConfig(128, 256, 128, 8, 3, 8, True),
    GemmConfig(128, 128, 128, 8, 4, 8, False),
    GemmConfig(128, 128, 128, 8, 4, 8, False, True),
    GemmConfig(128, 128, 128, 8, 5, 8, True, True),
    GemmConfig(64, 256, 128, 8, 4, 8, True, True),
    GemmConfig(128, 256, 128, 8, 3, 8, True, True),
)
CUBLAS = "cublas"  # pseudo-config: torch._scaled_mm, only when the caller allows dispatch
_INTERP_CONFIG = GemmConfig(16, 32, 32, 2, 1, 1, True)
_CACHE = ConfigCache("gemm")


@triton.jit
def _tile_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_M: tl.constexpr):
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _epilogue(acc, scale, bias_ptr, offs_n, N, HAS_BIAS: tl.constexpr):
    acc = acc * scale
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    return acc


@triton.jit(do_not_specialize=["M"])  # ragged token counts must not recompile
def _gemm_tma_kernel(a_desc, b_desc, c_desc, a_inv_ptr, b_inv_ptr, bias_ptr, M, N, K,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SUBTILE: tl.constexpr, PROMOTE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                     LAGGED: tl.constexpr):
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    scale = tl.load(a_inv_ptr) * tl.load(b_inv_ptr)
    # Separate epilogue tile counter: flattened pipelining must not share the loop's value
    # between prologue and epilogue (same workaround as Triton's persistent-matmul tutorial).
    tile_id_c = start_pid - NUM_SMS
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
        offs_am = pid_m * BLOCK_M
        offs_bn = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LAGGED:
            # Promotion without stalling the tensor cores: block i's product goes to a fresh
            # partial while block i-1's partial is added to the FP32 accumulator (CUDA cores).
            prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                offs_k = ki * BLOCK_K
                part = tl.dot(a_desc.load([offs_am, offs_k]), b_desc.load([offs_bn, offs_k]).T)
                acc += prev
                prev = part
            acc += prev
        else:
            for ki in range(k_tiles):
                offs_k = ki * BLOCK_K
                a = a_desc.load([offs_am, offs_k])
                b = b_desc.load([offs_bn, offs_k])
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=PROMOTE)
        tile_id_c += NUM_SMS
        pid_m, pid_n = _tile_pid(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M)
        offs_cm = pid_m * BLOCK_M
        offs_cn = pid_n * BLOCK_N
        acc = _epilogue(acc, scale, bias_ptr, offs_cn + tl.arange(0, BLOCK_N), N, HAS_BIAS)
        if SUBTILE:
            acc = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(acc)
            c_desc.store([offs_cm, offs_cn], acc0.to(OUT_DTYPE))
            c_desc.store([offs_cm, offs_cn + BLOCK_N // 2], acc1.to(OUT_DTYPE))
        else:
            c_desc.store([offs_cm, offs_cn], acc.to(OUT_DTYPE))


@triton.jit
def _gemm_ptr_kernel(a_ptr, b_ptr, c_ptr, a_inv_ptr, b_inv_ptr, bias_ptr, M, N, K,
                     stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SUBTILE: tl.constexpr, PROMOTE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                     LAGGED: tl.constexpr):
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    scale = tl.load(a_inv_ptr) * tl.load(b_inv_ptr)
    offs_k0 = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS):
        pid_m, pid_n = _tile_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Clamp out-of-range rows instead of masking them: their results are never stored.
        rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
        rows_b = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            offs_k = ki * BLOCK_K + offs_k0
            k_ok = offs_k[None, :] < K
            a = tl.load(a_ptr + rows_a[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=k_ok, other=0.0)
            b = tl.load(b_ptr + rows_b[:, None] * stride_bn + offs_k[None, :] * stride_bk,
                        mask=k_ok, other=0.0)
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=PROMOTE)
        acc = _epilogue(acc, scale, bias_ptr, offs_n, N, HAS_BIAS)
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(OUT_DTYPE), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


#: the TMA kernel, for callers that launch it themselves (gemm_direct: a compiled graph's
#: traced launch with the config fixed at trace time)
TMA_KERNEL = _gemm_tma_kernel


def check_inputs(a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
                 bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> None:
    """Raise a clear error for operands the GEMM cannot take (before any work)."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in _FP8:
            raise TypeError(f"{name} must be a 2-D float8_e4m3fn/float8_e5m2 tensor, got "
                            f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"mm expects K-major a[M,K] and b[N,K] (out = a @ b.T); got a "
                         f"{tuple(a.shape)}, b {tuple(b.shape)}; pass b as [N,K] (e.g. data_t)")
    if a.device != b.device or (a.device.type != "cuda" and not interpreting()):
        raise ValueError(f"the Triton GEMM needs both operands on one CUDA device, got "
                         f"{a.device} and {b.device}; use the 'emulated' backend on CPU")
    for name, s in (("a_inv_scale", a_inv), ("b_inv_scale", b_inv)):
        if s.numel() != 1 or s.device != a.device:
            raise ValueError(f"{name} must be a 1-element tensor on {a.device} (per-tensor "
                             f"scaling), got shape {tuple(s.shape)} on {s.device}")
    if out_dtype not in _OUT:
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[0]
                             or bias.device != a.device):
        raise ValueError(f"bias must be 1-D of length N={b.shape[0]} on {a.device}, got "
                         f"{tuple(bias.shape)} on {bias.device}")


def _tma_ok(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """TMA needs a unit last stride, 16-byte aligned bases and row strides."""
    return (tma_layout_ok(a, b, out_dtype) and a.data_ptr() % 16 == 0
            and b.data_ptr() % 16 == 0)


def tma_layout_ok(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """:func:`_tma_ok` from sizes, strides and storage offsets alone (fake operands at trace
    time have no address; every allocation is at least 16-byte aligned)."""
    if TensorDescriptor is None:
        return False
    n_bytes = b.shape[0] * out_dtype.itemsize
    return (a.stride(1) == 1 and b.stride(1) == 1 and a.stride(0) % 16 == 0
            and b.stride(0) % 16 == 0 and a.storage_offset() % 16 == 0
            and b.storage_offset() % 16 == 0 and n_bytes % 16 == 0)


def mm(a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
       bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
       use_fast_accum: bool = False, force_pointer: bool = False,
       allow_cublas: bool = False) -> torch.Tensor:
    """``(a @ b.T) * a_inv * b_inv (+ bias)`` for FP8 ``a[M,K]``, ``b[N,K]``.

    Args:
        a: FP8 [M, K], K-major (any M, ragged tails included).
        b: FP8 [N, K], K-major.
        a_inv, b_inv: FP32 1-element inverse scales (``x ~= q * inv``).
        bias: optional [N] bias added in FP32 before the final rounding.
        out_dtype: bfloat16 (default), float16 or float32.
        use_fast_accum: accumulate in the tensor cores' fast FP8 mode over all of K; False
            promotes to FP32 every BLOCK_K elements.
        force_pointer: use the pointer kernel even where TMA applies (tests, benchmarks).
        allow_cublas: also time ``torch._scaled_mm`` when tuning this shape and use it if it
            was measured faster (see :data:`CUBLAS`); off by default so this function is
            always the Triton kernel.

    Example:
        >>> a = torch.randn(8192, 4096, device="cuda").to(torch.float8_e4m3fn)
        >>> b = torch.randn(4096, 4096, device="cuda").to(torch.float8_e4m3fn)
        >>> one = torch.ones((), device="cuda")
        >>> mm(a, b, one, one, use_fast_accum=True).shape
        torch.Size([8192, 4096])
    """
    check_inputs(a, b, a_inv, b_inv, bias, out_dtype)
    M, K = a.shape
    N = b.shape[0]
    if M == 0 or N == 0 or K == 0:  # empty output, or an empty reduction (only bias survives)
        out = torch.zeros((M, N), dtype=torch.float32, device=a.device)
        return (out + bias.float() if bias is not None else out).to(out_dtype)
    a_inv = a_inv.reshape(()).float()
    b_inv = b_inv.reshape(()).float()
    bias = bias.contiguous() if bias is not None else None
    use_tma = not force_pointer and _tma_ok(a, b, out_dtype)
    launch = launcher(a, b, a_inv, b_inv, bias, out_dtype, use_fast_accum, use_tma)
    if interpreting():
        return launch(_INTERP_CONFIG)
    key, cands = candidates(a, b, bias, out_dtype, use_fast_accum, use_tma, allow_cublas)
    cfg = _CACHE.pick(key, cands, launch)
    if cfg == CUBLAS and not use_fast_accum:
        _log_cublas_promoted()
    return launch(cfg)


def candidates(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor],
               out_dtype: torch.dtype, use_fast_accum: bool, use_tma: bool,
               allow_cublas: bool, device_index: Optional[int] = None) -> tuple[tuple, list]:
    """The config-cache key of this GEMM and the configs timed for it (shapes and dtypes only:
    also called on the fake or meta operands of a compiled graph, :mod:`.gemm_direct`, which
    pass the CUDA ``device_index`` a meta tensor lacks)."""
    (M, K), N = a.shape, b.shape[0]
    cands: list = list(FAST_CONFIGS if use_fast_accum else PRECISE_CONFIGS)
    if not use_tma:
        cands = [c for c in cands if not c.lagged]
    if allow_cublas and _cublas_ok(a, b, bias, out_dtype):
        cands.append(CUBLAS)
    key = (use_tma, bucket(M), N, K, a.dtype, b.dtype, out_dtype, use_fast_accum,
           bias is not None, allow_cublas,
           a.device.index if device_index is None else device_index)
    return key, cands


def decide(key: tuple, cands: list, launch_on_standins, use_fast_accum: bool) -> object:
    """The cached config for ``key`` (from :func:`candidates`, whose ``use_fast_accum`` is the
    one given here); on a miss ``launch_on_standins()`` gives a launcher over real operands of
    the same layout, which the cache times (:mod:`.gemm_direct`)."""
    cfg = _CACHE.best.get(key)
    if cfg is None:
        cfg = _CACHE.pick(key, cands, launch_on_standins())
    if cfg == CUBLAS and not use_fast_accum:
        _log_cublas_promoted()
    return cfg


def kernel_meta(cfg: GemmConfig, sms: int, has_bias: bool, out_dtype: torch.dtype, fast: bool,
                use_tma: bool) -> dict:
    """The Triton launch arguments (constexprs, stages, warps) of ``cfg``."""
    promote = None if fast else min(cfg.promote, cfg.block_k)
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m, NUM_SMS=sms, HAS_BIAS=has_bias, SUBTILE=cfg.subtile,
                PROMOTE=promote, OUT_DTYPE=_TL_OUT[out_dtype],
                LAGGED=bool(cfg.lagged and not fast and use_tma), num_stages=cfg.stages,
                num_warps=cfg.warps)


def _log_cublas_promoted() -> None:
    _state.log_once(
        logging.getLogger("fp8boost.fp8.kernels"), "gemm-promoted-on-cublas",
        "fp8boost: promoted-accumulation FP8 GEMMs (dgrad, wgrad) run on cuBLAS "
        "torch._scaled_mm where it timed faster than the Triton kernel (which measured "
        "0.69-0.77x of it on H100/H200: BENCHMARKS.md section 1); fast-accumulation GEMMs "
        "(fprop) stay on Triton", level=logging.INFO)


def _cublas_ok(a, b, bias, out_dtype) -> bool:
    """Shapes/dtypes ``torch._scaled_mm`` takes as they are (no padding copies)."""
    (m, k), n = a.shape, b.shape[0]
    return (m % 16 == 0 and n % 16 == 0 and k % 16 == 0 and a.is_contiguous()
            and b.is_contiguous() and not (a.dtype == b.dtype == torch.float8_e5m2)
            and (bias is None or (out_dtype == torch.bfloat16 and bias.dtype == out_dtype)))


def launcher(a, b, a_inv, b_inv, bias, out_dtype, fast, use_tma):
    """A closure that runs the GEMM with a given config and returns the output."""
    M, K = a.shape
    N = b.shape[0]
    sms = num_sms(a.device)
    bias_arg = bias if bias is not None else a_inv  # never read when HAS_BIAS=False

    def launch(cfg) -> torch.Tensor:
        if cfg == CUBLAS:
            return torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv, bias=bias,
                                    out_dtype=out_dtype, use_fast_accum=fast)
        out = torch.empty((M, N), dtype=out_dtype, device=a.device)
        tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
        grid = (min(sms, tiles),)
        meta = kernel_meta(cfg, sms, bias is not None, out_dtype, fast, use_tma)
        if use_tma:
            bn_c = cfg.block_n // 2 if cfg.subtile else cfg.block_n
            a_d = TensorDescriptor(a, [M, K], [a.stride(0), 1], [cfg.block_m, cfg.block_k])
            b_d = TensorDescriptor(b, [N, K], [b.stride(0), 1], [cfg.block_n, cfg.block_k])
            c_d = TensorDescriptor(out, [M, N], [N, 1], [cfg.block_m, bn_c])
            _gemm_tma_kernel[grid](a_d, b_d, c_d, a_inv, b_inv, bias_arg, M, N, K, **meta)
        else:
            _gemm_ptr_kernel[grid](a, b, out, a_inv, b_inv, bias_arg, M, N, K, a.stride(0),
                                   a.stride(1), b.stride(0), b.stride(1), out.stride(0),
                                   out.stride(1), **meta)
        return out

    return launch


def tuned_configs() -> dict:
    """The configs chosen so far and their timings (for benchmarks' JSON)."""
    return {str(k): {"best": _CACHE.best.get(k), "timings_ms": v}
            for k, v in _CACHE.timings.items()}
