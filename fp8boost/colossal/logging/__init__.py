"""``colossalai.logging``: ``get_dist_logger`` and its rank-filtered logger.

``logger.info(msg, ranks=[0])`` logs on rank 0 only; ``ranks=None`` logs on every rank.
Messages go through the standard library's ``logging`` (this package is
``fp8boost.colossal.logging``; absolute imports keep the standard library's module the one
every other module gets).

Example:
    >>> from fp8boost.colossal.logging import get_dist_logger
    >>> get_dist_logger().info("hello", ranks=[0])  # doctest: +SKIP
"""
from __future__ import annotations

import logging as _stdlib_logging  # the standard library's (absolute import)
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Union

from fp8boost import _state

__all__ = ["DistributedLogger", "get_dist_logger", "disable_existing_loggers"]

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _rank() -> int:
    # The process group's rank when there is one; torchrun's RANK before it is formed.
    import torch.distributed as dist  # lazy: importing this module imports no torch

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _StderrHandler(_stdlib_logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record (a stream kept from creation
    goes stale when a test runner or notebook swaps ``sys.stderr``)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: ANN201 - logging's attribute
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001 - StreamHandler.__init__ assigns it
        pass


class DistributedLogger:
    """A named logger whose calls take ``ranks`` (the ranks that log; None: all).

    Colossal-AI keeps one per name; use ``get_dist_logger(name)`` rather than the constructor.

    Args:
        name: the name of the underlying ``logging.Logger``.
    """

    @staticmethod
    def get_instance(name: str) -> "DistributedLogger":
        """The one logger called ``name`` (in fp8boost._state's named cache)."""
        instances = _state.cache("colossal.loggers")
        if name not in instances:
            instances[name] = DistributedLogger(name)
        return instances[name]

    def __init__(self, name: str) -> None:
        self._name = name
        self._logger = _stdlib_logging.getLogger(name)
        if not self._logger.handlers:  # once per name: a second handler would print twice
            handler = _StderrHandler()
            handler.setFormatter(_stdlib_logging.Formatter(
                f"[%(asctime)s] %(levelname)s {name}: %(message)s", "%X"))
            self._logger.addHandler(handler)
            self._logger.setLevel(_stdlib_logging.INFO)
            self._logger.propagate = False  # the root logger would print it a second time

    @property
    def logger(self) -> _stdlib_logging.Logger:
        """The standard library logger underneath."""
        return self._logger

    def set_level(self, level: str) -> None:
        """``"DEBUG"``, ``"INFO"``, ``"WARNING"`` or ``"ERROR"``."""
        if level not in _LEVELS:
            raise ValueError(f"level must be one of {_LEVELS}, got {level!r}")
        self._logger.setLevel(getattr(_stdlib_logging, level))

    def log_to_file(self, path: Union[str, Path], mode: str = "a", level: str = "INFO",
                    suffix: Optional[str] = None) -> None:
        """Also write this rank's records to ``path/rank_<r>[_suffix].log`` (``path`` a folder)."""
        if level not in _LEVELS:
            raise ValueError(f"level must be one of {_LEVELS}, got {level!r}")
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        name = f"rank_{_rank()}" + (f"_{suffix}" if suffix else "") + ".log"
        handler = _stdlib_logging.FileHandler(folder / name, mode)
        handler.setLevel(getattr(_stdlib_logging, level))
        handler.setFormatter(_stdlib_logging.Formatter(
            f"[%(asctime)s] %(levelname)s {self._name}: %(message)s"))
        self._logger.addHandler(handler)

    def _log(self, level: str, message: str, ranks: Optional[List[int]]) -> None:
        if ranks is None or _rank() in ranks:
            # stacklevel 3: the record names the caller of info()/warning(), not this file
            self._logger.log(getattr(_stdlib_logging, level), message, stacklevel=3)

    def info(self, message: str, ranks: Optional[List[int]] = None) -> None:
        """Log ``message`` at INFO on ``ranks`` (None: every rank)."""
        self._log("INFO", message, ranks)

    def warning(self, message: str, ranks: Optional[List[int]] = None) -> None:
        """Log ``message`` at WARNING on ``ranks`` (None: every rank)."""
        self._log("WARNING", message, ranks)

    def debug(self, message: str, ranks: Optional[List[int]] = None) -> None:
        """Log ``message`` at DEBUG on ``ranks`` (None: every rank)."""
        self._log("DEBUG", message, ranks)

    def error(self, message: str, ranks: Optional[List[int]] = None) -> None:
        """Log ``message`` at ERROR on ``ranks`` (None: every rank)."""
        self._log("ERROR", message, ranks)


def get_dist_logger(name: str = "colossalai") -> DistributedLogger:
    """The process's logger called ``name`` (the same object on every call).

    Example:
        >>> logger = get_dist_logger()
        >>> logger is get_dist_logger("colossalai")
        True
    """
    return DistributedLogger.get_instance(name)


def disable_existing_loggers(include: Optional[List[str]] = None,
                             exclude: Sequence[str] = ("colossalai",)) -> None:
    """Raise every existing logger (or those in ``include``) but ``exclude`` to WARNING."""
    names = include if include is not None else list(_stdlib_logging.root.manager.loggerDict)
    for name in names:
        if name not in exclude:
            _stdlib_logging.getLogger(name).setLevel(_stdlib_logging.WARNING)
