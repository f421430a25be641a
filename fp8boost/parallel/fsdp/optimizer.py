"""The optimizer ``boost`` returns over an FSDP2 model (``GeminiPlugin``, ``TorchFSDPPlugin``).

FSDP2's sharded FP32 parameters are the master weights, so the user's optimizer, rebuilt on
them, steps them directly (no master copies) and keeps its state sharded 1/dp too. On top of it:
fp16 loss scaling with an overflow check agreed over the shard group, clipping by the norm over
all shards, ``no_sync`` gradient accumulation, the refresh of the FP8 all-gather scales, and a
``state_dict()`` of plain full-size tensors (as ZeRO's, and Colossal-AI's Gemini's) where the
torch optimizer's own holds FSDP2's DTensor shards.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from typing import Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost.parallel.boosted_optimizer import DirectOptimizerProxy
from fp8boost.parallel.zero.loss_scaler import DynamicLossScaler

from .fp8_all_gather import precompute_fp8_all_gather_scales
from .full_state_dict import full_of, shard_like

__all__ = ["FsdpOptimizer"]


class FsdpOptimizer(DirectOptimizerProxy):
    """The user's optimizer over FSDP2's sharded FP32 parameters, plus backward/clipping/no_sync.

    Args:
        optimizer: the user's torch optimizer, already rebuilt on the sharded parameters.
        model: the sharded model (for ``no_sync`` and FP8 all-gather scales).
        max_norm, norm_type: clip the global gradient norm in ``step`` (0: off).
        loss_scaler: dynamic loss scaling (fp16), or None.
        fp8_scales: refresh the FP8 all-gather scales of every weight in one all-reduce after
            each step (``fp8_communication``).
        allow_no_sync: whether ``no_sync`` may skip the reduce-scatter (GeminiPlugin:
            ``enable_gradient_accumulation``).
        group: the shard (dp) process group, over which fp16 overflow checks agree; None for
            a single process.
        comm_device: where the overflow flag is all-reduced (the mesh's device: under CPU
            offload the gradients live on the CPU, but NCCL needs a CUDA tensor).

    Example:
        >>> from fp8boost.booster import Booster                               # doctest: +SKIP
        >>> from fp8boost.plugins import GeminiPlugin                          # doctest: +SKIP
        >>> booster = Booster(plugin=GeminiPlugin(max_norm=1.0))               # doctest: +SKIP
        >>> opt = torch.optim.AdamW(model.parameters())                        # doctest: +SKIP
        >>> model, opt, *_ = booster.boost(model, opt)                         # doctest: +SKIP
        >>> opt.backward(model(**batch).loss); opt.step(); opt.zero_grad()     # doctest: +SKIP
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, max_norm: float = 0.0,
                 norm_type: float = 2.0, loss_scaler: Optional[DynamicLossScaler] = None,
                 fp8_scales: bool = False, allow_no_sync: bool = True, group=None,
                 comm_device: Optional[torch.device] = None) -> None:
        self.optim = optimizer
        self.model = model
        self.group = group  # the shard (dp) group: overflow checks agree across it
        self.comm_device = comm_device
        self.max_norm, self.norm_type = float(max_norm), float(norm_type)
        self.loss_scaler = loss_scaler
        self.fp8_scales = fp8_scales
        self.allow_no_sync = allow_no_sync
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self._unscaled = False  # this step's gradients are unscaled already (fp16)
        self._found_inf = False

    def __repr__(self) -> str:
        return f"FsdpOptimizer({self.optim!r}, max_norm={self.max_norm})"

    # backward: OptimizerProxy's (the non-finite guard sees the loss, fp16 scales it)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no reduce-scatter) inside the block."""
        if not self.allow_no_sync:
            raise ValueError("gradient accumulation with no_sync needs "
                             "GeminiPlugin(enable_gradient_accumulation=True)")
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def _unscale(self) -> bool:
        """Unscale fp16 gradients once per step; True when every rank's gradients are finite."""
        if self.loss_scaler is None:
            return True
        if self._unscaled:  # clip_grad_norm_ ran first: keep its verdict
            return not self._found_inf
        grads = self._grads()
        inv = 1.0 / self.loss_scaler.scale
        device = self.comm_device or self.params[0].device
        bad = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            local = g._local_tensor if hasattr(g, "_local_tensor") else g
            local.mul_(inv)
            bad = torch.maximum(bad, (~torch.isfinite(local)).any().float().to(device))
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        self._unscaled = True
        self._found_inf = bool(bad.item())
        return not self._found_inf

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over all shards (DTensor gradients); returns the norm before."""
        if not self._unscale() or self.guard_skips_step():
            norm = torch.tensor(math.inf)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, norm_type)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.record_grad_norm(norm, norm_type)
        return norm

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the (unscaled) local gradient shards: the bound is elementwise, so each rank
        clamps its own shard."""
        if not self._unscale():
            return  # fp16 overflow: the step skips these gradients anyway
        for g in self._grads():
            local = g._local_tensor if hasattr(g, "_local_tensor") else g
            local.clamp_(-clip_value, clip_value)

    def step(self, closure=None) -> None:
        ok = self._unscale()
        if self.guard_skips_step():  # the same verdict on every rank: nobody steps
            self.optim.zero_grad(set_to_none=True)
            ok = False
        if ok:
            if self.max_norm > 0:  # reads this step's verdict: the gradients are checked once
                self.clip_grad_norm_(self.max_norm, self.norm_type)
            self.optim.step(closure)
        self.forget_guard_verdict()
        if self.loss_scaler is not None:
            self.loss_scaler.update(not ok)
        self._unscaled = False
        if self.fp8_scales:
            precompute_fp8_all_gather_scales(self.model)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
        self._unscaled = False
        self.forget_guard_verdict()

    # ------------------------------------------------------------------------- state dicts
    def state_dict(self, only_rank_0: Optional[bool] = None) -> dict:
        """torch's layout (``state`` by parameter index, ``param_groups``; ``"loss_scaler"``
        under fp16) with every DTensor state gathered into a plain tensor at the parameter's
        full shape, on the device of its shard: what a torch optimizer over the unsharded
        model holds, and what Colossal-AI's scripts compare and ``torch.save``.

        Collective over the shard group: every rank calls it (checkpoints go through
        ``booster.save_optimizer``, which writes each rank's shards instead).

        Args:
            only_rank_0: Colossal-AI's ``GeminiOptimizer`` argument (default True there):
                ranks other than 0 still gather but keep no state (``state`` is empty); False
                gives every rank the whole state. Given either way, the dict has Colossal-AI's
                two keys only, as its ``GeminiOptimizer.state_dict`` returns (its tests compare
                the key count with a torch optimizer's); left out (torch's call), every rank
                gets the whole state and, under fp16, ``"loss_scaler"`` too, so that
                ``load_state_dict`` restores the scale.
        """
        out = super().state_dict()
        if only_rank_0 is not None:
            out = {"state": out["state"], "param_groups": out["param_groups"]}
        state = {}
        for index in sorted(out["state"]):  # sorted: the same gathers in the same order on
            entry = out["state"][index]       # every rank
            state[index] = {key: full_of(entry[key]) for key in sorted(entry)}
        if only_rank_0 and dist.is_initialized() and dist.get_rank() != 0:
            state = {}
        return {**out, "state": state}

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Load :meth:`state_dict`'s layout: each plain tensor at its parameter's full shape is
        cut to this rank's shard (locally: nothing is communicated); DTensors (the torch
        optimizer's own ``state_dict()``) and the rest (``step``) load as they are."""
        params = {}  # saved index -> parameter, paired by position as torch's load pairs them
        saved = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        for index, param in zip(saved, self.params):
            params[index] = param
        state = {}
        for index, entry in state_dict["state"].items():
            param = params.get(index)
            state[index] = {key: shard_like(value, param) if key != "step" else value
                            for key, value in entry.items()}
        super().load_state_dict({**state_dict, "state": state})
