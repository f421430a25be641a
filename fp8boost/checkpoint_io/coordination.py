"""Rank coordination of checkpoint saves and loads.

Rank 0 of the plugin's checkpoint group writes what is written once (``rank(group) == 0``).
A rank whose part of a save or load fails must not leave its peers waiting in the next
collective: ``run_agreed``, ``raise_if_failed`` and ``agreed_read`` make every rank learn of
the failure (one all-reduce) and raise alike. Without a process group (or with one rank),
every function here is the single-process case and communicates nothing.
"""
from __future__ import annotations

import errno
import os
import shutil
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .errors import CheckpointCorruptError, CheckpointSaveError


def active(group) -> bool:
    """Whether ``group`` has several ranks to coordinate."""
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def rank(group) -> int:
    """This process's rank in ``group`` (0 without one)."""
    return dist.get_rank(group) if active(group) else 0


def world_size(group) -> int:
    """The number of ranks in ``group`` (1 without one)."""
    return dist.get_world_size(group) if active(group) else 1


def _comm_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier(group) -> None:
    if active(group):
        dist.barrier(group=group)


def broadcast_object(obj, group):
    """Rank 0's ``obj`` on every rank of ``group``."""
    if not active(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group,
                               device=_comm_device(group))
    return box[0]


def all_ok(ok: bool, group) -> bool:
    """True on every rank when ``ok`` is True on every rank (one all-reduce)."""
    if not active(group):
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_comm_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class PeerSaveFailure(RuntimeError):
    """Raised on the healthy ranks of a save phase that failed on another rank."""


def run_agreed(fn: Callable[[], None], group) -> None:
    """Run one phase of a save on every rank, then agree (one all-reduce) that it worked.

    A rank that fails must not leave its peers waiting in the phase's next collective: after
    this returns, either every rank succeeded or every rank raises (the failing rank its own
    error, the others :class:`PeerSaveFailure`), to be reported by :func:`raise_if_failed`.
    """
    failure: Optional[BaseException] = None
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the peers must hear of it first
        failure = e
    if not all_ok(failure is None, group):
        raise failure if failure is not None else PeerSaveFailure("failed on another rank")


def raise_if_failed(path: str, failure: Optional[BaseException], group,
                    tmp: Optional[str] = None) -> None:
    """Collective: when a rank's part of a save failed, drop ``tmp`` and raise the same
    :class:`CheckpointSaveError` on every rank, naming the rank and cause and saying what is
    left at ``path``; otherwise return. Every rank must call it (one all-reduce)."""
    if all_ok(failure is None, group):
        return
    mine = None if failure is None or isinstance(failure, PeerSaveFailure) else (
        f"{type(failure).__name__}: {failure}", getattr(failure, "errno", None))
    reports = [mine]
    if active(group):
        reports = [None] * dist.get_world_size(group)
        dist.all_gather_object(reports, mine, group=group)
    if rank(group) == 0 and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier(group)
    bad = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
    _first, (why, code) = bad[0] if bad else (0, ("unknown error", None))
    kept = (f"the previous checkpoint at {path} is intact" if os.path.exists(path) else
            f"nothing was written at {path}")
    hint = ("free disk space (or save elsewhere) and save again" if code in
            (errno.ENOSPC, errno.EDQUOT) else "fix the cause and save again")
    where = "rank " + ", ".join(str(r) for r, _ in bad) if active(group) else "this process"
    message = (f"saving the checkpoint {path} failed on {where} ({why}); {kept} and the "
               f"partial files were removed: {hint}")
    err = CheckpointSaveError(message) if code is None else CheckpointSaveError(code, message)
    raise err from failure


def agreed_read(fn: Callable[[], None], group, directory: str) -> None:
    """Run a read on every rank; if it fails on any, every rank raises that rank's error."""
    failure: Optional[BaseException] = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the peers must hear of it first
        failure = e
    if all_ok(failure is None, group):
        return
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    reports = [mine]
    if active(group):
        reports = [None] * dist.get_world_size(group)
        dist.all_gather_object(reports, mine, group=group)
    first, why = next((r, m) for r, m in enumerate(reports) if m is not None)
    if failure is not None and isinstance(failure, (OSError, ValueError)):
        raise failure
    raise CheckpointCorruptError(f"loading {directory} failed on rank {first}: {why}")
