"""Bucketed collectives of the ZeRO optimizer: gradient reduction and parameter all-gather.

Gradients are packed into flat buckets of about ``bucket_numel`` elements (one bucket per
dtype/device) and reduced with one collective per bucket:

* stage 1: all-reduce of the concatenated full gradients; every rank gets the averaged full
  gradient back in ``param.grad`` (ZeRO-1 keeps gradients replicated);
* stage 2: reduce-scatter of a ``[world, S]`` bucket whose row ``r`` holds rank ``r``'s chunk of
  every parameter in the bucket, so each rank receives exactly its own chunks (ZeRO-2 keeps
  only 1/world of the gradients; ``param.grad`` is freed as soon as it is packed).

With ``overlap`` a bucket is launched (asynchronously) from the post-accumulate-grad hook the
moment it fills, so communication runs while autograd computes the remaining gradients; the
last, partial bucket is launched and everything is waited for in ``flush()`` at the end of
backward. At most ``MAX_IN_FLIGHT`` buckets are in flight: launching one more first finishes the
oldest, so bucket buffers never add up to a full copy of the gradients (ZeRO-2's point).

Sums are taken by the collective (SUM: gloo has no AVG) and divided by ``world`` in FP32.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .direct_blocks import cast_block_chunk, receive_block
from .sharding import ParamShard, copy_gathered, padded_rows


class Collectives:
    """The three collectives ZeRO needs, plain or FP8 (``fp8boost.parallel.fp8_comm``).

    All calls are asynchronous and return a handle with ``wait()``.
    """

    def __init__(self, group, fp8: bool = False, comm_config=None,
                 fp8_grads: bool = True) -> None:
        self.group = group
        self.fp8 = fp8
        self.fp8_grads = fp8 and fp8_grads  # False: gradients in their own dtype, params FP8
        self.comm_config = comm_config
        self._fp8_comm = None
        if fp8:
            # Imported only when asked for: the FP8 collectives are an optional layer.
            from fp8boost.parallel.comm import collectives as fp8_comm
            self._fp8_comm = fp8_comm

    def _fp8_kwargs(self, role: str) -> dict:
        cfg = self.comm_config
        kw: dict = {"async_op": True, "config": cfg}
        if cfg is not None:
            kw["fp8_dtype"] = cfg.param_dtype if role == "param" else cfg.grad_dtype
        return kw

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor):
        if self.fp8_grads:
            return self._fp8_comm.reduce_scatter_tensor_fp8(
                out, inp, self.group, op="sum", **self._fp8_kwargs("grad"))
        return _reduce_scatter_single(out, inp, self.group)

    def all_reduce(self, tensor: torch.Tensor):
        if self.fp8_grads:
            return self._fp8_comm.all_reduce_fp8(tensor, self.group, op="sum",
                                                 **self._fp8_kwargs("grad"))
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, fp8: bool = True):
        if self.fp8 and fp8:
            return self._fp8_comm.all_gather_into_tensor_fp8(
                out, inp, self.group, **self._fp8_kwargs("param"))
        return _all_gather_single(out, inp, self.group)


# torch >= 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (which now warn).
def _all_gather_single(out, inp, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def _reduce_scatter_single(out, inp, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=True)


def _wait(work) -> None:
    if work is not None:
        work.wait()


MAX_IN_FLIGHT = 2


class GradReducer:
    """Packs ready gradients into buckets and reduces them (see module docstring).

    Args:
        params: the working parameters, in global index order.
        shards: this rank's ``ParamShard`` of each parameter.
        world: data-parallel world size (> 1).
        stage: 1 (all-reduce) or 2 (reduce-scatter).
        bucket_numel: launch a bucket once it holds this many (padded) elements.
        overlap: launch full buckets from the hook instead of waiting for ``flush()``.
        comm: the collectives to use.
        accumulate: stage 2 callback ``fn(index, reduced_chunk_fp32)`` adding a (already
            averaged) chunk into the optimizer's FP32 gradient shard.
    """

    def __init__(self, params: list[torch.Tensor], shards: list[ParamShard], world: int,
                 stage: int, bucket_numel: int, overlap: bool, comm: Collectives,
                 accumulate: Callable[[int, torch.Tensor], None]) -> None:
        self.params, self.shards, self.world, self.stage = params, shards, world, stage
        self.bucket_numel, self.overlap, self.comm = bucket_numel, overlap, comm
        self.accumulate = accumulate
        self._open: dict[tuple, list[int]] = {}
        self._open_numel: dict[tuple, int] = {}
        self._closed: list[tuple[tuple, list[int]]] = []  # full buckets waiting for flush()
        self._pending: list[tuple] = []

    def mark_ready(self, index: int) -> None:
        """Queue a parameter whose gradient is final for this backward."""
        grad = self.params[index].grad
        if grad is None or self.shards[index].numel == 0:
            return
        key = (grad.dtype, grad.device)
        self._open.setdefault(key, []).append(index)
        self._open_numel[key] = self._open_numel.get(key, 0) + self.shards[index].chunk * self.world
        if self._open_numel[key] >= self.bucket_numel:
            items = self._open.pop(key)
            self._open_numel.pop(key)
            if self.overlap:
                self._launch(key, items)
            else:
                self._closed.append((key, items))

    def flush(self) -> None:
        """Launch every queued gradient, wait for all reductions and apply their results."""
        closed, self._closed = self._closed, []
        for key, items in closed:
            self._launch(key, items)
        for key in list(self._open):
            self._open_numel.pop(key)
            self._launch(key, self._open.pop(key))
        while self._pending:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, items, buf = self._pending.pop(0)
        _wait(work)
        if self.stage == 1:
            self._unpack_all_reduce(items, buf)
        else:
            self._unpack_reduce_scatter(items, buf)

    def _launch(self, key: tuple, items: list[int]) -> None:
        if not items:
            return
        while len(self._pending) >= MAX_IN_FLIGHT:
            self._finish_oldest()
        dtype, device = key
        if self.stage == 1:
            flat = torch.cat([self.params[i].grad.reshape(-1) for i in items])
            self._pending.append((self.comm.all_reduce(flat), items, flat))
            return
        total = sum(self.shards[i].chunk for i in items)
        flat = torch.empty(self.world, total, dtype=dtype, device=device)
        off = 0
        for i in items:
            s, p = self.shards[i], self.params[i]
            padded_rows(p.grad.reshape(-1), s.chunk, self.world, flat[:, off:off + s.chunk])
            off += s.chunk
            p.grad = None  # ZeRO-2: the full gradient is not kept once packed
        out = torch.empty(total, dtype=dtype, device=device)
        self._pending.append((self.comm.reduce_scatter(out, flat.view(-1)), items, (out, flat)))

    def _unpack_all_reduce(self, items: list[int], flat: torch.Tensor) -> None:
        off = 0
        for i in items:
            g = self.params[i].grad
            n = g.numel()
            # Divide in FP32 so a non-power-of-two world size does not round twice.
            g.copy_((flat[off:off + n].float() / self.world).view_as(g))
            off += n

    def _unpack_reduce_scatter(self, items: list[int], bufs: tuple) -> None:
        out, _ = bufs
        off = 0
        for i in items:
            c = self.shards[i].chunk
            self.accumulate(i, out[off:off + c].float().div_(self.world))
            off += c


def all_gather_params(params: list[torch.Tensor], shards: list[ParamShard],
                      masters: list[torch.Tensor], world: int, bucket_numel: int,
                      comm: Optional[Collectives], fp8_mask: Optional[list[bool]] = None,
                      direct=None, defer: bool = False) -> Optional["LaunchedGathers"]:
    """Write the updated master chunks back into the (replicated) working parameters.

    ``fp8_mask[i]`` says whether parameter ``i`` travels in FP8 (when ``comm`` is an FP8 one);
    the others go in their own dtype. ``direct`` (a
    :class:`~fp8boost.parallel.zero.direct_plan.ZeroDirectPlan`) names FP8 weights whose bytes
    also feed their ``Fp8Linear`` directly: one all-reduce(MAX) of all their amaxes first, then
    one scale per weight and plain uint8 buckets. Buckets are double-buffered: bucket k+1 is in
    flight while bucket k is unpacked, so at most two buckets of gathered parameters exist at once.

    ``defer`` (``overlap_allgather``, several ranks): launch every bucket and return them as
    :class:`LaunchedGathers`, unpacked later (all buckets' buffers exist at once: the model's
    parameters once more, in their wire dtype). Otherwise returns None, everything written.
    """
    with torch.no_grad():
        if world == 1:
            for p, s, m in zip(params, shards, masters):
                # copy_ on the Parameter itself bumps its version: FP8 weight caches see it.
                p.copy_(m[: s.numel].view(s.shape))
            return None
        fp8 = comm.fp8 and fp8_mask is not None
        kinds = [_fp8_kind(i, direct) if fp8 and fp8_mask[i] else "plain"
                 for i in range(len(params))]
        scales = None
        if "direct" in kinds:  # every direct weight's global amax, in ONE all-reduce
            dev = params[direct.weights[0].index].device
            scales = direct.global_scales(masters, dev, comm.group)
        ctx = _GatherCtx(params, shards, masters, world, comm, kinds, direct, scales)
        if defer:
            return LaunchedGathers([_launch_gather(bucket, ctx) for bucket in _gather_buckets(
                params, shards, kinds, world, bucket_numel, together=True)], ctx)
        in_flight: deque = deque()
        for bucket in _gather_buckets(params, shards, kinds, world, bucket_numel):
            in_flight.append(_launch_gather(bucket, ctx))
            if len(in_flight) > 1:
                _finish_gather(in_flight.popleft(), ctx)
        while in_flight:
            _finish_gather(in_flight.popleft(), ctx)
    return None


class LaunchedGathers:
    """The buckets of one post-step all-gather, launched and not yet unpacked.

    :meth:`finish` unpacks them in launch order, which is parameter order (about the order of
    the forward), so waiting for one parameter's bucket also unpacks the buckets before it.
    """

    def __init__(self, entries: list, ctx: "_GatherCtx") -> None:
        self._entries, self._ctx = deque(entries), ctx
        self._bucket_of = {i: n for n, (_, items, _, _) in enumerate(entries) for i in items}
        self._done = 0

    @property
    def pending(self) -> bool:
        """Whether any bucket is still to unpack."""
        return bool(self._entries)

    def finish(self, indices: Optional[list[int]] = None) -> None:
        """Wait for and unpack the buckets holding parameters ``indices`` and every bucket
        launched before them (all buckets when None)."""
        if indices is None:
            last = self._done + len(self._entries) - 1
        else:
            last = max((self._bucket_of.get(i, -1) for i in indices), default=-1)
        with torch.no_grad():
            while self._entries and self._done <= last:
                _finish_gather(self._entries.popleft(), self._ctx)
                self._done += 1


def _fp8_kind(i: int, direct) -> str:
    """``direct`` (one scale per weight, shared), ``block`` (bytes + block scales per chunk,
    see ``direct_blocks.py``) or ``fp8`` (the regular FP8 gather, decoded)."""
    if direct is not None and i in direct.slot:
        return "direct"
    return "block" if direct is not None and i in direct.block_slot else "fp8"


def _width(i: int, ctx: "_GatherCtx") -> int:
    """Wire elements of parameter ``i`` per rank (a block weight adds its scales' bytes)."""
    if ctx.kinds[i] == "block":
        return ctx.direct.block_slot[i].wire_numel
    return ctx.shards[i].chunk


class _GatherCtx:
    """What every bucket of one ``all_gather_params`` call shares."""

    def __init__(self, params, shards, masters, world, comm, kinds, direct, scales) -> None:
        self.params, self.shards, self.masters, self.world = params, shards, masters, world
        self.comm, self.kinds, self.direct, self.scales = comm, kinds, direct, scales
        self.rank = dist.get_rank(comm.group) if direct is not None else 0


def _gather_buckets(params, shards, kinds, world, bucket_numel, together: bool = False):
    """Parameter indices per bucket (one dtype, device and kind each), in launch order.

    A ``direct`` weight is a bucket of its own: its all-gather writes straight into the weight's
    persistent FP8 buffer (:meth:`ZeroDirectPlan.gather_buffers`), so no bytes are copied out
    of a shared bucket afterwards (on 4xH200 those per-weight copies cost LLaMA2-7B ~27 ms a
    step). A 7B weight is 16-45 MB of FP8: one collective each runs at bandwidth.

    ``together`` (the overlapped gather): when one bucket fills (direct weights count towards
    it), the open buckets of the other kinds go with it, oldest first. Launch order then follows
    parameter order: the forward of the first block does not wait behind a bucket of small
    tensors (biases, norms) that would otherwise fill only at the end of the model (NCCL runs
    collectives in launch order).
    """
    buckets: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    since_flush = 0  # together: elements launched or collected since the open buckets went
    for i, p in enumerate(params):
        if shards[i].numel == 0:
            continue
        if kinds[i] == "direct":
            since_flush += shards[i].chunk * world
            if together and since_flush >= bucket_numel:
                yield from sorted(buckets.values(), key=lambda b: b[0])
                buckets.clear()
                sizes.clear()
                since_flush = 0
            yield [i]
            continue
        key = (p.dtype, p.device, kinds[i])
        buckets.setdefault(key, []).append(i)
        sizes[key] = sizes.get(key, 0) + shards[i].chunk * world
        since_flush += shards[i].chunk * world
        if sizes[key] < bucket_numel and not (together and since_flush >= bucket_numel):
            continue
        if together:
            yield from sorted(buckets.values(), key=lambda b: b[0])
            buckets.clear()
            sizes.clear()
            since_flush = 0
        else:
            yield buckets.pop(key)
            sizes.pop(key)
    yield from sorted((b for b in buckets.values() if b), key=lambda b: b[0])


def _launch_gather(items: list[int], ctx: _GatherCtx):
    p0 = ctx.params[items[0]]
    kind = ctx.kinds[items[0]]
    total = sum(_width(i, ctx) for i in items)
    if kind == "block":  # FP8 bytes + block scales, cast per chunk: plain uint8 on the wire
        inp = torch.empty(total, dtype=torch.uint8, device=p0.device)
        off = 0
        for i in items:
            w = ctx.direct.block_slot[i]
            cast_block_chunk(w, ctx.masters[i][: ctx.shards[i].length], inp[off:off + w.wire_numel])
            off += w.wire_numel
        out = torch.empty(ctx.world * total, dtype=torch.uint8, device=p0.device)
        return ctx.comm.all_gather(out, inp, fp8=False), items, out, total
    if kind == "direct":  # FP8 with the weight's global scale, cast into its own slot
        (i,) = items  # a bucket of its own (_gather_buckets)
        out, inp = ctx.direct.gather_buffers(i, p0, ctx.shards[i].chunk, ctx.world, ctx.rank)
        ctx.direct.cast_chunk(i, ctx.masters[i], ctx.scales, inp)
        # In place (input = this rank's slot of the output): plain uint8 on the wire.
        return ctx.comm.all_gather(out, inp, fp8=False), items, out, total
    # FP8 on the wire: quantize straight from the FP32 masters (no BF16 double rounding).
    in_dtype = ctx.masters[items[0]].dtype if kind == "fp8" else p0.dtype
    inp = torch.empty(total, dtype=in_dtype, device=p0.device)
    off = 0
    for i in items:
        c = ctx.shards[i].chunk
        inp[off:off + c].copy_(ctx.masters[i], non_blocking=True)
        off += c
    out = torch.empty(ctx.world * total, dtype=p0.dtype, device=p0.device)
    return ctx.comm.all_gather(out, inp, fp8=kind == "fp8"), items, out, total


def _finish_gather(entry, ctx: _GatherCtx) -> None:
    work, items, out, total = entry
    _wait(work)
    rows = out.view(ctx.world, total)
    off = 0
    for i in items:
        s = ctx.shards[i]
        if ctx.kinds[i] == "block":
            w = ctx.direct.block_slot[i]
            receive_block(w, rows[:, off:off + w.wire_numel], ctx.params[i])
            off += w.wire_numel
            continue
        param = ctx.params[i]
        if ctx.kinds[i] == "direct":  # the bytes already sit in the weight's buffer
            ctx.direct.receive(i, param, ctx.scales)
        elif param.is_contiguous():  # copy_ on a view bumps the Parameter's version too
            copy_gathered(param.view(-1), rows, off, s.chunk)
        else:
            param.copy_(rows[:, off:off + s.chunk].reshape(-1)[: s.numel].view(s.shape))
        off += s.chunk
