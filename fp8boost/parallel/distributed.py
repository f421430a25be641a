"""Joining the process group, and starting every replica from the same weights.

``init_distributed`` forms the default process group (under torchrun, or a one-process group
from plain ``python``); ``broadcast_module`` is the one copy of "every rank of a group starts
from its first rank's parameters and buffers" that the plugins run before they shard or split
a model (as DDP does at construction).
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost import _state

#: dtypes gloo cannot broadcast: their bytes travel as uint8 instead
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Its name from when this lived in plugins/: kept, since users filter logs by it.
_LOG = logging.getLogger("fp8boost.plugins.distributed")


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(backend: Optional[str] = None, timeout_s: float = 1800.0,
                     device: Optional[torch.device] = None) -> None:
    """Initialise the default process group if nobody has yet.

    Under ``torchrun`` (``WORLD_SIZE``/``RANK``/``MASTER_ADDR`` set) it joins that job;
    otherwise it starts a one-process group on localhost, so plugins also work from plain
    ``python``. The backend is NCCL with CUDA (after ``torch.cuda.set_device(LOCAL_RANK)``),
    else gloo.

    Restarts: under ``torchrun --max-restarts N`` the workers of a restarted attempt talk to
    the same agent store as the attempt that died, and (measured on torch 2.13/gloo) they
    could read a dead rank's address from it and fail with ``connectFullMesh ... Connection
    refused``. The store is therefore prefixed with ``TORCHELASTIC_RESTART_COUNT`` (and with
    this process's init count), so every attempt forms its group from its own keys.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; default NCCL with CUDA, else gloo.
        timeout_s: collective timeout: a crashed peer ends the job after this long instead
            of hanging it.
        device: the CUDA device of this rank for NCCL (``device_id``; eager connection).

    Example:
        >>> from fp8boost.plugins import init_distributed
        >>> init_distributed()  # doctest: +SKIP
    """
    if dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(device if device is not None and device.type == "cuda"
                              else int(os.environ.get("LOCAL_RANK", "0")))
    backend = backend or ("nccl" if cuda else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if device is not None and device.type == "cuda" else {}
    if all(k in os.environ for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = _job_store(rank, world, timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout, **kwargs)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                    timeout=timeout, **kwargs)
        _state.next_init_count()  # the next group gets a fresh store prefix
        atexit.register(destroy_at_exit)
        return
    with socket.socket() as s:  # a free port for the one-process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=timeout)
    atexit.register(destroy_at_exit)


def destroy_at_exit() -> None:
    """Destroy the default process group fp8boost created, if the script did not.

    A script that ends without ``destroy_process_group()`` leaves gloo's threads to the
    interpreter's teardown, and about one run in ten of the README's 2-rank example aborted
    there ("terminate called without an active exception", SIGABRT after its last line
    printed). Registered with ``atexit`` by :func:`init_distributed` only (a group the user
    created is the user's to destroy).
    """
    if dist.is_available() and dist.is_initialized():
        leave_process_group()


def leave_process_group(group=None) -> None:
    """Destroy ``group`` (default: the default process group and every group made from it),
    its ranks together.

    Under gloo a rank that tore its pairs down while a peer still finished its last sends
    aborted the peer ("terminate called without an active exception": the README's 4-rank
    pipeline example, a Colossal-AI script's ``coordinator.destroy()``), so the ranks first
    meet at a barrier bounded to 30 s: a rank whose peers died does not wait for the
    collective timeout. NCCL and one-rank groups are destroyed at once. Call it on every rank
    of ``group``.

    Example:
        >>> from fp8boost.parallel.distributed import leave_process_group
        >>> leave_process_group()  # doctest: +SKIP
    """
    if dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1:
        try:
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=30),
                                   wait_all_ranks=True)
        except RuntimeError as e:  # a peer is gone: nothing to wait for, but say so
            _state.log_once(_LOG, "leave-barrier-failed",
                            f"fp8boost: rank {dist.get_rank()} leaves the process group without "
                            f"its peers (teardown barrier failed within 30 s: {e}); a peer may "
                            "have exited or crashed", all_ranks=True)
    dist.destroy_process_group(group)


def _job_store(rank: int, world: int, timeout: datetime.timedelta):
    """torchrun's store under a prefix of this attempt (see ``init_distributed``), or None
    outside torchelastic (plain ``env://`` then)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    # TORCHELASTIC_USE_AGENT_STORE=True: the agent hosts the store and every rank is a client
    # (torch's own env:// handler does the same); otherwise rank 0 hosts it.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0, timeout=timeout,
                          multi_tenant=not agent)
    return dist.PrefixStore(f"fp8boost/attempt{attempt}/init{_state.init_count()}", store)


def broadcast_module(model: nn.Module, group=None) -> None:
    """Copy the parameters and buffers of ``group``'s first rank to its other ranks, in place.

    ``group`` None is the whole world. Nothing happens on one rank or without a process
    group. FP8 tensors travel as their uint8 bytes (gloo has no FP8 type). Collective: every
    rank of ``group`` calls it with the same model structure.

    Example:
        >>> broadcast_module(model, plugin.dp_group)  # doctest: +SKIP
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            data = t.data.view(torch.uint8) if t.dtype in _FP8_DTYPES else t.data
            dist.broadcast(data, src, group=group)
