"""ZeRO stage 1/2 optimizer: low-precision working params, sharded FP32 master state.

Layout per data-parallel rank (``world`` ranks, see ``sharding.py``):

* working parameters (BF16/FP16/FP32) stay replicated in the model, as the user built it;
* FP32 master weights and the wrapped optimizer's state exist only for this rank's chunk of
  each parameter (1/world of the model), optionally on the CPU (``cpu_offload``);
* gradients are reduced in buckets during backward (``buckets.GradReducer``): all-reduced
  (stage 1) or reduce-scattered (stage 2) into FP32 gradient chunks;
* ``step()`` unscales (FP16), checks for overflow on every rank, clips by the global norm,
  steps the wrapped optimizer on the master chunks and all-gathers the updated chunks back into
  the working parameters (in FP8 where ``comm_plan`` says).

The master-weight part (FP32 masters, loss scaling, overflow check, clipping, the fused AdamW
step, the checkpoint protocol) is :class:`~.master.MasterWeightOptimizer`; this class adds the
data-parallel sharding on top, and takes the FP8 direct gather (:class:`~.direct_gather.
DirectGather`) as a collaborator. With ``dp_group=None`` (world 1) no collective is ever issued:
it is then the plain mixed-precision "master weights" optimizer used by
``Booster(mixed_precision=...)`` and by DDP.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from fp8boost.parallel.boosted_optimizer import OptimizerProxy
from fp8boost.parallel.comm.plan import GRAD_RS_WHY, CommPlan

from .buckets import Collectives, GradReducer, all_gather_params
from .direct_gather import DirectGather
from .loss_scaler import DynamicLossScaler
from .master import MasterWeightOptimizer
from .overlap import OverlappedGather
from .sharding import ParamShard

__all__ = ["ZeroOptimizer", "OptimizerProxy", "GRAD_RS_WHY"]


class ZeroOptimizer(MasterWeightOptimizer):
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
        comm_plan: the :class:`~fp8boost.parallel.comm.plan.CommPlan` (None: plain
            collectives). ``param_all_gather.fp8``: all-gather ``fp8_params`` with FP8
            payloads; ``grad_reduce.fp8``: reduce gradients with FP8 (e5m2, per-chunk scales)
            payloads; ``config``: the ``Fp8CommConfig`` of the FP8 collectives. The plugins
            build it once (``build_comm_plan``); this class decides nothing about FP8.
        fp8_params: with ``comm_plan.param_all_gather.fp8``, the parameters all-gathered in
            FP8 (None: all; the plugins pass ``comm_plan.fp8_gather_params(model)``). The
            others are gathered in their own dtype.
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
        overlap_allgather: ``step()`` only launches the updated parameters' all-gather; each
            module unpacks its own in a forward pre-hook (:meth:`bind_overlap`), so the
            gather overlaps the next forward (:mod:`~.overlap`, with what it changes: call
            :meth:`wait_params` before reading parameters by hand after a step).

    Attributes:
        fp8_direct: the FP8 direct all-gather (:class:`~.direct_gather.DirectGather`) the
            parameter gather consults; bound to a model by :meth:`bind_fp8_layers`.

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
                 comm_plan: Optional[CommPlan] = None,
                 fp8_params: Optional[Iterable[torch.Tensor]] = None, tp_group=None,
                 tp_replicated: Optional[Iterable[torch.Tensor]] = None, pp_group=None,
                 pp_counted_elsewhere: Optional[Iterable[torch.Tensor]] = None,
                 fused_master_step: Optional[bool] = False,
                 overlap_allgather: bool = False) -> None:
        self.validate(optimizer)
        if isinstance(stage, bool) or stage not in (0, 1, 2):
            raise ValueError(f"stage must be 0, 1 or 2, got {stage!r}")
        if not isinstance(reduce_bucket_numel, int) or reduce_bucket_numel < 1:
            raise ValueError(f"reduce_bucket_numel must be a positive int, got {reduce_bucket_numel!r}")
        self.dp_group = dp_group
        # dp_world: ranks gradients are averaged over; world: ranks the state is split over
        # (stage 0 keeps whole masters on every rank and only all-reduces gradients).
        self.dp_world = dist.get_world_size(dp_group) if dp_group is not None else 1
        world = 1 if stage == 0 else self.dp_world
        rank = dist.get_rank(dp_group) if dp_group is not None and stage else 0
        self.stage, self.overlap = stage, overlap_communication
        self.bucket_numel = reduce_bucket_numel
        super().__init__(optimizer, master_weights=master_weights, max_norm=max_norm,
                         cpu_offload=cpu_offload, loss_scaler=loss_scaler, tp_group=tp_group,
                         tp_replicated=tp_replicated, pp_group=pp_group,
                         pp_counted_elsewhere=pp_counted_elsewhere,
                         fused_master_step=fused_master_step, shard_world_size=world,
                         shard_rank=rank)
        plan = CommPlan() if comm_plan is None else comm_plan
        if not isinstance(plan, CommPlan):
            raise TypeError(f"comm_plan must be a CommPlan or None, got {type(plan).__name__}")
        self.comm_plan = plan
        fp8_params_on, fp8_grads = plan.param_all_gather.fp8, plan.grad_reduce.fp8
        self._comm = (Collectives(dp_group, fp8_params_on or fp8_grads, plan.config,
                                  fp8_grads=fp8_grads) if self.dp_world > 1 else None)
        self._reducer = (GradReducer(self.params, self.shards, self.dp_world, max(stage, 1),
                                     reduce_bucket_numel, overlap_communication, self._comm,
                                     self.accumulate_grad) if self.dp_world > 1 else None)
        fp8_ids = None if fp8_params is None else {id(p) for p in fp8_params}
        self.fp8_gather_mask = [fp8_params_on and (fp8_ids is None or id(p) in fp8_ids)
                                for p in self.params]
        fp8_wire = self._comm is not None and self._comm.fp8 and self.world > 1
        self.fp8_direct = DirectGather(self.params, [s.shape for s in self.shards],
                                       [fp8_wire and m for m in self.fp8_gather_mask],
                                       self._comm.comm_config if self._comm is not None else None,
                                       world=self.world)
        # The deferred post-step all-gather (several shard ranks only: one rank copies in place).
        self._overlap = OverlappedGather() if overlap_allgather and self.world > 1 else None
        self._sync = True
        self._unsynced_grads = False
        self._hooks = []
        if self.dp_world > 1:
            for i, p in enumerate(self.params):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    def __repr__(self) -> str:
        return (f"ZeroOptimizer(stage={self.stage}, world={self.world}, "
                f"master_weights={self.master_weights}, cpu_offload={self.cpu_offload}, "
                f"optimizer={type(self.optim).__name__})")

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
        super().zero_grad(set_to_none)
        self._unsynced_grads = False

    @property
    def grads_sharded(self) -> bool:
        """ZeRO-2 over several ranks: each keeps only its reduce-scattered gradient chunks."""
        return self.stage == 2 and self.world > 1

    def get_param_grad(self, working_param: torch.Tensor) -> Optional[torch.Tensor]:
        """The full reduced gradient (see ``MasterWeightOptimizer.get_param_grad``).

        Raises:
            RuntimeError: gradients accumulated under ``no_sync()`` are not reduced yet.
        """
        if self._unsynced_grads:
            raise RuntimeError("get_param_grad: the gradients accumulated under no_sync() are "
                               "not reduced yet; run a backward outside no_sync() first")
        return super().get_param_grad(working_param)

    # --------------------------------------------------- the data-parallel layer's hooks
    def _after_backward(self) -> None:
        if self._sync and self._reducer is not None:
            self._reducer.flush()

    def _collect_grads(self) -> None:
        """Finish the reduction; stage 1 (and one shard) then takes chunks of ``param.grad``,
        stage 2 already holds its reduce-scattered chunks."""
        if self._unsynced_grads:
            raise RuntimeError("gradients were accumulated under no_sync() but never reduced: run "
                               "the last micro-batch's backward outside no_sync() before step()")
        if self._reducer is not None:
            self._reducer.flush()  # no-op after optimizer.backward(); needed after loss.backward()
        if self.world == 1 or self.stage == 1:
            super()._collect_grads()

    def _flag_groups(self) -> list:
        # Every dp rank skips alike, stage 0 included (its ranks step whole masters).
        return ([self.dp_group] if self.dp_world > 1 else []) + super()._flag_groups()

    def _norm_groups(self) -> list:
        # Stage 0 ranks hold the same all-reduced gradients: summing over dp would count them
        # dp times.
        return ([self.dp_group] if self.world > 1 else []) + super()._norm_groups()

    def _publish(self) -> None:
        self.wait_params()  # an overlapped gather left pending (no forward since) lands first
        launched = all_gather_params(self.params, self.shards, self.masters, self.world,
                                     self.bucket_numel, self._comm, self.fp8_gather_mask,
                                     direct=self.fp8_direct.plan(),
                                     defer=self._overlap is not None)
        if self._overlap is not None:
            self._overlap.hold(launched)

    def wait_params(self) -> None:
        """Finish the last step's overlapped all-gather (``overlap_allgather``): afterwards
        every working parameter holds the stepped value. A no-op otherwise; the next forward
        and ``state_dict`` / ``load_state_dict`` calls do it themselves."""
        if self._overlap is not None:
            self._overlap.wait()

    def bind_overlap(self, model: torch.nn.Module) -> None:
        """With ``overlap_allgather``, hook ``model``'s modules so each unpacks its own
        parameters before its forward (and its ``state_dict`` / ``load_state_dict``); the
        plugin calls it on the model it boosts. A no-op otherwise."""
        if self._overlap is not None:
            self._overlap.bind(model, self.params)

    def sync_master_from_model(self) -> None:
        if self._overlap is not None and self._overlap.pending:
            raise RuntimeError(
                "overlap_allgather: parameters were written while the last step's all-gather "
                "was still pending, so it would overwrite them; call optimizer.wait_params() "
                "before writing parameters by hand (model.load_state_dict does it itself)")
        super().sync_master_from_model()

    def _full_chunk(self, chunk: torch.Tensor, shard: ParamShard) -> torch.Tensor:
        if self.world == 1:
            return chunk
        full = torch.empty(self.world * shard.chunk, dtype=chunk.dtype, device=chunk.device)
        self._comm.all_gather(full, chunk, fp8=False).wait()  # exact FP32: never on the FP8 wire
        return full

    def _hook(self, index: int):
        def hook(_param: torch.Tensor) -> None:
            if not self._sync:
                self._unsynced_grads = True
                return
            self._unsynced_grads = False
            self._reducer.mark_ready(index)
        return hook

    # ---------------------------------------------------------------------------- checkpoints
    def exact_working_params(self) -> dict[int, torch.Tensor]:
        """``{id(param): master cast to the param dtype}`` for params gathered in FP8 (collective).

        Their working copies are FP8-rounded; checkpoints should hold the masters' values.
        """
        if not any(self.fp8_gather_mask):
            return {}
        full = self.full_master_params()
        return {id(p): w.to(p.dtype) for p, w, fp8 in zip(self.params, full, self.fp8_gather_mask)
                if fp8}

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer stops working for distributed training)
        and the bound layers' operand hooks (:meth:`bind_fp8_layers`)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.fp8_direct.remove_hooks()
        if self._overlap is not None:
            self._overlap.remove_hooks()

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
        self.fp8_direct.bind(model)
