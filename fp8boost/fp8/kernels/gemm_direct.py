"""The FP8 GEMM of compiled graphs, its kernel chosen at trace time.

Why: a compiled graph that calls :func:`ops.scaled_mm` (a Python custom op) pays the
dispatcher, :func:`gemm.mm`'s checks, the config-cache lookup, three descriptor objects and
Triton's Python launcher on every call: 113-140 us of CPU per GEMM on an H200, against 19 us
for ``torch._scaled_mm`` (``bench/gemm_overhead.py``, 2026-11-29). Where the CPU sets the pace
(FSDP/Gemini with 32 layers on 4 GPUs: BENCHMARKS.md, "4 GPUs") that is the step's time.

Here the choice of kernel is made once, when the graph is traced: the shape's tuned config
(timed then, on stand-in operands of the same shape, if no earlier call or decisions file has
it). :func:`compiled_mm` (what :class:`TritonBackend` calls under dynamo) asks :func:`_plan`,
a constant of dynamo's trace, for it:

* the Triton TMA kernel won: dynamo traces the kernel's launch itself (:func:`_launch_tma`),
  and inductor launches it from its wrapper (45 us of CPU per GEMM, promoted; 24 with fast
  accumulation);
* cuBLAS won (most promoted-accumulation GEMMs: dgrad, wgrad): :func:`scaled_mm_direct` holds
  ``aten._scaled_mm``, which inductor calls from its wrapper as torchao's graphs do;
* symbolic sizes, empty GEMMs, the pointer kernel: :func:`scaled_mm_direct` holds
  :func:`ops.scaled_mm`, which dispatches at run time (the decision, if any, is in the cache).

(``wrap_triton`` inside a ``triton_op``, the documented way, fails on torch 2.11 with the
kernel's host-side TMA descriptors; tracing the launch with dynamo works.)

Where :func:`scaled_mm_direct` decides (cuBLAS or the run-time op), the decision is not an
argument of the op in dynamo's graph, so inductor's caches (AOT and FX graph, in memory and on
disk) keep the kernel that the first trace of a graph chose. Both kernels compute the same GEMM;
a decisions file re-tuned to another kernel takes effect once those caches miss
(``torch._inductor.config.force_disable_caches``).

Every device other than CUDA gets :func:`ops.scaled_mm`'s reference arithmetic, traced as plain
torch ops. Eager calls do not come here (:class:`TritonBackend` calls :func:`gemm.mm`).

Example:
    >>> import torch
    >>> from fp8boost.fp8.kernels.gemm_direct import scaled_mm_direct
    >>> a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    >>> b = torch.randn(8, 32).to(torch.float8_e4m3fn)
    >>> one = torch.ones(())
    >>> scaled_mm_direct(a, b, one, one, None, torch.bfloat16, True, False).shape
    torch.Size([16, 8])
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import has_static_value
from torch.library import triton_op
from torch.utils._python_dispatch import _disable_current_modes

from fp8boost import _state
from .ops import reference_scaled_mm  # also registers fp8boost::scaled_mm


def static_shapes(*tensors: Optional[Tensor]) -> bool:
    """Whether every size and stride is a plain int (a symbolic one cannot key the tuner).

    Right both where it runs: in a ``triton_op``'s body (traced by make_fx) a symbolic size is
    a ``torch.SymInt``; while dynamo traces (:func:`compiled_mm`) ``type()`` of a symbolic size
    answers ``int``, and ``has_static_value`` (which dynamo evaluates on the symbol) tells.
    """
    return all(t is None or all(type(d) is int and has_static_value(d)
                                for d in (*t.shape, *t.stride())) for t in tensors)


@triton_op("fp8boost::scaled_mm_direct", mutates_args=())
def scaled_mm_direct(a: Tensor, b: Tensor, a_inv_scale: Tensor, b_inv_scale: Tensor,
                     bias: Optional[Tensor], out_dtype: torch.dtype, use_fast_accum: bool,
                     allow_cublas: bool) -> Tensor:
    """``(a @ b.T) * a_inv * b_inv (+ bias)``, the kernel chosen at trace time (CUDA)."""
    static = static_shapes(a, b, bias)
    if static:
        if a.device.type != "cuda":
            return reference_scaled_mm(a, b, a_inv_scale, b_inv_scale, bias, out_dtype)
        from . import gemm  # lazy: imports triton (absent from some CPU installs)

        gemm.check_inputs(a, b, a_inv_scale, b_inv_scale, bias, out_dtype)
        if a.numel() and b.numel():  # an empty GEMM has no kernel to choose
            bias = bias.contiguous() if bias is not None else None
            use_tma = gemm.tma_layout_ok(a, b, out_dtype)
            key, cands = gemm.candidates(a, b, bias, out_dtype, use_fast_accum, use_tma,
                                         allow_cublas)
            cfg = gemm.decide(key, cands, lambda: _standin_launcher(a, b, bias, out_dtype,
                                                                    use_fast_accum, use_tma),
                              use_fast_accum)
            if cfg == gemm.CUBLAS:
                return torch._scaled_mm(a, b.t(), scale_a=a_inv_scale.reshape(()).float(),
                                        scale_b=b_inv_scale.reshape(()).float(), bias=bias,
                                        out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    # The graph records the op that dispatches at run time (gemm.mm) for: a symbolic size (it
    # cannot key the tuner), an empty GEMM (gemm.mm's zeros or bias), and a Triton kernel that
    # compiled_mm does not launch itself (the pointer kernel, or a caller other than
    # compiled_mm): torch 2.11's triton_op tracing cannot take the TMA kernel's host-side
    # descriptors (KeyError in identify_mutated_tensors, then fake tensors in inductor's cache
    # key: measured on the H200, 2026-11-29). The op finds the decision made here in the config
    # cache, so it does not tune again.
    if not static:
        _state.log_once(
            logging.getLogger("fp8boost.fp8.kernels"), "gemm-compiled-symbolic",
            "fp8boost: a compiled FP8 GEMM has symbolic sizes, so its kernel is chosen at run "
            "time (fp8boost::scaled_mm, about 100 us of CPU per call on an H200 against about "
            "30 when chosen at trace time); compile with static shapes "
            "(torch.compile(dynamic=False)) where the CPU sets the pace", level=logging.INFO)
    return torch.ops.fp8boost.scaled_mm(a, b, a_inv_scale, b_inv_scale, bias, out_dtype,
                                        use_fast_accum, allow_cublas)


def compiled_mm(a: Tensor, b: Tensor, a_inv_scale: Tensor, b_inv_scale: Tensor,
                bias: Optional[Tensor], out_dtype: torch.dtype, use_fast_accum: bool,
                allow_cublas: bool) -> Tensor:
    """The GEMM as ``TritonBackend.mm`` runs it while dynamo traces (``torch.compile``).

    Where the shape's tuned kernel is the Triton TMA kernel, dynamo traces its launch itself
    (config fixed by :func:`_plan`, a constant of the trace), so inductor launches it from its
    wrapper; everything else (cuBLAS, the pointer kernel, symbolic or empty shapes, other
    devices) goes through :func:`scaled_mm_direct`.
    """
    if a.device.type == "cuda" and static_shapes(a, b, bias) and min(*a.shape, b.shape[0]) > 0:
        # No storage offsets: dynamo cannot trace storage_offset() (torch 2.11). The plan
        # assumes 16-byte aligned bases, as every allocation is; an operand that is a view at
        # an unaligned offset fails at the launch with Triton's "base must be 16-byte aligned".
        plan = _plan(tuple(a.shape), tuple(a.stride()), tuple(b.shape), tuple(b.stride()),
                     a.dtype, b.dtype, out_dtype, bias is not None, bool(use_fast_accum),
                     bool(allow_cublas), a.device.index)
        if plan[0] == "tma":
            return _launch_tma(a, b, a_inv_scale, b_inv_scale, bias, out_dtype,
                               bool(use_fast_accum), plan)
    return scaled_mm_direct(a, b, a_inv_scale, b_inv_scale, bias, out_dtype,
                            bool(use_fast_accum), bool(allow_cublas))


def _launch_tma(a, b, a_inv_scale, b_inv_scale, bias, out_dtype, fast, plan) -> Tensor:
    """The Triton TMA kernel with ``plan``'s config, written so that dynamo can trace it."""
    from . import gemm  # lazy: imports triton (absent from some CPU installs)

    _, sms, *fields = plan
    cfg = gemm.GemmConfig(*fields)
    M, K = a.shape
    N = b.shape[0]
    a_inv = a_inv_scale.reshape(()).float()
    b_inv = b_inv_scale.reshape(()).float()
    bias = bias.contiguous() if bias is not None else None
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    meta = gemm.kernel_meta(cfg, sms, bias is not None, out_dtype, fast, True)
    bn_c = cfg.block_n // 2 if cfg.subtile else cfg.block_n
    desc = gemm.TensorDescriptor.from_tensor
    grid = (min(sms, -(-M // cfg.block_m) * -(-N // cfg.block_n)),)
    gemm.TMA_KERNEL[grid](desc(a, [cfg.block_m, cfg.block_k]),
                          desc(b, [cfg.block_n, cfg.block_k]), desc(out, [cfg.block_m, bn_c]),
                          a_inv, b_inv, bias if bias is not None else a_inv, M, N, K, **meta)
    return out


@torch._dynamo.assume_constant_result
def _plan(a_shape: tuple, a_stride: tuple, b_shape: tuple, b_stride: tuple,
          a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype, has_bias: bool,
          fast: bool, allow_cublas: bool, device_index: int) -> tuple:
    """The tuned kernel of a GEMM, from its layout alone: ``("tma", sms, *GemmConfig)`` or
    ``("other",)``. Run at trace time (dynamo calls it and keeps the result as a constant);
    tunes on stand-ins if nothing is cached, like :func:`scaled_mm_direct`."""
    from . import gemm  # lazy: imports triton (absent from some CPU installs)

    def meta(shape, stride, dtype):  # layout only: no memory
        return torch.empty(0, dtype=dtype, device="meta").as_strided(shape, stride)

    a, b = meta(a_shape, a_stride, a_dtype), meta(b_shape, b_stride, b_dtype)
    bias = torch.empty(b_shape[0], dtype=out_dtype, device="meta") if has_bias else None
    use_tma = gemm.tma_layout_ok(a, b, out_dtype)
    key, cands = gemm.candidates(a, b, bias, out_dtype, fast, use_tma, allow_cublas,
                                 device_index)
    dev = torch.device("cuda", device_index)
    cfg = gemm.decide(key, cands, lambda: _standin_launcher(a, b, bias, out_dtype, fast, use_tma,
                                                            dev), fast)
    if cfg == gemm.CUBLAS or not use_tma:
        return ("other",)
    return ("tma", gemm.num_sms(dev), *cfg)


def _standin_launcher(a: Tensor, b: Tensor, bias: Optional[Tensor], out_dtype: torch.dtype,
                      fast: bool, use_tma: bool, device: Optional[torch.device] = None):
    """A launcher over real random operands laid out like ``a``/``b``, for the tuner.

    At trace time ``a``/``b`` are fake (no memory); the tuner must time real kernels, so it
    times them on stand-ins, outside every tracing mode (fake, functional, proxy).
    """
    from . import gemm  # lazy: imports triton (absent from some CPU installs)

    dev = device if device is not None else a.device
    with _disable_current_modes(), torch.no_grad():
        def like(t: Tensor) -> Tensor:
            real = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                       device=dev)
            return real.copy_(torch.randn(tuple(t.shape), device=dev).to(t.dtype))

        ra, rb = like(a), like(b)
        one = torch.ones((), device=dev)
        rbias = torch.randn(tuple(bias.shape), device=dev).to(bias.dtype) \
            if bias is not None else None
        run = gemm.launcher(ra, rb, one, one, rbias, out_dtype, fast, use_tma)

    def launch(cfg):
        with _disable_current_modes(), torch.no_grad():
            return run(cfg)

    return launch
