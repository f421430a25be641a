"""Run one pipeline step: micro-batches through ``torch.distributed.pipelining`` schedules.

:class:`PipelineRunner` owns this rank's :class:`~.split.DecoderStage` modules and builds, per
batch shape, the ``PipelineStage`` objects (with static input/output metadata, so torch never
runs a shape-inference forward through FP8 layers) and the schedule:

* ``"1f1b"``: ``Schedule1F1B``; ``"interleaved"``: ``ScheduleInterleaved1F1B``;
  ``"zbv"``: ``ScheduleZBVZeroBubble`` (backward split into input and weight passes).

Gradients: the schedules sum micro-batch gradients; the runner divides every local parameter's
gradient by the micro-batch count once (``scale_grads=False`` in torch: its per-stage scaling
would divide a weight shared by two local stages twice, e.g. tied embeddings in a V), so a
criterion that averages over its micro-batch gives the gradient of the batch mean.

FP8 weights: with several micro-batches, each stage's tensorwise FP8 weights are cast once per
step, before the schedule, and their casts used by every micro-batch's forward and backward,
compiled blocks included (``fp8boost.fp8.cast_once``); they are dropped when the schedule ends.

Criterion: on the last stage, per micro-batch, ``criterion(outputs, inputs)`` gets the HF
output ``make_outputs(logits, inputs)`` builds (``split.CausalLMOutputs``: ``loss`` with labels,
``logits``) and the micro-batch's dict of inputs, and must return that micro-batch's scalar
loss (:func:`check_criterion_loss`). Every criterion is scaled alike: its loss times the FP16
loss scale is what backward starts from, and the gradients are divided by the micro-batch
count as above.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B,
                                          ScheduleZBVZeroBubble)

from fp8boost.fp8.cast_once import weights_cast_once

from .layout import PipelineLayout
from .split import DecoderStage

__all__ = ["PipelineRunner", "check_criterion_loss", "microbatch_count"]


def microbatch_count(batch_size: int, num_microbatches: Optional[int],
                     microbatch_size: Optional[int]) -> int:
    """Micro-batches for a batch of ``batch_size`` rows; raises ``ValueError`` if it does not divide."""
    if num_microbatches is not None:
        if batch_size % num_microbatches:
            raise ValueError(f"batch size {batch_size} is not divisible by num_microbatches="
                             f"{num_microbatches}: use a batch size that is a multiple of it")
        return num_microbatches
    if batch_size % microbatch_size:
        raise ValueError(f"batch size {batch_size} is not divisible by microbatch_size="
                         f"{microbatch_size}: use a batch size that is a multiple of it")
    return batch_size // microbatch_size


def check_criterion_loss(value: Any) -> torch.Tensor:
    """The criterion's return value as a 0-dim loss tensor; ``TypeError`` if it is not one.

    Accepted: a floating-point tensor of one element (a ``[1]``-shaped loss is viewed as 0-dim,
    as ``backward`` would accept it). The usual mistake is returning the whole output, a tuple
    or per-token losses: the schedule would fail later with an error naming none of them.

    Raises:
        TypeError: naming what was returned and what to return instead.
    """
    if torch.is_tensor(value) and value.numel() == 1 and value.is_floating_point():
        return value if value.dim() == 0 else value.reshape(())
    got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if torch.is_tensor(value)
           else f"a {type(value).__name__}")
    raise TypeError(f"execute_pipeline: criterion(outputs, inputs) must return the micro-batch's "
                    f"loss as a scalar floating-point tensor, got {got}; return outputs.loss "
                    f"(or outputs[0], outputs['loss']: the model's HF loss when the batch has "
                    f"'labels'), or reduce your own per-token losses with .mean()")


class PipelineRunner:
    """Runs micro-batched forward (+ backward) passes of this rank's pipeline stages.

    Args:
        modules: this rank's stages (ascending index), from ``build_stage_modules``.
        layout: the pipeline layout.
        group: the pipeline process group (ranks of one replica's stages, in stage order).
        device: where the stages run.
        vocab_local: logits width on the last stage (vocabulary / tp).
        make_outputs: ``make_outputs(logits, inputs)`` -> what the criterion gets as
            ``outputs`` for a micro-batch (``split.CausalLMOutputs``: the model's HF output).
        num_microbatches, microbatch_size: one of them (the other None).
    """

    def __init__(self, modules: list[DecoderStage], layout: PipelineLayout, group,
                 device: torch.device, *, vocab_local: int,
                 make_outputs: Callable[[torch.Tensor, dict], Any],
                 num_microbatches: Optional[int] = None,
                 microbatch_size: Optional[int] = None) -> None:
        self.modules, self.layout, self.group = modules, layout, group
        self.device, self.vocab_local = torch.device(device), vocab_local
        self.make_outputs = make_outputs
        self.num_microbatches, self.microbatch_size = num_microbatches, microbatch_size
        self.rank = dist.get_rank(group)
        self.has_first = modules[0].index == 0
        self.has_last = modules[-1].index == layout.num_stages - 1
        self._schedules: dict[tuple, object] = {}
        self._call: dict = {}
        params, seen = [], set()
        for m in modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        self.params = params

    # ------------------------------------------------------------------------- schedules
    def _meta(self, shape, dtype) -> torch.Tensor:
        # Floating boundary tensors carry gradients: torch >= 2.13 reads requires_grad from
        # these static metadata to decide whether the received buffer gets a gradient.
        return torch.empty(shape, dtype=dtype, device="meta",
                           requires_grad=dtype.is_floating_point)

    def _stage(self, m: DecoderStage, mb: int, seq: int):
        b = m.boundaries
        if m.index == 0:
            inp = self._meta((mb, seq), torch.long)
        else:
            inp = self._meta(*b.wire_meta(m.index - 1, m.act_shape(mb, seq), m.act_dtype))
        if m.index == self.layout.num_stages - 1:
            out = self._meta((mb, seq, self.vocab_local), m.act_dtype)
        else:
            out = self._meta(*b.wire_meta(m.index, m.act_shape(mb, seq), m.act_dtype))
        return PipelineStage(m, m.index, self.layout.num_stages, self.device, input_args=(inp,),
                             output_args=(out,), group=self.group)

    def schedule(self, n: int, mb: int, seq: int):
        """The schedule for ``n`` micro-batches of ``[mb, seq]`` tokens (built once per shape)."""
        key = (n, mb, seq)
        if key not in self._schedules:
            stages = [self._stage(m, mb, seq) for m in self.modules]
            kw = dict(loss_fn=self._loss_fn, scale_grads=False)
            if self.layout.style == "1f1b":
                sched = Schedule1F1B(stages[0], n, **kw)
            elif self.layout.style == "interleaved":
                sched = ScheduleInterleaved1F1B(stages, n, **kw)
            else:
                sched = ScheduleZBVZeroBubble(stages, n, **kw)
            self._schedules[key] = sched
        return self._schedules[key]

    # ------------------------------------------------------------------------------ step
    def _loss_fn(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        call = self._call
        batch, size = call["batch"], call["size"]
        # The schedule splits ``target`` like the inputs: ``rows`` are this micro-batch's rows
        # of the batch, so the criterion sees the micro-batch's own dict of inputs.
        inputs = {k: v[rows] if torch.is_tensor(v) and v.dim() and v.shape[0] == size else v
                  for k, v in batch.items()}
        loss = check_criterion_loss(call["criterion"](self.make_outputs(output, inputs), inputs))
        call["losses"].append(loss.detach().float())
        return loss * call["loss_scale"] if call["loss_scale"] != 1.0 else loss

    def run(self, batch: dict, criterion: Callable, *, backward: bool,
            return_outputs: bool = False, loss_scale: float = 1.0) -> tuple:
        """One step over ``batch``; returns ``(mean loss or None, outputs or None)``.

        The loss and outputs are those of the last stage (None on other ranks). With
        ``backward`` the parameters of this rank's stages hold the gradient of the mean loss.
        """
        ids = batch["input_ids"]
        size, seq = ids.shape
        n = microbatch_count(size, self.num_microbatches, self.microbatch_size)
        if backward and self.layout.style == "1f1b" and n < self.layout.pp:
            raise ValueError(f"pp_style='1f1b' needs at least pp_size={self.layout.pp} "
                             f"micro-batches, got {n} (batch {size} / microbatch_size "
                             f"{self.microbatch_size}): use a larger batch or smaller micro-batches")
        sched = self.schedule(n, size // n, seq) if backward else None
        pos = batch.get("position_ids")
        if pos is None:
            pos = torch.arange(seq, device=ids.device).unsqueeze(0).expand(size, seq)
        kwargs = {"position_ids": pos}
        if batch.get("attention_mask") is not None:
            kwargs["attention_mask"] = batch["attention_mask"]
        args = (ids,) if self.has_first else ()
        target = torch.arange(size, device=ids.device) if self.has_last else None
        self._call = {"batch": batch, "size": size, "criterion": criterion, "losses": [],
                      "loss_scale": float(loss_scale)}
        if not backward:
            try:
                return self._forward_only(args, kwargs, target, n, return_outputs)
            finally:
                self._call = {}
        # Several micro-batches run each stage with the same weights: cast each FP8 weight
        # once for all of them (compiled blocks would cast it in every forward and backward).
        cast_once = weights_cast_once(self.modules) if n > 1 else contextlib.nullcontext()
        try:
            with cast_once:
                out = sched.step(*args, target=target, return_outputs=return_outputs, **kwargs)
            losses = self._call["losses"]
        finally:
            self._call = {}
        if backward and n > 1:
            with torch.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        p.grad.div_(n)
        loss = torch.stack(losses).mean() if self.has_last and losses else None
        return loss, (out if self.has_last and return_outputs else None)

    def _forward_only(self, args, kwargs, target, n: int, return_outputs: bool) -> tuple:
        """Evaluation: every micro-batch through the stages in order, no schedule, no graph.

        Each rank runs its stages in ascending order, all micro-batches of one stage before the
        next. Receives block, sends do not (isend, waited at the end): a receive only waits for
        an earlier stage, so no mapping of stages to ranks can deadlock, including the loop of
        interleaved stages back to rank 0 (torch 2.13's ``eval()`` of the ZB-V schedule still
        tries to pass gradients between its local stages, so it is not used).
        """
        split = lambda t: list(torch.tensor_split(t, n))  # noqa: E731
        args_mb = [split(a) for a in args]
        kw_mb = {k: split(v) for k, v in kwargs.items()}
        rows = split(target) if target is not None else None
        local: dict[tuple, torch.Tensor] = {}
        outputs, sends = [], []
        with torch.no_grad():
            for m in self.modules:
                for i in range(n):
                    kw = {k: v[i] for k, v in kw_mb.items()}
                    inp = (args_mb[0][i],) if m.index == 0 else (self._receive(m, i, local, kw),)
                    out = m(*inp, **kw)
                    if m.index == self.layout.num_stages - 1:
                        self._loss_fn(out, rows[i])
                        if return_outputs:
                            outputs.append(out)
                    elif self.layout.rank_of(m.index + 1) == self.rank:
                        local[(m.index + 1, i)] = out
                    else:
                        peer = self.layout.rank_of(m.index + 1)
                        buf = out.contiguous()
                        sends.append((dist.isend(buf, dist.get_global_rank(self.group, peer),
                                                 group=self.group), buf))
            for work, _ in sends:
                work.wait()
        losses = self._call["losses"]
        loss = torch.stack(losses).mean() if self.has_last and losses else None
        return loss, (torch.cat(outputs) if outputs else None)

    def _receive(self, m: DecoderStage, i: int, local: dict, kw: dict) -> torch.Tensor:
        if (m.index, i) in local:
            return local.pop((m.index, i))
        mb, seq = kw["position_ids"].shape
        shape, dtype = m.boundaries.wire_meta(m.index - 1, m.act_shape(mb, seq), m.act_dtype)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        peer = self.layout.rank_of(m.index - 1)
        dist.recv(buf, dist.get_global_rank(self.group, peer), group=self.group)
        return buf

    def broadcast_loss(self, loss: Optional[torch.Tensor]) -> torch.Tensor:
        """The last stage's loss on every rank of the pipeline group (one tiny broadcast)."""
        buf = loss.detach().float().clone() if loss is not None else \
            torch.zeros((), dtype=torch.float32, device=self.device)
        buf = buf.to(self.device)
        dist.broadcast(buf, dist.get_global_rank(self.group, self.layout.last_rank),
                       group=self.group)
        return buf
