"""DDP communication hook: gradient averaging with FP8 (e5m2 by default) on the wire.

``fp8_allreduce_hook`` replaces DDP's bucket all-reduce by :func:`all_reduce_fp8` (FP8
reduce-scatter + FP8 all-gather, FP32 sums) with ``op="avg"``. Every rank decodes the same
bytes, so the averaged gradients, and hence the replicas, stay bit-identical across ranks.
Buckets below ``config.min_numel`` use the plain all-reduce (logged once).

On CUDA the hook runs on a side stream (one per device, kept in the state) so the casts and
collectives overlap the rest of backward, as DDP's own all-reduce does; the returned future
carries the stream's completion to DDP. On CPU it runs inline.

Works with any torch that has ``DistributedDataParallel.register_comm_hook`` and
``GradBucket.buffer()`` (1.10+; tested on 2.13 CPU/gloo).
"""
# No ``from __future__ import annotations``: DDP compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, not strings.
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..comm.config import Fp8CommConfig
from ..comm.collectives import all_reduce_fp8

__all__ = ["Fp8CommHookState", "fp8_allreduce_hook", "register_fp8_comm_hook"]


@dataclass
class Fp8CommHookState:
    """State of :func:`fp8_allreduce_hook`: the process group and the FP8 comm config.

    Attributes:
        group: process group to average over (None: WORLD).
        config: :class:`Fp8CommConfig`; the wire format is ``config.grad_dtype``.
        use_side_stream: on CUDA, run the hook on a side stream to overlap backward.
    """

    group: Optional[Any] = None
    config: Fp8CommConfig = field(default_factory=Fp8CommConfig)
    use_side_stream: bool = True
    _streams: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.config, Fp8CommConfig):
            raise TypeError("Fp8CommHookState.config must be an Fp8CommConfig, got "
                            f"{type(self.config).__name__}")

    def stream(self, device: torch.device) -> "torch.cuda.Stream":
        """The side stream of a CUDA device (created on first use)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]


def fp8_allreduce_hook(state: Optional[Fp8CommHookState],
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook averaging each gradient bucket with FP8 on the wire.

    Args:
        state: an :class:`Fp8CommHookState`, or None for WORLD and the default config.
        bucket: the DDP gradient bucket.

    Returns:
        A future completed with the averaged (in place) bucket buffer.

    Example:
        >>> from torch.nn.parallel import DistributedDataParallel as DDP      # doctest: +SKIP
        >>> ddp = DDP(model)                                                  # doctest: +SKIP
        >>> ddp.register_comm_hook(Fp8CommHookState(), fp8_allreduce_hook)    # doctest: +SKIP
    """
    if state is None:
        state = Fp8CommHookState()
    if not isinstance(state, Fp8CommHookState):
        raise TypeError("fp8_allreduce_hook state must be an Fp8CommHookState or None, got "
                        f"{type(state).__name__}")
    buf = bucket.buffer()
    cfg = state.config
    if buf.is_cuda and state.use_side_stream:
        side = state.stream(buf.device)
        side.wait_stream(torch.cuda.current_stream(buf.device))
        with torch.cuda.stream(side):
            all_reduce_fp8(buf, state.group, op="avg", fp8_dtype=cfg.grad_dtype, config=cfg)
            # Completing the future here records an event on the side stream; DDP's wait()
            # makes its stream wait for it.
            fut = torch.futures.Future(devices=[buf.device])
            fut.set_result(buf)
        return fut
    all_reduce_fp8(buf, state.group, op="avg", fp8_dtype=cfg.grad_dtype, config=cfg)
    fut = torch.futures.Future(devices=[buf.device]) if buf.is_cuda else torch.futures.Future()
    fut.set_result(buf)
    return fut


def register_fp8_comm_hook(ddp_model: "torch.nn.parallel.DistributedDataParallel", group=None,
                           config: Optional[Fp8CommConfig] = None) -> Fp8CommHookState:
    """Register :func:`fp8_allreduce_hook` on a DDP model; returns the hook state.

    Example:
        >>> state = register_fp8_comm_hook(ddp, config=Fp8CommConfig(min_numel=0))  # doctest: +SKIP
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("register_fp8_comm_hook needs a DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}")
    if group is None:  # average over the group DDP itself reduces over
        group = getattr(ddp_model, "process_group", None)
    state = Fp8CommHookState(group=group, config=config or Fp8CommConfig())
    ddp_model.register_comm_hook(state, fp8_allreduce_hook)
    return state
