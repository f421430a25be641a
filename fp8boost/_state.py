"""Process-wide state of fp8boost, in one place: no other module keeps a mutable
module-level container (``tests/test_state.py`` checks this).

Everything here lives for the life of the process and is created lazily (nothing runs at
import time):

* warn-once keys (``warn_once``) and log-once keys (``log_once``): each fallback or notice is
  reported once per job and reason: once per process, and in a multi-process job by rank 0
  only (the conditions they report are the same on every rank: same machine type, model and
  options), unless the caller says ``all_ranks=True``;
* probes (``probe``): values computed once per key: device capability checks (FP8 tensor
  cores, Triton self-tests), per-device facts (SM counts), objects built on first use (the
  default ``Fp8CommConfig``, Triton kernels);
* named caches (``cache``): dicts owned here, used by one module each: ``"fp8.backends"``
  (backend name -> backend instance), ``"fp8.shared_cast"`` (the last shared input cast),
  ``"zero.fused_step.steps"`` (each master's step count as a float),
  ``"colossal-fp8-ddp-hook-states"`` (``fp8boost.colossal.quantization``'s DDP hook state per
  process group), ``"loss.chunk_ops"`` (the fused loss's compiled per-chunk functions);
* tracked objects (``track``): objects that hold process-wide state of their own and clear it
  in their ``clear()`` method, held weakly (the kernel config caches,
  ``fp8.kernels.tuning.ConfigCache``: every instance, including ones a test builds);
* settings (``setting`` / ``set_setting``): process-wide switches, defaults in
  ``SETTING_DEFAULTS`` (``"fp8.kernels.autotune"``: time candidate kernel configs);
* counters: the optimizer-step epoch, bumped after every ``torch.optim`` step by a global hook
  registered on first use (FP8 weight-cast caches compare against it, since fused optimizers
  step without bumping the Parameters' version counters), and the number of process groups
  ``init_distributed`` has started (a fresh store prefix for each).

:func:`reset` (tests) forgets warn/log-once keys and probe results, empties every named cache
in place (a module holding a reference to one sees it empty), calls ``clear()`` on every
tracked object and puts every setting back to its default. It does not rewind the two
counters: they identify things (an epoch a cached FP8 weight was cast in, a store prefix
another group used), and counting again from zero would let an old cache entry or store key
match again. The step hook stays registered.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import threading
import warnings
import weakref
from types import MappingProxyType
from typing import Any, Callable, Hashable, Mapping, Optional

SETTING_DEFAULTS: Mapping[str, object] = MappingProxyType({
    # Time every candidate config of a kernel on a new shape (off: take the first; tests).
    "fp8.kernels.autotune": True,
})

_LOCK = threading.Lock()
# Cleared by reset():
_WARNED: set[Hashable] = set()
_LOGGED: set[Hashable] = set()
_PROBES: dict[Hashable, object] = {}
_CACHES: dict[str, dict] = {}
_SETTINGS: dict[str, object] = dict(SETTING_DEFAULTS)
_TRACKED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # kept; reset() clears each object
# Never rewound (see the module docstring):
_STEP_EPOCH = [0]
_STEP_HOOK: list = []
_INIT_COUNT = [0]


def _rank() -> int:
    """This process's rank in the job: the process group's, else torchrun's ``RANK``, else 0."""
    # lazy: _state imports no torch at import time (every module imports _state)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def warn_once(key: Hashable, message: str, stacklevel: Optional[int] = None,
              all_ranks: bool = False) -> None:
    """Emit ``warnings.warn(message)`` the first time ``key`` is seen in this job.

    Args:
        key: the reason; each key warns once per process.
        message: the warning text.
        stacklevel: as ``warnings.warn``. None (default): the first frame outside fp8boost and
            torch, i.e. the user's line that led here; Python prints that line under the
            warning, where a fixed level printed a line of fp8boost's own source.
        all_ranks: warn on every rank. The default warns on rank 0 only, for conditions that
            are the same on every rank (an 8-GPU job printed each fallback 8 times).
    """
    # Read paths take no lock: torch.compile traces these helpers and breaks its graph on a
    # lock (seen on an H100: 6 graph breaks per compiled model before this fast path).
    if key in _WARNED:
        return
    with _LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    if all_ranks or _rank() == 0:
        warnings.warn(message, stacklevel=stacklevel or _outside_stacklevel())


_FRAMEWORKS = ("torch", "transformers", "accelerate", "peft")


def _outside_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, called from :func:`warn_once`, of the first frame whose
    file is not under fp8boost/, contextlib or the frameworks that call into it (torch,
    transformers, accelerate, peft: their forward hooks and trainers); 1 is warn_once itself."""
    prefixes = [os.path.dirname(os.path.abspath(__file__)) + os.sep, contextlib.__file__]
    for name in _FRAMEWORKS:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            prefixes.append(os.path.dirname(mod.__file__) + os.sep)
    frame = inspect.currentframe()
    frame = frame.f_back if frame is not None else None  # warn_once's frame: level 1
    level = 1
    while frame is not None and frame.f_back is not None and \
            frame.f_code.co_filename.startswith(tuple(prefixes)):
        frame = frame.f_back
        level += 1
    return level


def log_once(logger: logging.Logger, key: Hashable, message: str,
             level: int = logging.WARNING, all_ranks: bool = False) -> bool:
    """Log ``message`` the first time ``key`` is seen; returns whether it was logged.

    As :func:`warn_once`, rank 0 alone logs unless ``all_ranks``; every rank records the key,
    so the return value (and :func:`was_logged`) is the same on all ranks.
    """
    if key in _LOGGED:
        return False
    with _LOCK:
        if key in _LOGGED:
            return False
        _LOGGED.add(key)
    if all_ranks or _rank() == 0:
        logger.log(level, message)
    return True


def was_logged(key: Hashable) -> bool:
    """Whether ``log_once`` has logged ``key`` in this process."""
    return key in _LOGGED


def forget_logged(key: Hashable) -> None:
    """Let ``key`` be logged again (tests)."""
    with _LOCK:
        _LOGGED.discard(key)


def _bump_epoch(*_args) -> None:
    _STEP_EPOCH[0] += 1


def step_epoch() -> int:
    """Number of optimizer steps taken in this process since the hook was registered.

    The first call registers a global ``torch.optim`` step-post hook (lazily: never at import).
    """
    if not _STEP_HOOK:
        with _LOCK:
            if not _STEP_HOOK:
                # lazy: _state imports no torch at import time (every module imports _state)
                from torch.optim.optimizer import register_optimizer_step_post_hook

                _STEP_HOOK.append(register_optimizer_step_post_hook(_bump_epoch))
    return _STEP_EPOCH[0]


def bump_step_epoch() -> None:
    """Invalidate every epoch-keyed cache (as an optimizer step does)."""
    _bump_epoch()


def probe(key: Hashable, compute: Callable[[], object]) -> object:
    """``compute()`` once per ``key`` for the life of the process (or until :func:`reset`).

    For device capability checks, per-device facts and objects built on first use.
    """
    # No lock: compiled code traces this on a layer's first call, and a lock breaks the graph;
    # two threads racing would only compute the same answer twice.
    if key not in _PROBES:
        _PROBES.setdefault(key, compute())
    return _PROBES[key]


def cache(name: str) -> dict:
    """The process-wide dict called ``name`` (created empty on first use).

    Each name belongs to one module (see the module docstring for the names in use); holding a
    reference to the dict is fine: :func:`reset` empties it in place, never replaces it.
    """
    # dict.setdefault is atomic under the GIL, and a lock here would break compiled graphs.
    found = _CACHES.get(name)
    return found if found is not None else _CACHES.setdefault(name, {})


def track(obj: Any) -> None:
    """Have :func:`reset` call ``obj.clear()``; ``obj`` is held weakly (it may die any time)."""
    with _LOCK:
        _TRACKED.add(obj)


def tracked(kind: type) -> list:
    """The live tracked objects that are instances of ``kind``."""
    with _LOCK:
        return [obj for obj in _TRACKED if isinstance(obj, kind)]


def setting(name: str) -> Any:
    """The current value of a process-wide setting (``SETTING_DEFAULTS`` names them)."""
    return _SETTINGS[name]


def set_setting(name: str, value: object) -> None:
    """Change a process-wide setting until the next :func:`reset` (which restores its default).

    Raises:
        KeyError: ``name`` is not in ``SETTING_DEFAULTS``.
    """
    if name not in SETTING_DEFAULTS:
        raise KeyError(f"unknown fp8boost setting {name!r}; known: {sorted(SETTING_DEFAULTS)}")
    _SETTINGS[name] = value


def next_init_count() -> int:
    """Count one more process group started by this process; returns the new count."""
    with _LOCK:
        _INIT_COUNT[0] += 1
        return _INIT_COUNT[0]


def init_count() -> int:
    """How many process groups ``init_distributed`` has started in this process."""
    return _INIT_COUNT[0]


def reset() -> None:
    """Clear all process-wide state except the two counters (see the module docstring).

    Forgets warn/log-once keys and probe results, empties every named cache in place, calls
    ``clear()`` on every tracked object and restores every setting's default. The step epoch,
    the process-group count and the step hook stay: rewinding a counter would let an old cache
    entry or store key match again.
    """
    with _LOCK:
        _WARNED.clear()
        _LOGGED.clear()
        _PROBES.clear()
        for table in list(_CACHES.values()):  # cache() may add one meanwhile (no lock)
            table.clear()
        tracked_now = list(_TRACKED)
        _SETTINGS.clear()
        _SETTINGS.update(SETTING_DEFAULTS)
    for obj in tracked_now:  # outside the lock: clear() may take its own
        obj.clear()
