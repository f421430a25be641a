"""ZeRO stage 1/2 optimizer wrapper: low-precision working params, sharded FP32 master state.

Layout per data-parallel rank (``world`` ranks, see ``sharding.py``):

* working parameters (BF16/FP16/FP32) stay replicated in the model, as the user built it;
* FP32 master weights and the wrapped optimizer's state exist only for this rank's chunk of
  each parameter (1/world of the model), optionally on the CPU (``cpu_offload``);
* gradients are reduced in buckets during backward (``buckets.GradReducer``): all-reduced
  (stage 1) or reduce-scattered (stage 2) into FP32 gradient chunks;
* ``step()`` unscales (FP16), checks for overflow on every rank, clips by the global norm,
  steps the wrapped optimizer on the master chunks and all-gathers the updated chunks back into
  the working parameters (in FP8 when ``fp8_communication``).

With ``dp_group=None`` (world 1) no collective is ever issued: the same class is then the plain
mixed-precision "master weights" optimizer used by ``Booster(mixed_precision=...)`` and by DDP.
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from fp8boost import _state
from fp8boost.parallel.boosted_optimizer import OptimizerProxy

from .buckets import Collectives, GradReducer, _all_gather_single, all_gather_params
from .loss_scaler import DynamicLossScaler
from .sharding import ParamShard, make_shard


class ZeroOptimizer(OptimizerProxy):
    """Wrap a torch optimizer so its master weights and state are sharded over ``dp_group``.

    Build the torch optimizer on the model's (already low-precision) parameters, then wrap it.
    Call ``backward(loss)`` (not ``loss.backward()``) so FP16 loss scaling and the end-of-backward
    gradient flush happen; ``step()`` and ``zero_grad()`` as usual.

    Args:
        optimizer: a fresh ``torch.optim.Optimizer`` (no state yet) over the model parameters.
        dp_group: data-parallel process group; None means a single rank (no communication).
        stage: 1 (replicated gradients, all-reduce) or 2 (sharded gradients, reduce-scatter).
        master_weights: keep FP32 master chunks; False steps directly in the parameter dtype.
        overlap_communication: launch gradient buckets during backward as they fill.
        reduce_bucket_numel: bucket size in elements for gradient reduction and param gather.
        max_norm: clip gradients to this global norm at every step (0 disables).
        cpu_offload: keep master chunks and optimizer state on the CPU; the step runs there.
        loss_scaler: a ``DynamicLossScaler`` for FP16 (None for BF16/FP32).
        fp8_communication: all-gather ``fp8_params`` with FP8 payloads (and, with
            ``fp8_reduce_scatter``, reduce gradients with FP8 payloads too).
        fp8_reduce_scatter: with ``fp8_communication``, also reduce gradients as FP8 (e5m2,
            per-chunk scales). Off by default: on NVLink it measured slower (the reason is
            logged once and kept in ``comm_report``); turn it on for slow links.
        comm_config: ``Fp8CommConfig`` passed to the FP8 collectives.
        fp8_params: with ``fp8_communication``, the parameters all-gathered in FP8 (None: all).
            The others are gathered in their own dtype.
        pp_group: pipeline group: the global gradient norm and the FP16 overflow check span
            its stages (each holds different parameters).
        pp_counted_elsewhere: parameters whose gradient another stage also holds and counts
            in the norm (a tied embedding on the last stage): counted once.
        fused_master_step: one rank with FP32 masters and AdamW: update each master from its
            BF16 gradient and write the BF16 parameter in one kernel
            (:mod:`~fp8boost.parallel.zero.fused_step`), instead of copying the gradient to
            FP32 and the master back. True: where it cannot apply, a one-time warning says why
            and the two-pass step runs; None: the same choice without the warning (the
            ``Booster`` default); False: always the two-pass step.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(16, 16).to(torch.bfloat16)
        >>> opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))  # world 1
        >>> opt.backward(model(torch.randn(4, 16, dtype=torch.bfloat16)).float().pow(2).mean())
        >>> opt.step(); opt.zero_grad()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, dp_group=None, stage: int = 2,
                 master_weights: bool = True, overlap_communication: bool = True,
                 reduce_bucket_numel: int = 12 * 1024 * 1024, max_norm: float = 0.0,
                 cpu_offload: bool = False, loss_scaler: Optional[DynamicLossScaler] = None,
                 fp8_communication: bool = False, comm_config=None,
                 fp8_reduce_scatter: bool = False,
                 fp8_params: Optional[Iterable[torch.Tensor]] = None, tp_group=None,
                 tp_replicated: Optional[Iterable[torch.Tensor]] = None, pp_group=None,
                 pp_counted_elsewhere: Optional[Iterable[torch.Tensor]] = None,
                 fused_master_step: Optional[bool] = False) -> None:
        self.validate(optimizer)
        if isinstance(stage, bool) or stage not in (0, 1, 2):
            raise ValueError(f"stage must be 0, 1 or 2, got {stage!r}")
        if not isinstance(reduce_bucket_numel, int) or reduce_bucket_numel < 1:
            raise ValueError(f"reduce_bucket_numel must be a positive int, got {reduce_bucket_numel!r}")
        if not (isinstance(max_norm, (int, float)) and max_norm >= 0):
            raise ValueError(f"max_norm must be >= 0 (0 disables clipping), got {max_norm!r}")
        self.optim = optimizer
        self.dp_group = dp_group
        # dp_world: ranks gradients are averaged over; world: ranks the state is split over
        # (stage 0 keeps whole masters on every rank and only all-reduces gradients).
        self.dp_world = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.world = 1 if stage == 0 else self.dp_world
        self.rank = dist.get_rank(dp_group) if dp_group is not None and stage else 0
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 \
            else None
        tp_ids = {id(p) for p in tp_replicated} if tp_replicated is not None else set()
        # Pipeline stages hold different parameters: the norm and overflow check span them.
        self.pp_group = pp_group if pp_group is not None and dist.get_world_size(pp_group) > 1 \
            else None
        pp_skip = {id(p) for p in pp_counted_elsewhere or ()}
        self.stage, self.master_weights, self.overlap = stage, master_weights, overlap_communication
        self.bucket_numel, self.max_norm, self.cpu_offload = reduce_bucket_numel, float(max_norm), cpu_offload
        self.loss_scaler = loss_scaler
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.shards: list[ParamShard] = [make_shard(i, p, self.world, self.rank)
                                         for i, p in enumerate(self.params)]
        self.masters: list[torch.Tensor] = [self._make_master(p, s)
                                            for p, s in zip(self.params, self.shards)]
        it = iter(self.masters)
        for group in optimizer.param_groups:  # the wrapped optimizer now steps the master chunks
            group["params"] = [next(it) for _ in group["params"]]
        self._grad_shards: list[Optional[torch.Tensor]] = [None] * len(self.params)
        # Norm weight per parameter: a tensor replicated over tp is counted once, not tp times.
        tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        self._norm_weight = [0.0 if id(p) in pp_skip else 1.0 / tp if id(p) in tp_ids else 1.0
                             for p in self.params]  # pp_skip: a tied copy another stage counts
        if fp8_reduce_scatter and not fp8_communication:
            raise ValueError("fp8_reduce_scatter=True needs fp8_communication=True")
        self.comm_report = _comm_report(fp8_communication, fp8_reduce_scatter, self.dp_world)
        self._comm = (Collectives(dp_group, fp8_communication, comm_config,
                                  fp8_grads=fp8_reduce_scatter) if self.dp_world > 1 else None)
        self._reducer = (GradReducer(self.params, self.shards, self.dp_world, max(stage, 1),
                                     reduce_bucket_numel, overlap_communication, self._comm,
                                     self._accumulate) if self.dp_world > 1 else None)
        fp8_ids = None if fp8_params is None else {id(p) for p in fp8_params}
        self.fp8_gather_mask = [fp8_communication and (fp8_ids is None or id(p) in fp8_ids)
                                for p in self.params]
        self._fused = fused_master_step is not False and self._fused_step_applies(
            warn=fused_master_step is True)
        self._grad_mul = 1.0  # the clipping coefficient, applied inside the fused step
        self._sync = True
        self._unsynced_grads = False
        self._prepared = False
        self._found_inf = False
        self._hooks = []
        if self.dp_world > 1:
            for i, p in enumerate(self.params):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    @staticmethod
    def validate(optimizer: torch.optim.Optimizer) -> None:
        """Raise before any communication if ``optimizer`` cannot be wrapped."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if len(optimizer.state) > 0:
            raise ValueError("the optimizer already has state (was it stepped?); build a fresh one "
                             "for boost() and restore state with booster.load_optimizer()")
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError("a parameter appears twice in the optimizer's param_groups; "
                                     "pass each parameter once")
                seen.add(id(p))
                if not p.is_floating_point():
                    raise TypeError(f"optimizer parameters must be floating point, got {p.dtype}")

    def __repr__(self) -> str:
        return (f"ZeroOptimizer(stage={self.stage}, world={self.world}, "
                f"master_weights={self.master_weights}, cpu_offload={self.cpu_offload}, "
                f"optimizer={type(self.optim).__name__})")

    #: set by ``Booster.boost``: skips steps with a NaN/Inf loss or gradient (``parallel/nonfinite``)
    nonfinite_guard = None

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``loss.backward()`` with loss scaling, then finish this backward's gradient reduction."""
        if self.nonfinite_guard is not None:
            self.nonfinite_guard.observe_loss(loss)
        if self.loss_scaler is not None:
            loss = loss * self.loss_scaler.scale
        loss.backward(retain_graph=retain_graph)
        if self._sync and self._reducer is not None:
            self._reducer.flush()

    def reduce_gradients(self) -> None:
        """Reduce over dp every gradient accumulated so far (collective).

        For backward passes that ran under :meth:`no_sync` outside :meth:`backward`, e.g. the
        micro-batches of a pipeline schedule: parameters are queued in index order, so every
        dp rank builds the same buckets.
        """
        if self._reducer is not None:
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    self._reducer.mark_ready(i)
            self._reducer.flush()
        self._unsynced_grads = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside the block.

        The first backward outside the block reduces everything accumulated so far, so
        ``k`` micro-batches under ``no_sync`` plus one outside equal one large batch.
        """
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        self._grad_shards = [None] * len(self.params)
        self._grad_mul = 1.0
        self._prepared = self._found_inf = False
        self._unsynced_grads = False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the (unscaled, averaged) gradients to a global norm over all shards.

        Returns the total norm before clipping (Inf when FP16 gradients overflowed).
        """
        self._prepare_grads()
        if self._found_inf:
            return torch.tensor(float("inf"))
        # The fused step keeps the coefficient aside (its BF16 gradients are scaled in FP32
        # inside the update), so the gradients to measure are the raw ones times it: a second
        # call then sees what the first one left, as with the scaled FP32 copies.
        total = self._global_norm(norm_type) * self._grad_mul
        coef = max_norm / (total + 1e-6)
        if coef < 1.0 and self._fused:
            self._grad_mul *= coef
        elif coef < 1.0:
            for g in self._grad_shards:
                if g is not None:
                    g.mul_(coef)
        return torch.tensor(total)

    def step(self, closure=None) -> None:
        """Reduce (if still pending), unscale, clip, step the master chunks, gather params."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step() takes no closure; compute the loss first")
        self._prepare_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update(self._found_inf)
        if self._found_inf:  # skip the step on every rank alike (found_inf was all-reduced)
            self.zero_grad()
            return
        if self.max_norm > 0:
            self.clip_grad_norm_(self.max_norm)
        if self._fused:
            from .fused_step import fused_adamw_step
            fused_adamw_step(self.optim, self.masters, self._grad_shards, self.params,
                             self._grad_mul)
            self.zero_grad()
            return
        for m, g in zip(self.masters, self._grad_shards):
            m.grad = None if g is None else g.to(device=m.device, dtype=m.dtype)
        self.optim.step()
        for m in self.masters:
            m.grad = None
        all_gather_params(self.params, self.shards, self.masters, self.world,
                          self.bucket_numel, self._comm, self.fp8_gather_mask,
                          direct=self._fp8_direct_plan())
        self.zero_grad()

    # ---------------------------------------------------------------------------- internals
    def _fused_step_applies(self, warn: bool) -> bool:
        from .fused_step import unsupported_reason

        why = unsupported_reason(self.optim) or (
            "the state is sharded over ranks" if self.world > 1 else
            "master_weights=False" if not self.master_weights else
            "cpu_offload=True" if self.cpu_offload else
            "FP16 loss scaling" if self.loss_scaler is not None else None)
        if why is not None and warn:
            _state.warn_once(f"fused-master-step-{why}", "fp8boost: fused_master_step=True does "
                             f"not apply ({why}); using the two-pass master-weight step")
        elif why is not None:  # the default asked for nothing: say it, but only at INFO
            _state.log_once(logging.getLogger("fp8boost.parallel.zero"),
                            f"fused-master-step-auto-{why}", "fp8boost: the fused master step "
                            f"does not apply ({why}); using the two-pass master-weight step",
                            level=logging.INFO)
        return why is None

    def _make_master(self, p: torch.Tensor, s: ParamShard) -> torch.Tensor:
        dtype = torch.float32 if self.master_weights else p.dtype
        device = torch.device("cpu") if self.cpu_offload else p.device
        master = torch.zeros(s.chunk, dtype=dtype, device=device)
        master[: s.length].copy_(p.detach().reshape(-1)[s.start:s.end])
        return master

    def _hook(self, index: int):
        def hook(_param: torch.Tensor) -> None:
            if not self._sync:
                self._unsynced_grads = True
                return
            self._unsynced_grads = False
            self._reducer.mark_ready(index)
        return hook

    def _accumulate(self, index: int, chunk: torch.Tensor) -> None:
        cur = self._grad_shards[index]
        self._grad_shards[index] = chunk if cur is None else cur.add_(chunk)

    def _prepare_grads(self) -> None:
        """Once per step: finish reduction, take FP32 chunks, unscale, detect overflow."""
        if self._prepared:
            return
        if self._unsynced_grads:
            raise RuntimeError("gradients were accumulated under no_sync() but never reduced: run "
                               "the last micro-batch's backward outside no_sync() before step()")
        if self._reducer is not None:
            self._reducer.flush()  # no-op after optimizer.backward(); needed after loss.backward()
        if self.world == 1 or self.stage == 1:
            for i, (p, s) in enumerate(zip(self.params, self.shards)):
                if p.grad is not None:  # the fused step reads the BF16 gradient itself
                    self._grad_shards[i] = (p.grad.detach().reshape(-1) if self._fused
                                            else self._chunk_of(p.grad, s))
        grads = [g for g in self._grad_shards if g is not None]
        if self.loss_scaler is not None:
            inv = 1.0 / self.loss_scaler.scale
            found = torch.zeros((), dtype=torch.float32, device=self._comm_device())
            for g in grads:
                found = torch.maximum(found, (~torch.isfinite(g)).any().to(found))
                g.mul_(inv)
            if self.dp_world > 1:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.dp_group)
            if self.tp_group is not None:  # tp ranks hold different shards: skip alike
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.tp_group)
            if self.pp_group is not None:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.pp_group)
            self._found_inf = bool(found.item())
        elif self.nonfinite_guard is not None:  # fp16 keeps the loss scaler's overflow skip
            # One fused check across ranks; a bad step is skipped below like an fp16 overflow.
            self._found_inf = self.nonfinite_guard.check(self._grad_shards, self.params)
        self._prepared = True

    def _chunk_of(self, grad: torch.Tensor, s: ParamShard) -> torch.Tensor:
        flat = grad.detach().reshape(-1)
        if s.chunk == s.numel and s.start == 0:
            return flat.float().clone() if flat.dtype == torch.float32 else flat.float()
        out = torch.zeros(s.chunk, dtype=torch.float32, device=grad.device)
        out[: s.length].copy_(flat[s.start:s.end])
        return out

    def _comm_device(self) -> torch.device:
        for g in self._grad_shards:
            if g is not None:
                return g.device
        return self.params[0].device if self.params else torch.device("cpu")

    def _global_norm(self, norm_type: float) -> float:
        """Norm over every shard on every dp rank and, with ``tp_group``, every tp rank."""
        pairs = [(g, w) for g, w in zip(self._grad_shards, self._norm_weight) if g is not None]
        local = torch.zeros((), dtype=torch.float32, device=self._comm_device())
        inf = norm_type == math.inf
        if pairs:
            # In FP32 also for BF16 gradients (the fused step's): a BF16 norm would round.
            local = (torch.stack([g.abs().max().float() for g, _ in pairs]).max() if inf else
                     torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32)
                                  ** norm_type * w for g, w in pairs]).sum())
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        if self.world > 1:
            dist.all_reduce(local, op=op, group=self.dp_group)
        if self.tp_group is not None:
            dist.all_reduce(local, op=op, group=self.tp_group)
        if self.pp_group is not None:
            dist.all_reduce(local, op=op, group=self.pp_group)
        return float(local) if inf else float(local) ** (1.0 / norm_type)

    # ---------------------------------------------------------------------------- checkpoints
    def sync_master_from_model(self) -> None:
        """Re-read master chunks from the working params (after loading model weights)."""
        with torch.no_grad():
            for p, s, m in zip(self.params, self.shards, self.masters):
                m.zero_()
                m[: s.length].copy_(p.detach().reshape(-1)[s.start:s.end])

    def exact_working_params(self) -> dict[int, torch.Tensor]:
        """``{id(param): master cast to the param dtype}`` for params gathered in FP8 (collective).

        Their working copies are FP8-rounded; checkpoints should hold the masters' values.
        """
        if not any(self.fp8_gather_mask):
            return {}
        full = self.full_master_params()
        return {id(p): w.to(p.dtype) for p, w, fp8 in zip(self.params, full, self.fp8_gather_mask)
                if fp8}

    def full_master_params(self) -> list[torch.Tensor]:
        """Every parameter's full master weights (FP32), gathered on every rank (collective)."""
        out = []
        for s, m in zip(self.shards, self.masters):
            chunk = m.to(self.params[s.index].device)
            if self.world > 1:
                full = torch.empty(self.world * s.chunk, dtype=m.dtype, device=chunk.device)
                _all_gather_single(full, chunk, self.dp_group).wait()
            else:
                full = chunk
            out.append(full[: s.numel].view(s.shape).clone())
        return out

    @property
    def shard_world_size(self) -> int:
        """Ranks the state is split over (1: replicated, any rank holds all of it)."""
        return self.world

    @property
    def shard_rank(self) -> int:
        return self.rank

    def checkpoint_layout(self) -> list[ParamShard]:
        """Per parameter: which range of the flattened full state this rank holds."""
        return list(self.shards)

    def checkpoint_state(self) -> tuple[dict, dict, list[dict], dict]:
        """This rank's state: (sharded pieces, replicated values, param_groups, extra).

        Sharded pieces are 1-D tensors covering ``[shard.start, shard.end)`` of the flattened
        full-size state (padding dropped). ``master_param`` holds the FP32 master chunk.
        """
        sd = self.optim.state_dict()
        sharded: dict[int, dict] = {}
        replicated: dict[int, dict] = {}
        for i, (s, m) in enumerate(zip(self.shards, self.masters)):
            sharded[i] = {"master_param": m[: s.length]}
            replicated[i] = {}
            for key, value in sd["state"].get(i, {}).items():
                if torch.is_tensor(value) and value.dim() == 1 and value.shape == m.shape and key != "step":
                    sharded[i][key] = value[: s.length]
                else:
                    replicated[i][key] = value
        extra = {"loss_scaler": self.loss_scaler.state_dict()} if self.loss_scaler else {}
        return sharded, replicated, sd["param_groups"], extra

    def load_checkpoint_state(self, sharded: dict, replicated: dict, param_groups: list[dict],
                              extra: dict) -> None:
        """Inverse of ``checkpoint_state`` (pieces already cut to this rank's ranges)."""
        state: dict[int, dict] = {}
        for i, (s, m) in enumerate(zip(self.shards, self.masters)):
            entry = dict(replicated.get(i, {}))
            for key, piece in sharded.get(i, {}).items():
                full = torch.zeros(s.chunk, dtype=piece.dtype)
                full[: s.length].copy_(piece.reshape(-1))
                if key == "master_param":
                    with torch.no_grad():
                        m.copy_(full)
                else:
                    entry[key] = full
            if entry:
                state[i] = entry
        self.optim.load_state_dict({"state": state, "param_groups": param_groups})
        if self.loss_scaler is not None and "loss_scaler" in extra:
            self.loss_scaler.load_state_dict(extra["loss_scaler"])
        if any("master_param" in d for d in sharded.values()):
            # Working params = gathered masters, exactly as after a step (FP8-rounded where the
            # gather is FP8), so a resumed run continues bit-identically.
            all_gather_params(self.params, self.shards, self.masters, self.world,
                              self.bucket_numel, self._comm, self.fp8_gather_mask,
                              direct=self._fp8_direct_plan())

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer stops working for distributed training)
        and the bound layers' operand hooks (:meth:`bind_fp8_layers`)."""
        for h in self._hooks + self.__dict__.get("_direct_hooks", []):
            h.remove()
        self._hooks.clear()
        self._direct_hooks = []

    # ------------------------------------------------------------- direct FP8 weight operands
    def bind_fp8_layers(self, model: torch.nn.Module) -> None:
        """Let FP8-gathered weights of ``model``'s ``Fp8Linear`` layers feed their GEMMs directly.

        The optimizer only sees parameters, so whoever holds the model (the plugin, after
        building this optimizer) binds it. Each weight gathered in FP8 whose sole consumer is
        a tensorwise e4m3 ``Fp8Linear`` is then cast once per step with one scale from its
        global amax, and the gathered bytes become the layer's weight operand (see
        :mod:`fp8boost.parallel.zero.direct_plan`); the others keep the regular FP8 gather,
        with the reason logged once.
        """
        from fp8boost.parallel.zero.direct_plan import build_direct_plan, weight_owners
        fp8 = self._comm is not None and self._comm.fp8 and self.world > 1
        mask = [fp8 and m for m in self.fp8_gather_mask]
        for h in self.__dict__.get("_direct_hooks", []):  # bound again: the old plan's hooks go
            h.remove()
        self._fp8_direct = build_direct_plan(self.params, [s.shape for s in self.shards], mask,
                                             weight_owners(model), self._comm.comm_config
                                             if self._comm is not None else None)
        # Each direct layer gets its operand back after another optimizer's step (the layer
        # drops it at every step in the process; see direct_plan's module docstring).
        self._direct_hooks = self._fp8_direct.attach()

    def _fp8_direct_plan(self):
        """The bound direct plan, or None (unbound: logged once, weights are re-cast by layers)."""
        plan = self.__dict__.get("_fp8_direct")
        if plan is None and self._comm is not None and self._comm.fp8 and self.world > 1 \
                and any(self.fp8_gather_mask):
            import logging

            from fp8boost import _state
            _state.log_once(logging.getLogger("fp8boost.parallel.zero"), "zero-fp8-ag-unbound",
                            "fp8boost: ZeRO FP8 all-gather decodes weights and Fp8Linear re-casts "
                            "them: no model was bound (ZeroOptimizer.bind_fp8_layers), so the "
                            "optimizer does not know which layers consume its parameters")
        return plan or None


GRAD_RS_WHY = ("gradients reduce in their own dtype: FP8 reduce-scatter including its casts "
               "measured 0.21-0.52x of BF16 at 64-256 MB on 2xH200 NVLink, and ZeRO-2 trained "
               "slower with FP8 gradients than with BF16 ones (44.6k vs 45.7k tokens/s/GPU, "
               "BENCHMARKS.md 4d); pass fp8_reduce_scatter=True for slow links")


def _comm_report(fp8_communication: bool, fp8_reduce_scatter: bool, dp_world: int) -> dict:
    """What ZeRO puts on the wire in FP8, and why not where it does not (logged once)."""
    report = {"fp8_param_all_gather": fp8_communication and dp_world > 1,
              "fp8_grad_reduce": fp8_reduce_scatter and dp_world > 1, "why_not": {}}
    if fp8_communication and not fp8_reduce_scatter and dp_world > 1:
        report["why_not"]["grad_reduce"] = GRAD_RS_WHY
        _state.log_once(logging.getLogger("fp8boost.parallel.zero"), "zero-grad-rs-high",
                        f"fp8boost ZeRO: {GRAD_RS_WHY}")
    return report
