"""``colossalai.cluster``: ``DistCoordinator``, who is master, and running code on it alone.

Example:
    >>> from fp8boost.colossal.cluster import DistCoordinator
    >>> coordinator = DistCoordinator()  # doctest: +SKIP
    >>> coordinator.print_on_master("starting")  # doctest: +SKIP
"""
from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist
from torch.distributed import ProcessGroup

from fp8boost.parallel.distributed import leave_process_group

__all__ = ["DistCoordinator"]


class DistCoordinator:
    """This process's place in the job: rank, world size, local rank, and master-only helpers.

    As in Colossal-AI, the default process group must exist (``launch_from_torch`` first).
    ``is_master(group)`` is rank 0 of ``group`` (default: the world); the node master is
    local rank 0; helpers that take ``process_group`` apply it the same way.

    Raises:
        RuntimeError: no process group (``launch_from_torch`` was not called).

    Example:
        >>> coordinator = DistCoordinator()  # doctest: +SKIP
        >>> if coordinator.is_master(): print("rank 0 of", coordinator.world_size)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistCoordinator needs the process group: call "
                               "colossalai.launch_from_torch() (or launch()) first")
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        # LOCAL_RANK unset (plain python, one process): this process is its node's first
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def is_master(self, process_group: Optional[ProcessGroup] = None) -> bool:
        """Whether this process is rank 0 of ``process_group`` (default: the world)."""
        return dist.get_rank(process_group) == 0

    def is_node_master(self) -> bool:
        """Whether this process is its node's local rank 0."""
        return self._local_rank == 0

    def is_last_process(self, process_group: Optional[ProcessGroup] = None) -> bool:
        """Whether this process is the last rank of ``process_group`` (default: the world)."""
        return dist.get_rank(process_group) == dist.get_world_size(process_group) - 1

    def print_on_master(self, msg: str, process_group: Optional[ProcessGroup] = None) -> None:
        """``print(msg)`` on the master of ``process_group`` only."""
        if self.is_master(process_group):
            print(msg)

    def print_on_node_master(self, msg: str) -> None:
        """``print(msg)`` on each node's local rank 0 only."""
        if self.is_node_master():
            print(msg)

    def block_all(self, process_group: Optional[ProcessGroup] = None) -> None:
        """Barrier over ``process_group`` (default: the world)."""
        dist.barrier(group=process_group)

    @contextmanager
    def priority_execution(self, executor_rank: int = 0,
                           process_group: Optional[ProcessGroup] = None) -> Iterator[None]:
        """Run the block on ``executor_rank`` first, then on every other rank.

        For work the others should reuse (downloading a dataset, building a cache).
        Collective: every rank of ``process_group`` enters it.
        """
        first = dist.get_rank(process_group) == executor_rank
        if not first:
            self.block_all(process_group)  # wait for the executor to finish its block
        try:
            yield
        finally:
            if first:
                self.block_all(process_group)  # release the others

    def destroy(self, process_group: Optional[ProcessGroup] = None) -> None:
        """Destroy ``process_group`` (default: the whole job's), its ranks leaving together."""
        leave_process_group(None if process_group == dist.group.WORLD else process_group)

    def on_master_only(self, process_group: Optional[ProcessGroup] = None) -> Callable:
        """Decorator: the function runs on the master of ``process_group`` only (None elsewhere).

        Example:
            >>> @coordinator.on_master_only()  # doctest: +SKIP
            ... def save_config(): ...
        """
        is_master = self.is_master(process_group)

        def decorator(func: Callable) -> Callable:
            @functools.wraps(func)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if is_master:
                    return func(*args, **kwargs)
                return None

            return wrapper

        return decorator
