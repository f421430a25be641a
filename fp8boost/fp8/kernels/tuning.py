"""Once-per-shape config selection shared by the cast and GEMM kernels, cached on disk.

Triton's own ``@triton.autotune`` re-derives its key and runs hooks on every call, cannot bucket
M (ragged token counts would each re-tune), and fails with more than one config under the
interpreter. This module keeps a plain dict ``key -> best config``: the first call with a new
key times every candidate (median of several runs, ``triton.testing.do_bench``) and caches the
winner; every later call is one dict lookup.

Decisions also persist, so a later process on the same machine skips the timing (it made a
training run's first steps take 15-32 s on an H100): one JSON file per cache name, GPU model
with SM count, torch and Triton version, in ``$FP8BOOST_CACHE_DIR`` (default
``$XDG_CACHE_HOME/fp8boost`` or ``~/.cache/fp8boost``); ``FP8BOOST_AUTOTUNE_CACHE=0`` (``off``,
``false``) keeps decisions in memory only. ``autotune-gemm-<device>-torch<v>-triton<v>.json``::

    {"format": 1, "entries": {
        "(True, 8192, 4096, 4096, torch.float8_e4m3fn, ..., 0)":
            {"type": "GemmConfig", "fields": [128, 256, 128, 8, 3, 8, true, false]},
        "(False, 8192, ...)": "cublas"}}

A stored config is used only if it is one of the candidates offered to that ``pick`` call (a
stale or foreign entry can never select a kernel that is not offered); else the key is re-timed.

On a cold cache each rank tunes its own keys (they hold its device index), so ranks may use
different GEMM configs for one shape. The accumulation mode is part of the key, so these differ
only in the order of FP32 additions (block sizes, lagged variant, cuBLAS): close, not
bit-identical across ranks. Cast and amax kernels give the same bits under every config.
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

import torch

from ... import _state
from ..._state import log_once

# Guards the caches' dicts and files, never held while timing: a tuning run may itself tune,
# on this thread or on another one (the experts' precision choice times FP8 experts whose
# first call tunes the cast kernels, and their backward runs on autograd's device thread).
# Held across the timing, a plain Lock deadlocked the first case and an RLock the second (both
# on the GPU, issue 34).
_LOCK = threading.RLock()
_AUTOTUNE = "fp8.kernels.autotune"  # the _state setting
_LOG = logging.getLogger("fp8boost.fp8.kernels")
_FORMAT = 1
# do_bench's warmup/rep are milliseconds of running, not iteration counts. 25 ms still times a
# 1 ms GEMM ~20 times (each after an L2 flush; a 50 us cast hundreds of times): a median stable
# enough to rank candidates some % apart. The former 10 + 80 ms made each candidate cost 3x more.
BENCH_WARMUP_MS = 5
BENCH_REP_MS = 25


def set_autotune(enabled: bool) -> None:
    """Turn timing of candidate configs on (default) or off (first candidate; tests use this).

    Example:
        >>> set_autotune(False); set_autotune(True)
    """
    _state.set_setting(_AUTOTUNE, bool(enabled))


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
    return _state.probe(("cuda-sm-count", idx),
                        lambda: torch.cuda.get_device_properties(idx).multi_processor_count)


def bucket(n: int) -> int:
    """Power-of-two bucket of a size (ragged M of 8190 and 8192 share one tuned config)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def _device_identity(index: Optional[int]) -> str:
    """GPU model and SM count (an H100 PCIe and SXM differ in SMs), or "cpu" without CUDA."""
    if not torch.cuda.is_available():
        return "cpu"
    if index is None or not 0 <= index < torch.cuda.device_count():
        index = torch.cuda.current_device()
    sms = num_sms(torch.device("cuda", index))
    return f"{torch.cuda.get_device_name(index)}-{sms}sm"


def _cache_dir() -> Optional[Path]:
    """The decisions folder; None when the disk cache is off or Triton is interpreting."""
    if os.environ.get("FP8BOOST_AUTOTUNE_CACHE", "1").strip().lower() in (
            "0", "off", "false", "no") or interpreting():
        return None  # (the interpreter takes the first config: nothing to tune or keep)
    root = os.environ.get("FP8BOOST_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fp8boost"


def autotune_cache_path(name: str, device_index: Optional[int] = None) -> Optional[Path]:
    """The decisions file of cache ``name`` on this machine; None when the disk cache is off.

    Args:
        name: the :class:`ConfigCache` name ("gemm", "cast", "amax").
        device_index: CUDA device whose model names the file (default: the current device).
    """
    root = _cache_dir()
    if root is None:
        return None
    import triton  # the kernels that tune need it anyway

    ident = (f"{name}-{_device_identity(device_index)}-torch{torch.__version__}"
             f"-triton{triton.__version__}")
    return root / f"autotune-{re.sub(r'[^A-Za-z0-9._-]+', '_', ident)}.json"


def clear_autotune_cache(disk: bool = True) -> int:
    """Forget every tuning decision of this process and (``disk``) delete the decision files.

    For tests and benchmarks of a cold start. Deletes the ``autotune-*.json`` files of the
    cache folder (every device and version); returns how many.
    """
    with _LOCK:
        for cache in _state.tracked(ConfigCache):
            cache.clear()
    root = _cache_dir() if disk else None
    files = list(root.glob("autotune-*.json")) if root is not None and root.is_dir() else []
    for f in files:
        f.unlink(missing_ok=True)
    return len(files)


def _encode(cfg: Any) -> Any:
    """JSON form of a config (a NamedTuple or tuple as {"type", "fields"}); None if it has none.

    Stored and offered configs are compared in this form: a NamedTuple equals a plain tuple of
    the same fields, but one kernel's entry must never select another kernel's config.
    """
    obj = {"type": type(cfg).__name__, "fields": list(cfg)} if isinstance(cfg, tuple) else cfg
    try:
        return json.loads(json.dumps(obj))  # as read back from the file (tuples become lists)
    except (TypeError, ValueError):
        return None


def _key_text(key: Hashable) -> str:
    """A key as stored: its repr, stable for ints, bools, None and dtypes ("torch.bfloat16")."""
    return repr(key)


def _time_ms(fn: Callable[[], Any]) -> float:
    """Median run time of ``fn`` in ms (tests replace this to "time" on CPU)."""
    import triton.testing  # lazy: only on a GPU, only on first use of a shape

    return triton.testing.do_bench(fn, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS,
                                   return_mode="median")


# _time_device_ms: runs per round, rounds (median), and the GPU sleep (cycles, ~10 ms on a
# Hopper) that the host queues a round's launches behind.
DEVICE_TIME_RUNS = 10
DEVICE_TIME_ROUNDS = 5
DEVICE_TIME_SLEEP_CYCLES = 20_000_000


def _time_device_ms(fn: Callable[[], Any]) -> float:
    """Median GPU time of one ``fn()`` in ms, its launches queued behind a GPU sleep so that the
    host's launch cost is not in it (``_time_ms`` counts it whenever the GPU waits for the host:
    a candidate of four small launches then loses to one of a single launch that the GPU runs
    slower). Right for work that a training step queues ahead of the GPU."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(DEVICE_TIME_ROUNDS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(DEVICE_TIME_SLEEP_CYCLES)
        start.record()
        for _ in range(DEVICE_TIME_RUNS):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / DEVICE_TIME_RUNS)
    return sorted(times)[len(times) // 2]


class ConfigCache:
    """``key -> best config`` with lazy benchmarking of candidates on first use.

    Keys are tuples of ints, bools, dtypes and, last, the CUDA device index (the device whose
    model names the decisions file). Configs are NamedTuples, tuples of plain values, or strings.

    Example:
        >>> cache = ConfigCache("demo")
        >>> cache.pick(("k",), [1, 2], lambda cfg: None, bench=False)
        1
    """

    def __init__(self, name: str, device_time: bool = False) -> None:
        self.name = name
        # Time candidates by GPU time alone (_time_device_ms), not by do_bench's wall time.
        self.device_time = device_time
        self.best: dict[Hashable, Any] = {}
        self.timings: dict[Hashable, list[tuple[Any, float]]] = {}
        self._disk: dict[Path, dict[str, Any]] = {}  # file -> its entries, read on first use
        # Decisions are process-wide state: fp8boost._state.reset() (and
        # clear_autotune_cache) clear every live cache through this registration.
        _state.track(self)

    def clear(self) -> None:
        """Forget every decision and file entry held in memory (the files stay)."""
        self.best.clear()
        self.timings.clear()
        self._disk.clear()

    def pick(self, key: Hashable, candidates: Sequence[Any], run: Callable[[Any], None],
             bench: bool = True, handicap: Optional[Mapping[Any, float]] = None) -> Any:
        """Return the cached best config for ``key``, timing ``run(cfg)`` for each candidate once.

        A decision stored on disk by an earlier process is reused if it is among
        ``candidates``. Candidates that fail to compile or launch (e.g. too much shared memory
        on a smaller GPU) are skipped; if all fail, the last error is raised. With
        ``bench=False`` (interpreter, or a single candidate) the first candidate is taken
        untimed and the disk is not touched. ``handicap``: a factor per candidate that its
        time is multiplied by when ranking (``{"fp8": 1.05}``: it must be 5% faster to win);
        :attr:`timings` keeps the measured times.
        """
        best = self.best.get(key)
        if best is not None:
            return best
        with _LOCK:
            if key in self.best:
                return self.best[key]
            if not bench or not _state.setting(_AUTOTUNE) or len(candidates) == 1:
                self.best[key] = candidates[0]
                return candidates[0]
            dev = key[-1] if isinstance(key, tuple) and key else None
            path = autotune_cache_path(self.name, dev if type(dev) is int else None)
            best = self._load(path, key, candidates) if path is not None else None
            if best is not None:  # file reads are fine during a CUDA-graph capture
                _LOG.info("fp8boost %s: %s loaded from %s for %s", self.name, best, path, key)
                self.best[key] = best
                return best
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Timing inside a CUDA-graph capture is impossible: use the first candidate for
            # this call without caching it, so an eager call later still tunes.
            return candidates[0]
        # Timed without the lock (see _LOCK). Two threads tuning one key both time it; the
        # first to finish decides, so every caller gets one decision.
        best = self._tune(key, candidates, run, handicap or {})
        with _LOCK:
            if key in self.best:
                return self.best[key]
            self.best[key] = best
            if path is not None:
                self._store(path, key, best)
            return best

    def _load(self, path: Path, key: Hashable, candidates: Sequence[Any]) -> Any:
        """The stored decision for ``key`` if it is one of ``candidates``, else None."""
        if path not in self._disk:
            self._disk[path] = _read_entries(path)
        stored = self._disk[path].get(_key_text(key))
        if stored is None:
            return None
        return next((c for c in candidates if _encode(c) == stored), None)

    def _store(self, path: Path, key: Hashable, cfg: Any) -> None:
        """Merge ``key -> cfg`` into the file, atomically (other ranks may write it too)."""
        entry = _encode(cfg)
        if entry is None:  # not JSON-serializable: keep it in memory only
            return
        self._disk.setdefault(path, {})[_key_text(key)] = entry
        try:
            # Re-read at write time so decisions other processes stored since are kept. Two
            # writers racing can still drop one's entry: that key is only timed again later.
            entries = {**_read_entries(path), _key_text(key): entry}
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": _FORMAT, "entries": entries}, f, indent=1,
                              sort_keys=True)
                os.replace(tmp, path)  # readers see the old or the new file, never half of one
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:  # e.g. a read-only home: the decisions stay in memory
            log_once(_LOG, ("autotune-cache-write", str(path)),
                     f"fp8boost: cannot write the autotune cache {path} ({exc}); tuning "
                     "decisions stay in memory", level=logging.INFO)

    def _tune(self, key: Hashable, candidates: Sequence[Any], run: Callable[[Any], None],
              handicap: Mapping[Any, float]) -> Any:
        results: list[tuple[Any, float]] = []
        last_exc: Exception | None = None
        for cfg in candidates:
            try:
                run(cfg)  # compile + first launch outside the timed region
                ms = (_time_device_ms if self.device_time else _time_ms)(lambda: run(cfg))
            except Exception as exc:  # noqa: BLE001 (e.g. OutOfResources for this config)
                last_exc = exc
                continue
            results.append((cfg, ms))
        if not results:
            raise RuntimeError(f"fp8boost {self.name}: no kernel config ran for {key}"
                               ) from last_exc
        self.timings[key] = results
        best, ms = min(results, key=lambda r: r[1] * handicap.get(r[0], 1.0))
        # Visible, never silent: which kernel won this shape (e.g. cuBLAS for promoted GEMMs).
        _LOG.info("fp8boost %s: %s tuned now for %s (%.3f ms of %d candidates)", self.name, best,
                  key, ms, len(results))
        return best


def _read_entries(path: Path) -> dict[str, Any]:
    """The entries of a decisions file; {} if it is missing, unreadable or of another format."""
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("format") == _FORMAT and isinstance(data.get("entries"), dict):
            return data["entries"]
        raise ValueError(f"format {data.get('format')!r}, expected {_FORMAT}")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, AttributeError) as exc:  # corrupt: ignore, it gets rewritten
        log_once(_LOG, ("autotune-cache-read", str(path)),
                 f"fp8boost: ignoring unreadable autotune cache {path} ({exc})",
                 level=logging.INFO)
        return {}
