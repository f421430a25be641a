"""Shared helper for multi-process (gloo, CPU) tests.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo
process group in each, calls ``fn(rank, world_size, *args)`` and re-raises the first failure in
the parent with the rank's traceback. The parent watches its children: a crashed rank fails the
test instead of hanging the others. ``fn`` must be a module-level (picklable) function.

Spawning costs ~5 s for 2 ranks and ~11 s for 4 (mostly ``import torch``): put many assertions
in one spawned function.
"""
from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def _worker(fn, rank, world_size, init_file, queue, args, backend="gloo"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=120))
        result = fn(rank, world_size, *args)
        dist.barrier()  # no rank tears its group down while a peer is still using it
        # By value (plain pickle), not torch's shared-memory handles: a handle points into this
        # process, which may exit before the parent reads it (FileNotFoundError there).
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0,
                    backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    ``backend="nccl"`` (GPU machine only) gives rank r the GPU ``cuda:r``.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, init_file, queue, args, backend),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size:
                if not queue.empty():
                    rank, status, payload = queue.get()
                    if status == "error":
                        raise AssertionError(f"rank {rank} failed:\n{payload}")
                    results[rank] = pickle.loads(payload)
                    continue
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and queue.empty():
                    raise AssertionError(f"a rank died with exit code {dead[0].exitcode}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"distributed test timed out after {timeout}s")
                time.sleep(0.05)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world_size)]
