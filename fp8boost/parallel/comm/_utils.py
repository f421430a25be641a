"""Shared plumbing of the FP8 collectives: the async handle, input checks, fallback planning.

Kept apart from :mod:`fp8boost.parallel.fp8_comm` (the public collectives) to keep both short.
Fallback messages go to the ``fp8boost.parallel.fp8_comm`` logger, once per (collective, reason).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from fp8boost import _state

from .config import Fp8CommConfig
from .wire import dequantize_rows, dequantize_sum_rows, quantize_rows, segment_bytes

logger = logging.getLogger("fp8boost.parallel.fp8_comm")

ReduceOpLike = Union[str, Any]  # "sum" | "avg" | torch.distributed.ReduceOp (SUM/AVG/PREMUL_SUM)


class Fp8Work:
    """Handle of an asynchronous FP8 collective (``async_op=True``).

    ``wait()`` waits for the communication, runs the dequantization (and any second phase,
    e.g. the all-gather of ``all_reduce_fp8``) and returns the result tensor (the output, or
    the tensor reduced in place). Calling it again returns the same tensor.

    Example:
        >>> work = all_gather_fp8(shard, async_op=True)   # doctest: +SKIP
        >>> full = work.wait()                             # doctest: +SKIP
    """

    def __init__(self, works: Sequence[Any] = (), finish: Optional[Callable[[], None]] = None,
                 result: Optional[torch.Tensor] = None, keep: tuple = ()) -> None:
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._result = result
        self._keep = keep  # buffers the communication reads or writes: alive until wait()
        self._done = False

    def wait(self, timeout=None) -> Optional[torch.Tensor]:
        """Finish communication and dequantization; return the result tensor."""
        if not self._done:
            if timeout is not None or self._finish is None:
                for work in self._works:
                    work.wait() if timeout is None else work.wait(timeout)
            if self._finish is not None:
                # finish() waits stage by stage itself, decoding stage k while k+1 transfers.
                self._finish()
            self._done = True
            self._works, self._finish, self._keep = [], None, ()
        return self._result

    def is_completed(self) -> bool:
        """True once ``wait()`` ran, or the communication is done (dequantization pending)."""
        return self._done or all(w.is_completed() for w in self._works)


def _log_once(op: str, reason: str, message: str, level: int = logging.WARNING) -> None:
    _state.log_once(logger, ("fp8_comm", op, reason), f"fp8boost {op}: {message}", level)


def resolve_config(config: Optional[Fp8CommConfig]) -> Fp8CommConfig:
    if config is None:
        # One shared default object (built on first use), as every call site passing None
        # would otherwise build and validate its own.
        return _state.probe("fp8-comm-default-config", Fp8CommConfig)
    if not isinstance(config, Fp8CommConfig):
        raise TypeError(f"config must be an Fp8CommConfig or None, got {type(config).__name__}")
    return config


def resolve_fp8_dtype(value: Optional[torch.dtype], default: torch.dtype) -> torch.dtype:
    if value is None:
        return default
    if value not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
                         f"got {value!r}")
    return value


def check_tensor(t: Any, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                   torch.float8_e5m2fnuz):
        raise TypeError(f"{name} is already {t.dtype}: FP8 collectives quantize high-precision "
                        "tensors; to move FP8 bytes as they are, use the plain collective on "
                        f"{name}.view(torch.uint8)")


def group_info(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("torch.distributed is not initialized: call "
                         "torch.distributed.init_process_group(...) before FP8 collectives")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return dist.get_world_size(group), rank


def plan_collective(op: str, tensors: Sequence[torch.Tensor], payload: Optional[int],
                    ws: Optional[int], cfg: Fp8CommConfig) -> str:
    """``local`` (world size 1), ``plain`` (high-precision collective) or ``fp8``."""
    if ws == 1:
        _log_once(op, "ws1", "world size 1: no communication, exact local result")
        return "local"
    if not cfg.enabled:
        _log_once(op, "disabled", "Fp8CommConfig.enabled=False: plain collective in the input "
                  "dtype", logging.INFO)
        return "plain"
    bad = [t.dtype for t in tensors if not t.is_floating_point()]
    if bad:
        _log_once(op, f"dtype-{bad[0]}", f"{bad[0]} is not a floating-point dtype: plain "
                  "collective, no FP8")
        return "plain"
    if payload is not None and payload < cfg.min_payload_numel:
        _log_once(op, "small", f"payloads below Fp8CommConfig.min_payload_numel="
                  f"{cfg.min_payload_numel} "
                  f"elements (here {payload}) use the plain collective in the input dtype: too "
                  "small for FP8 to pay off")
        return "plain"
    return "fp8"


def resolve_cast_impl(cfg: Fp8CommConfig, device: torch.device) -> str:
    """Resolve ``cfg.cast_impl`` for a device (read at call time, never at import).

    ``auto`` picks Triton on sm89+ GPUs only after a one-time self-test on that device (compile,
    then bytes equal to the torch reference); if it fails, the torch ops are used and the
    reason is logged once. An explicit ``triton`` is used as asked.

    The answer is kept per (setting, device, interpreter on or off): hot paths ask it once per
    weight per all-gather, and reading the device's capability each time cost ~20 us of CPU.
    """
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return _state.probe(("comm-cast-impl", cfg.cast_impl, device, interpreting),
                        lambda: _resolve_cast_impl(cfg.cast_impl, device, interpreting))


def _resolve_cast_impl(cast_impl: str, device: torch.device, interpreting: bool) -> str:
    fp8_gpu = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    if cast_impl == "torch":
        return "torch"
    if cast_impl == "triton":
        if fp8_gpu or (interpreting and device.type == "cpu"):
            return "triton"
        raise ValueError(f"Fp8CommConfig.cast_impl='triton' needs a CUDA GPU with FP8 support "
                         f"(sm89+), got {device}; use cast_impl='torch' or 'auto'")
    if not fp8_gpu:
        return "torch"
    return "triton" if _triton_usable(device) else "torch"


def _triton_usable(device: torch.device) -> bool:
    def check() -> bool:
        try:
            ok, why = triton_selftest(device)
        except Exception as exc:  # noqa: BLE001 - import and compile errors have many types
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            _log_once("cast", "triton-broken", f"Triton FP8 casts unusable on {device} ({why}); "
                      "using the slower torch ops")
        return ok
    return bool(_state.probe(f"comm-triton-casts-{device}", check))


def triton_selftest(device: torch.device) -> tuple[bool, str]:
    """Run the Triton casts on small random data; compare with the torch reference.

    Returns ``(ok, reason)``. Casts (bytes and trailers: the fused amax + scale + cast path)
    and decodes must be bit-identical; the FP32 sums may differ by FMA contraction only.
    """
    from . import wire_triton as fp8_wire_triton  # noqa: F401,WPS433 (lazy: imports triton)

    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 100, generator=g) * torch.tensor([[1e-3], [1.0], [300.0]])
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        for dtype in (torch.bfloat16, torch.float32):
            x = base.to(device=device, dtype=dtype)
            res = {}
            for impl in ("triton", "torch"):
                packed = torch.zeros((3, segment_bytes(100)), dtype=torch.uint8, device=device)
                quantize_rows(x, packed, fp8, power_of_2=True, impl=impl)
                out = torch.empty((3, 100), dtype=dtype, device=device)
                dequantize_rows(packed, 100, fp8, out, power_of_2=True, impl=impl)
                acc = torch.empty(100, dtype=dtype, device=device)
                dequantize_sum_rows(packed[1:], 100, fp8, acc, local=x[0], post_scale=0.5,
                                    impl=impl)
                res[impl] = (packed, out, acc)  # data and the inverse-scale trailers
            (pt, ot, st), (pr, orf, sr) = res["triton"], res["torch"]
            if not torch.equal(pt, pr):
                return False, f"{fp8} cast of {dtype} differs from torch"
            if not torch.equal(ot, orf):
                return False, f"{fp8} decode to {dtype} differs from torch"
            if not torch.allclose(st.float(), sr.float(), rtol=2.0**-7, atol=0.0):
                return False, f"{fp8} dequant-sum to {dtype} differs from torch"
    return True, ""


def post_scale(op: ReduceOpLike, ws: int) -> float:
    """Factor applied to the sum: 1 (sum), 1/ws (avg) or a PREMUL_SUM factor (FSDP2)."""
    if isinstance(op, str):
        if op in ("sum", "avg"):
            return 1.0 if op == "sum" else 1.0 / ws
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.AVG:
        return 1.0 / ws
    if kind == dist.ReduceOp.PREMUL_SUM and getattr(op, "factor", None) is not None:
        factor = op.factor
        return float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    raise ValueError(f"unsupported reduce op {op!r}: use 'sum', 'avg', ReduceOp.SUM, "
                     "ReduceOp.AVG or a PREMUL_SUM op with a factor")


def _check_same_device(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.device != b.device:
        raise ValueError(f"input and output must be on one device, got {a.device} and "
                         f"{b.device}")


def check_pair(output: torch.Tensor, input: torch.Tensor, group) -> tuple[int, int]:
    """Validate an (output, input) collective pair; return the group's (world size, rank)."""
    check_tensor(output, "output")
    check_tensor(input, "input")
    _check_same_device(input, output)
    return group_info(group)


def staging(output: torch.Tensor, shape: tuple, dtype: Optional[torch.dtype] = None):
    """A contiguous ``shape`` view to write into, and a commit() copying it into ``output``."""
    dtype = dtype or output.dtype
    if output.is_contiguous() and output.dtype == dtype:
        return output.view(shape), (lambda: None)
    tmp = torch.empty(shape, dtype=dtype, device=output.device)
    return tmp, (lambda: output.copy_(tmp.view(output.shape)))


def complete(works, finish: Callable[[], None], async_op: bool, result=None, keep=()):
    """Return an :class:`Fp8Work` (async) or run ``finish`` now (sync).

    ``finish`` must wait for ``works`` itself (stage by stage where pipelined; wrap it with
    :func:`waiting` otherwise); ``works`` serve ``is_completed()`` and ``wait(timeout)``.
    """
    works = [w for w in (works if isinstance(works, (list, tuple)) else [works])
             if w is not None and hasattr(w, "wait")]
    if async_op:
        return Fp8Work(works, finish, result, keep)
    finish()
    return None


def waiting(works, finish: Optional[Callable[[], None]] = None) -> Callable[[], None]:
    """A finish() that first waits for ``works`` (for single-stage collectives)."""
    def run() -> None:
        for w in works if isinstance(works, (list, tuple)) else [works]:
            if w is not None and hasattr(w, "wait"):
                w.wait()
        if finish is not None:
            finish()
    return run


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    """The plain all-gather into one tensor, under its name in this torch version."""
    # torch >= 2.13 renamed all_gather_into_tensor (which now warns) to all_gather_single.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    """The plain (SUM) reduce-scatter of one tensor, under its name in this torch version."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
