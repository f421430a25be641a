"""Process-wide state of fp8boost, in one place.

Everything here lives for the life of the process and is created lazily (nothing runs at
import time):

* warn-once keys (``warn_once``) and log-once keys (``log_once``): each fallback or notice is
  reported once per job and reason: once per process, and in a multi-process job by rank 0
  only (the conditions they report are the same on every rank: same machine type, model and
  options), unless the caller says ``all_ranks=True``;
* the optimizer-step epoch: bumped after every ``torch.optim`` step by a global hook registered
  on first use; FP8 weight-cast caches compare against it, since fused optimizers step without
  bumping the Parameters' version counters;
* capability probes: results of one-time checks per device (FP8 tensor cores, Triton
  self-tests), cached under a string key.

Tests may call :func:`reset` to start from a clean slate.
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Callable, Hashable

_LOCK = threading.Lock()
_WARNED: set[Hashable] = set()
_LOGGED: set[Hashable] = set()
_STEP_EPOCH = [0]
_STEP_HOOK: list = []
_PROBES: dict[str, object] = {}


def _rank() -> int:
    """This process's rank in the job: the process group's, else torchrun's ``RANK``, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def warn_once(key: Hashable, message: str, stacklevel: int = 3, all_ranks: bool = False) -> None:
    """Emit ``warnings.warn(message)`` the first time ``key`` is seen in this job.

    Args:
        key: the reason; each key warns once per process.
        message: the warning text.
        stacklevel: as ``warnings.warn``.
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
        warnings.warn(message, stacklevel=stacklevel)


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
                from torch.optim.optimizer import register_optimizer_step_post_hook

                _STEP_HOOK.append(register_optimizer_step_post_hook(_bump_epoch))
    return _STEP_EPOCH[0]


def bump_step_epoch() -> None:
    """Invalidate every epoch-keyed cache (as an optimizer step does)."""
    _bump_epoch()


def probe(key: str, compute: Callable[[], object]) -> object:
    """``compute()`` once per ``key`` for the life of the process (device capability checks)."""
    # No lock: compiled code traces this on a layer's first call, and a lock breaks the graph;
    # two threads racing would only compute the same answer twice.
    if key not in _PROBES:
        _PROBES.setdefault(key, compute())
    return _PROBES[key]


def reset() -> None:
    """Forget warn/log-once keys and probe results (tests). The step hook stays registered."""
    with _LOCK:
        _WARNED.clear()
        _LOGGED.clear()
        _PROBES.clear()
