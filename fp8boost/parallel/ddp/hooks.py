"""DDP communication hook: gradient averaging with FP8 (e5m2 by default) on the wire.

``fp8_allreduce_hook`` replaces DDP's bucket all-reduce by :func:`all_reduce_fp8` (FP8
reduce-scatter + FP8 all-gather, FP32 sums) with ``op="avg"``. Every rank decodes the same
bytes, so the averaged gradients, and hence the replicas, stay bit-identical across ranks.
Buckets below ``config.min_payload_numel`` use the plain all-reduce (logged once).

On CUDA the hook runs on a side stream (one per device, kept in the state) so the casts and
collectives overlap the rest of backward, as DDP's own all-reduce does; the returned future
carries the stream's completion to DDP. On CPU it runs inline.

First step of a new DDP model (bit-exact resume): DDP reduces the first backward of a new model
in one bucket per dtype, then rebuilds its buckets in the order the gradients became ready
(before the second forward; the third with ``static_graph``). The FP8 all-reduce's bits depend
on the bucket it is given, so a resumed model's first step reduced differently from the
uninterrupted run, already on the rebuilt buckets. :func:`register_fp8_comm_hook` therefore
reduces each not-yet-rebuilt bucket as the buckets DDP is about to rebuild (see
:class:`_RebuiltLayout`): every step reduces in the same buckets, the first one included.

Works with any torch that has ``DistributedDataParallel.register_comm_hook`` and
``GradBucket.buffer()`` (1.10+; tested on 2.13 CPU/gloo); the first-step layout needs
``Tensor.register_post_accumulate_grad_hook`` (2.1+).
"""
# No ``from __future__ import annotations``: DDP compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, not strings.
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..comm.config import Fp8CommConfig
from ..comm.collectives import all_reduce_fp8

logger = logging.getLogger(__name__)

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
    # Set by register_fp8_comm_hook: reduces pre-rebuild buckets in the rebuilt layout.
    _layout: Optional["_RebuiltLayout"] = field(default=None, repr=False, compare=False)

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
    pieces = state._layout.split(bucket, state.group) if state._layout is not None else None
    if buf.is_cuda and state.use_side_stream:
        side = state.stream(buf.device)
        side.wait_stream(torch.cuda.current_stream(buf.device))
        with torch.cuda.stream(side):
            _reduce(buf, pieces, state)
            # Completing the future here records an event on the side stream; DDP's wait()
            # makes its stream wait for it.
            fut = torch.futures.Future(devices=[buf.device])
            fut.set_result(buf)
        return fut
    _reduce(buf, pieces, state)
    fut = torch.futures.Future(devices=[buf.device]) if buf.is_cuda else torch.futures.Future()
    fut.set_result(buf)
    return fut


def _reduce(buf: torch.Tensor, pieces: Optional[list], state: Fp8CommHookState) -> None:
    """Average ``buf`` in place, or each group of its gradient views in ``pieces`` as one flat
    tensor (the bucket DDP will rebuild them into: same bytes, scales and chunks)."""
    cfg = state.config
    if pieces is None:
        all_reduce_fp8(buf, state.group, op="avg", fp8_dtype=cfg.grad_dtype, config=cfg)
        return
    for grads in pieces:
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce_fp8(flat, state.group, op="avg", fp8_dtype=cfg.grad_dtype, config=cfg)
        for g, r in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(r.view_as(g))


class _RebuiltLayout:
    """Reduces DDP's buckets from before its bucket rebuild as the buckets it rebuilds into.

    Why: the FP8 all-reduce of a bucket depends on the bucket, not only on each gradient: a
    scale is shared by a whole chunk, each rank adds its own chunk in full precision and the
    others' in FP8 (so which rank's slice holds an element changes its bits), and buckets
    below ``min_payload_numel`` go plain. DDP reduces a new model's first backward in one
    bucket per dtype and then rebuilds its buckets in gradient-ready order, so without this the
    first step after a resume reduced differently from the uninterrupted run's same step.

    Why this fix (cost): after the first step it does nothing (its hooks are removed); the first
    step costs one gather and one scatter copy of the gradients and a broadcast of a few ints.
    The alternatives cost every step: a layout-independent hook needs per-parameter ownership
    and scales (a permuting copy of each bucket and back, about twice the gradient bytes of
    extra memory traffic, and per-parameter amaxes), and DDP only skips its rebuild with
    ``find_unused_parameters=True`` (a graph walk and an extra all-reduce every step); forcing
    an early rebuild (``reducer._push_all_rebuilt_params``) buckets in parameter order, which
    puts the gradients ready last (the embedding) in bucket 0, and DDP launches buckets in
    order, so no reduction would overlap backward.

    How: a post-accumulate-grad hook on every parameter records the ready order of the
    current backward. A bucket DDP has not rebuilt yet is split as DDP's rebuild will split it:
    torch's own ``_compute_bucket_assignment_by_size`` over rank 0's ready order (DDP
    broadcasts rank 0's too) with DDP's rebuild size limits. The first rebuilt buckets are
    checked against that prediction (a warning if torch bucketed otherwise); then the hooks are
    removed. Not installed where DDP never rebuilds (``find_unused_parameters`` without
    ``static_graph``) or where nothing travels (one rank).
    """

    def __init__(self, ddp: "torch.nn.parallel.DistributedDataParallel") -> None:
        self._ddp = weakref.ref(ddp)
        self._limits = self._rebuild_limits(ddp)
        self._pos: dict[int, int] = {}  # id(param) -> its place in this backward's ready order
        self._predicted: dict[tuple, bool] = {}  # rebuilt bucket (param ids) -> seen rebuilt
        self._done = False
        self._handles = [p.register_post_accumulate_grad_hook(self._ready)
                         for p in ddp.module.parameters() if p.requires_grad]

    @classmethod
    def install(cls, ddp, group) -> Optional["_RebuiltLayout"]:
        """A layout for ``ddp``, or None where its buckets never change (or nothing travels)."""
        will_rebuild = ddp.static_graph or not ddp.find_unused_parameters
        if (not will_rebuild or getattr(ddp, "_has_rebuilt_buckets", True)
                or dist.get_world_size(group) == 1
                or not hasattr(torch.Tensor, "register_post_accumulate_grad_hook")):
            return None
        return cls(ddp)

    @staticmethod
    def _rebuild_limits(ddp) -> list[int]:
        """The bucket size limits of DDP's rebuild (C++ ``Reducer::rebuild_buckets``)."""
        cfg = getattr(ddp, "_bucket_config", None)
        if cfg is not None:
            if cfg.per_bucket_bytes_caps:  # bucket_cap_mb_list: rebuilt with the same caps
                return list(cfg.per_bucket_bytes_caps)
            return [cfg.first_bucket_bytes_cap, cfg.bucket_bytes_cap]
        first = (dist._DEFAULT_FIRST_BUCKET_BYTES if getattr(ddp, "bucket_bytes_cap_default",
                                                               False) else ddp.bucket_bytes_cap)
        return [first, ddp.bucket_bytes_cap]

    def _ready(self, param: torch.Tensor) -> None:
        if id(param) in self._pos:  # seen already: a new backward began
            self._pos = {}
        self._pos[id(param)] = len(self._pos)

    def _finish(self) -> None:
        self._done = True
        for h in self._handles:
            h.remove()
        self._handles = []

    def split(self, bucket: dist.GradBucket, group) -> Optional[list[list[torch.Tensor]]]:
        """The gradient views of ``bucket`` grouped as DDP's rebuilt buckets; None: reduce the
        bucket as it is (it is one of them, or DDP has rebuilt, or nothing can be predicted)."""
        if self._done:
            return None
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        ddp = self._ddp()
        rebuilt = ddp is None or getattr(ddp, "_has_rebuilt_buckets", True)
        if key in self._predicted:
            if rebuilt:
                self._predicted[key] = True
                if all(self._predicted.values()):
                    self._finish()
            return None
        if rebuilt:
            if self._predicted:
                logger.warning(
                    "fp8boost DDP FP8 hook: DDP rebuilt its gradient buckets differently from "
                    "the prediction the FP8 hook reduced the first step with, so the first step "
                    "of a new or resumed model reduced in other buckets than later steps "
                    "(resume is not bit-exact); torch %s", torch.__version__)
            self._finish()
            return None
        if any(id(p) not in self._pos for p in params):  # e.g. unused with static_graph
            logger.info("fp8boost DDP FP8 hook: a parameter of bucket %d got no gradient in "
                        "this backward; the first step reduces in DDP's initial bucket",
                        bucket.index())
            self._finish()
            return None
        order = sorted(range(len(params)), key=lambda i: self._pos[id(params[i])])
        # Rank 0's order, as DDP's rebuild takes (all ranks must form the same buckets).
        sent = torch.tensor(order, dtype=torch.int64, device=bucket.buffer().device)
        dist.broadcast(sent, src=dist.get_global_rank(group, 0) if group is not None else 0,
                       group=group)
        order = sent.tolist()
        tensors = [params[i] for i in order]
        last_small = any(os.environ.get(k) == "1" for k in ("DDP_SET_LAST_BUCKET_CAP",
                                                            "TORCH_DDP_SET_LAST_BUCKET_CAP"))
        if last_small:  # as the C++ rebuild does with this variable set
            tensors.reverse()
            order.reverse()
        buckets, _ = dist._compute_bucket_assignment_by_size(tensors, self._limits, [], order)
        for b in buckets:
            self._predicted.setdefault(tuple(id(params[i]) for i in b), False)
        if len(buckets) == 1 and list(buckets[0]) == list(range(len(params))):
            return None
        grads = bucket.gradients()
        return [[grads[i] for i in b] for b in buckets]


def register_fp8_comm_hook(ddp_model: "torch.nn.parallel.DistributedDataParallel", group=None,
                           config: Optional[Fp8CommConfig] = None) -> Fp8CommHookState:
    """Register :func:`fp8_allreduce_hook` on a DDP model; returns the hook state.

    Example:
        >>> cfg = Fp8CommConfig(min_payload_numel=0)
        >>> state = register_fp8_comm_hook(ddp, config=cfg)  # doctest: +SKIP
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("register_fp8_comm_hook needs a DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}")
    if group is None:  # average over the group DDP itself reduces over
        group = getattr(ddp_model, "process_group", None)
    state = Fp8CommHookState(group=group, config=config or Fp8CommConfig())
    ddp_model.register_comm_hook(state, fp8_allreduce_hook)
    # The first step reduces in the buckets DDP rebuilds to (see _RebuiltLayout): same bits
    # as every later step, so a resumed run matches the uninterrupted one.
    state._layout = _RebuiltLayout.install(ddp_model, group)
    return state
