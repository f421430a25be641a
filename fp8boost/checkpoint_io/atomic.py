"""Atomic checkpoint directories: a save never damages the checkpoint it replaces.

Every save writes into a fresh temp directory next to the target, then renames it into place
(``os.replace``) once every rank has finished. A save that dies midway leaves the previous
checkpoint untouched (only a ``.<name>.tmp-*`` directory behind); one that fails (a full disk:
``ENOSPC``) removes its temp directory and raises :class:`CheckpointSaveError` on every rank,
saying that the previous checkpoint is intact. A load of a directory that is not there says
when a save was interrupted while swapping (``require``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Callable, Optional

from . import coordination as coord
from .checksums import add_checksums


def check_target(path: str, markers: tuple[str, ...]) -> Optional[str]:
    """Why ``path`` may not be (over)written by a checkpoint whose directories hold one of
    ``markers``, or None."""
    if os.path.isfile(path):
        return f"{path} is a file; checkpoints are directories: pass a directory path"
    if os.path.isdir(path) and os.listdir(path) and not any(
            os.path.exists(os.path.join(path, m)) for m in markers):
        return (f"refusing to replace {path}: it is a non-empty directory that is not a checkpoint "
                "of this kind; pass a new or an old checkpoint directory")
    return None


def atomic_save_dir(path: str, group, write: Callable[[str], None],
                    markers: tuple[str, ...]) -> None:
    """Run ``write(tmp_dir)`` on every rank of ``group``, then swap ``tmp_dir`` into ``path``.

    Rank 0 creates the temp dir and does the rename; a failure on any rank removes the temp dir,
    keeps the previous checkpoint and raises on every rank.
    """
    path = os.path.abspath(path)
    parent, name = os.path.dirname(path), os.path.basename(path)
    tmp, err = None, None
    if coord.rank(group) == 0:
        err = check_target(path, markers)
        if err is None:
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    tmp, err = coord.broadcast_object((tmp, err), group)
    if err is not None:
        raise ValueError(err)
    failure: Optional[BaseException] = None
    try:
        write(tmp)
    except BaseException as e:  # noqa: BLE001 - every rank must learn about it before raising
        failure = e
    coord.raise_if_failed(path, failure, group, tmp)
    try:  # digests of what is on disk now, before it becomes the checkpoint
        add_checksums(tmp, group, markers)
    except BaseException as e:  # noqa: BLE001 - same agreement as a failed write
        failure = e
    coord.raise_if_failed(path, failure, group, tmp)
    if coord.rank(group) == 0:
        _swap_in(tmp, path)
    coord.barrier(group)


def _swap_in(tmp: str, path: str) -> None:
    if not os.path.exists(path):
        os.replace(tmp, path)
        return
    # rename(2) cannot replace a non-empty directory: move the old one aside first.
    old = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old-{uuid.uuid4().hex[:8]}")
    os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def require(path: str, what: str, marker: str) -> None:
    """Raise ``FileNotFoundError`` unless ``path`` holds ``marker``, naming the previous
    checkpoint when a save was interrupted while swapping directories."""
    if os.path.exists(os.path.join(path, marker)):
        return
    parent, name = os.path.split(os.path.abspath(path))
    leftovers = [d for d in os.listdir(parent) if d.startswith(f".{name}.old-")] \
        if os.path.isdir(parent) else []
    hint = (f"; a save was interrupted while swapping directories: the previous checkpoint is in "
            f"{os.path.join(parent, leftovers[0])}") if leftovers else ""
    raise FileNotFoundError(f"no {what} checkpoint at {path} (missing {marker}){hint}")
