"""Finding the checkpoint to resume from: the newest complete one in a folder.

A job restarted by ``torchrun --max-restarts N`` (or by hand) runs the same command again; it
needs the newest checkpoint that was *finished*. Saves are atomic (``atomic.atomic_save_dir``
writes into a hidden ``.<name>.tmp-*`` directory and renames it when every rank is done), so
a directory under its final name is complete when it holds its marker file; leftovers of a
save that died (hidden temp directories, ``*.partial`` folders, directories without the
marker) are skipped.

Example:
    >>> from fp8boost.checkpoint_io import latest_checkpoint
    >>> path = latest_checkpoint("runs/a/checkpoints")                  # doctest: +SKIP
    >>> if path is not None:                                            # doctest: +SKIP
    ...     extra = booster.load_checkpoint(path, model, optimizer, sched)
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional, Union

from .base import STATE_MARKER

_STEP = re.compile(r"(\d+)$")


def complete_checkpoints(folder: Union[str, os.PathLike],
                         marker: str = STATE_MARKER) -> list[Path]:
    """Complete checkpoint directories directly inside ``folder``, newest first.

    Args:
        folder: where the run saves its checkpoints (one subdirectory per save).
        marker: the file a complete checkpoint holds (``fp8boost_checkpoint.json`` for
            ``booster.save_checkpoint``; the example's ``trainer_state.json``).

    Returns:
        Directories ordered by the step number at the end of their name (``step_00000100``,
        ``ckpt-100``), newest first; names without a number sort by modification time, after
        numbered ones. Empty when ``folder`` does not exist.
    """
    root = Path(folder)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        # Hidden: atomic-save temp/old directories; *.partial: the example's unfinished saves.
        if d.name.startswith(".") or d.name.endswith(".partial") or not d.is_dir():
            continue
        if not (d / marker).is_file():
            continue
        m = _STEP.search(d.name)
        found.append(((1, int(m.group(1))) if m else (0, d.stat().st_mtime), d))
    return [d for _, d in sorted(found, key=lambda x: x[0], reverse=True)]


def latest_checkpoint(folder: Union[str, os.PathLike],
                      marker: str = STATE_MARKER) -> Optional[Path]:
    """The newest complete checkpoint in ``folder`` (see :func:`complete_checkpoints`), or
    None when there is none yet (a first launch)."""
    found = complete_checkpoints(folder, marker)
    return found[0] if found else None
