"""Once-per-shape config selection shared by the cast and GEMM kernels.

Triton's own ``@triton.autotune`` re-derives its key and runs hooks on every call, cannot bucket
M (ragged token counts would each re-tune), and fails with more than one config under the
interpreter. This module keeps a plain dict ``key -> best config``: the first call with a new
key times every candidate (median of several runs, ``triton.testing.do_bench``) and caches the
winner; every later call is one dict lookup.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Hashable, Sequence

import torch

_LOCK = threading.Lock()
_SM_COUNT: dict[int, int] = {}
_AUTOTUNE = [True]


def set_autotune(enabled: bool) -> None:
    """Turn timing of candidate configs on (default) or off (first candidate; tests use this).

    Example:
        >>> set_autotune(False); set_autotune(True)
    """
    _AUTOTUNE[0] = bool(enabled)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    Read at call time, never at import time.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device (cached); a small constant on CPU/interpreter."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def bucket(n: int) -> int:
    """Power-of-two bucket of a size (ragged M of 8190 and 8192 share one tuned config)."""
    return 1 << max(int(n) - 1, 0).bit_length()


class ConfigCache:
    """``key -> best config`` with lazy benchmarking of candidates on first use.

    Example:
        >>> cache = ConfigCache("demo")
        >>> cache.pick(("k",), [1, 2], lambda cfg: None, bench=False)
        1
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.best: dict[Hashable, Any] = {}
        self.timings: dict[Hashable, list[tuple[Any, float]]] = {}

    def pick(self, key: Hashable, candidates: Sequence[Any], run: Callable[[Any], None],
             bench: bool = True) -> Any:
        """Return the cached best config for ``key``, timing ``run(cfg)`` for each candidate once.

        Candidates that fail to compile or launch (e.g. too much shared memory on a smaller GPU)
        are skipped; if all fail, the last error is raised. With ``bench=False`` (interpreter,
        or a single candidate) the first candidate is taken untimed.
        """
        best = self.best.get(key)
        if best is not None:
            return best
        with _LOCK:
            if key in self.best:
                return self.best[key]
            if not bench or not _AUTOTUNE[0] or len(candidates) == 1:
                self.best[key] = candidates[0]
                return candidates[0]
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                # Timing inside a CUDA-graph capture is impossible: use the first candidate for
                # this call without caching it, so an eager call later still tunes.
                return candidates[0]
            self.best[key] = self._tune(key, candidates, run)
            return self.best[key]

    def _tune(self, key: Hashable, candidates: Sequence[Any], run: Callable[[Any], None]) -> Any:
        import triton.testing  # lazy: only on a GPU, only on first use of a shape

        results: list[tuple[Any, float]] = []
        last_exc: Exception | None = None
        for cfg in candidates:
            try:
                run(cfg)  # compile + first launch outside the timed region
                ms = triton.testing.do_bench(lambda: run(cfg), warmup=10, rep=80,
                                             return_mode="median")
            except Exception as exc:  # noqa: BLE001 (e.g. OutOfResources for this config)
                last_exc = exc
                continue
            results.append((cfg, ms))
        if not results:
            raise RuntimeError(f"fp8boost {self.name}: no kernel config ran for {key}") from last_exc
        self.timings[key] = results
        best, ms = min(results, key=lambda r: r[1])
        # Visible, never silent: which kernel won this shape (e.g. cuBLAS for promoted GEMMs).
        logging.getLogger("fp8boost.fp8.kernels").info(
            "fp8boost %s: %s picked for %s (%.3f ms of %d candidates)", self.name, best, key, ms,
            len(results))
        return best
