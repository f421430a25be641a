"""Safetensors files shared by model and optimizer I/O.

``model_io`` and ``optimizer_io`` write every file through this module's ``save_file`` (looked
up at call time), so a test can make all of their writes fail at once by replacing it.
"""
from __future__ import annotations

from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file  # noqa: F401 - the one write path (see above)


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t`` that shares nothing with it."""
    return t.detach().to("cpu", copy=True).contiguous()


def open_checked(path: str, read: Callable):
    """``read(path)`` (``safe_open``/``load_file``) with a truncated or corrupt file named.

    safetensors' own error carries no path, so a user resuming from a half-written checkpoint
    could not tell which file is bad.
    """
    try:
        return read(path)
    except SafetensorError as exc:
        raise ValueError(f"checkpoint file {path} is unreadable ({exc}): it is truncated or "
                         "corrupt (a save killed midway, a full disk or a partial copy?); "
                         "resume from another checkpoint or copy the file again") from exc
