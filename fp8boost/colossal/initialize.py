"""``colossalai.launch_from_torch`` / ``colossalai.launch``: join the job and seed it.

Both form the default process group through fp8boost's own ``init_distributed`` (NCCL with
CUDA, gloo on the CPU, with a collective timeout), make ``LOCAL_RANK``'s GPU current, and seed
Python's ``random``, NumPy and torch with ``seed``, as Colossal-AI does.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from fp8boost.colossal.logging import get_dist_logger
from fp8boost.colossal.utils import set_seed

__all__ = ["launch", "launch_from_torch"]

#: how long a collective waits for a missing peer before the job fails (instead of hanging)
TIMEOUT_S = 1800.0


def _backend(backend: str) -> Optional[str]:
    # Colossal-AI's default is "nccl"; on a machine without CUDA the script still runs on
    # gloo (init_distributed's choice) rather than failing inside NCCL.
    if backend == "nccl" and not torch.cuda.is_available():
        return None
    return backend


def launch(rank: int, world_size: int, host: str, port: int, backend: str = "nccl",
           local_rank: Optional[int] = None, seed: int = 1024, verbose: bool = True,
           *, config: Any = None) -> None:
    """Join a job whose rank, size and rendezvous address are given explicitly.

    Args:
        rank: this process's global rank.
        world_size: the number of processes.
        host: the address of rank 0's rendezvous store.
        port: its port.
        backend: ``"nccl"`` (falls back to gloo without CUDA) or ``"gloo"``.
        local_rank: the GPU index on this node (default: ``LOCAL_RANK`` if set, else
            ``rank % torch.cuda.device_count()`` as Colossal-AI picks it, 0 without CUDA).
        seed: the seed of ``random``, NumPy and torch.
        verbose: log one INFO line on rank 0 when the group is formed.
        config: Colossal-AI's old config argument: ignored (an INFO line says so).

    Example:
        >>> import fp8boost.colossal as colossalai
        >>> colossalai.launch(rank=0, world_size=1, host="127.0.0.1", port=29511)  # doctest: +SKIP
    """
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=str(host),
                      MASTER_PORT=str(port))
    os.environ["LOCAL_RANK"] = str(default_local_rank(rank, local_rank))
    _init_and_seed(backend, seed, verbose, config)


def default_local_rank(rank: int, local_rank: Optional[int] = None) -> int:
    """The GPU index :func:`launch` gives this process: ``local_rank`` if given, else
    ``LOCAL_RANK`` if set, else ``rank % torch.cuda.device_count()`` (Colossal-AI's choice for
    processes started without a launcher; every rank on GPU 0 was this module's old default),
    else 0 (no CUDA).

    Example:
        >>> default_local_rank(5, local_rank=1)
        1
    """
    if local_rank is not None:
        return int(local_rank)
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return rank % count if count else 0


def launch_from_torch(backend: str = "nccl", seed: int = 1024, verbose: bool = True,
                      *, config: Any = None) -> None:
    """Join the job ``torchrun`` started (it reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...).

    From plain ``python`` (no torchrun variables) it forms a one-process group, as fp8boost's
    plugins do. Calling it again once the group exists only seeds again.

    Args:
        backend: ``"nccl"`` (falls back to gloo without CUDA) or ``"gloo"``.
        seed: the seed of ``random``, NumPy and torch.
        verbose: log one INFO line on rank 0 when the group is formed.
        config: Colossal-AI's old config argument (``launch_from_torch(config={})``, also
            positional): ignored, with an INFO line.

    Example:
        >>> import fp8boost.colossal as colossalai
        >>> colossalai.launch_from_torch(seed=42)  # doctest: +SKIP
    """
    if not isinstance(backend, str):  # old positional call: launch_from_torch(config)
        backend, config = "nccl", backend
    _init_and_seed(backend, seed, verbose, config)


def _init_and_seed(backend: str, seed: int, verbose: bool, config: Any) -> None:
    # lazy: fp8boost.plugins loads every plugin (Triton, torch.compile); this module stays light
    from fp8boost.parallel.distributed import init_distributed

    logger = get_dist_logger()
    if config is not None:
        logger.info("launch: the config argument of older Colossal-AI versions is ignored "
                    "(fp8boost takes every setting from the plugin and Booster arguments)",
                    ranks=[0])
    init_distributed(backend=_backend(backend), timeout_s=TIMEOUT_S)
    set_seed(seed)
    if verbose:
        logger.info(f"Distributed environment is initialized, world size: "
                    f"{dist.get_world_size()}, backend: {dist.get_backend()}", ranks=[0])
