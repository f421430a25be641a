"""Where this process runs in the training example (``train_llama.py``): its rank and device
from torchrun's environment, joining the process group, and the one small collective that
combines per-rank numbers for the log.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank_and_device(device_arg: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment (0, 1 as plain python); the
    GPU is ``cuda:LOCAL_RANK`` when CUDA is used."""
    if device_arg == "cuda" and not torch.cuda.is_available():
        # Checked before set_device, which fails with an AttributeError on a CPU-only torch.
        raise ValueError("--device cuda but no CUDA device is visible (torch "
                         f"{torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
                         "use --device cpu or auto")
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world_size, device


def start_process_group(world_size: int, device: torch.device) -> None:
    """Join torchrun's process group (NCCL on GPU, gloo on CPU) with a timeout, so a crashed
    peer ends the job instead of hanging it. The library's ``init_distributed`` also re-forms
    the group after a ``torchrun --max-restarts`` restart (a store prefix per attempt)."""
    from fp8boost.plugins import init_distributed

    init_distributed("nccl" if device.type == "cuda" else "gloo", timeout_s=600.0,
                     device=device if device.type == "cuda" else None)


def reduce_mean_max(values: list[float], maxima: list[float], world_size: int,
                    device: torch.device) -> tuple[list[float], list[float]]:
    """Mean of ``values`` and max of ``maxima`` over ranks, in one small collective."""
    if world_size == 1:
        return values, maxima
    comm_device = device if device.type == "cuda" else torch.device("cpu")
    t = torch.tensor(values + maxima, dtype=torch.float64, device=comm_device)
    gathered = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(gathered, t)
    stacked = torch.stack(gathered)
    n = len(values)
    return stacked[:, :n].mean(0).tolist(), stacked[:, n:].max(0).values.tolist()
