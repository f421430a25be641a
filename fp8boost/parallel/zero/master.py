"""Master-weight optimizer: low-precision working params, FP32 master copies and state.

The user's torch optimizer is re-pointed at FP32 master copies of the model's (BF16/FP16)
parameters; every ``step()``:

* takes the gradients as FP32 chunks, unscales them (FP16 loss scaling) and checks them for
  overflow / non-finite values (the step is skipped alike on every rank);
* clips them by the global norm (tensor-parallel replicas counted once, pipeline stages summed);
* steps the wrapped optimizer on the masters (or, for AdamW on one rank, runs the fused
  kernel of :mod:`.fused_step` that also writes the working parameter);
* writes the masters back into the working parameters (:meth:`MasterWeightOptimizer._publish`).

On its own it is the single-process mixed-precision optimizer (also across tp/pp ranks, which
hold different parameters). ``ZeroOptimizer`` (:mod:`.optimizer`) adds the data-parallel
sharding on top: each rank then holds one chunk of every master (``shard_world_size`` ranks),
gradients are reduced over dp, and the gather after the step crosses ranks. The hooks it
overrides are ``_collect_grads``, ``_flag_groups``, ``_norm_groups``, ``_publish`` and
``_full_chunk``.
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

from .full_state import full_state_dict, load_full_state_dict
from .fused_step import fused_adamw_step, unsupported_reason
from .loss_scaler import DynamicLossScaler
from .sharding import ParamShard, make_shard

__all__ = ["MasterWeightOptimizer"]


class MasterWeightOptimizer(OptimizerProxy):
    """FP32 master weights for a torch optimizer built on low-precision parameters.

    Call ``backward(loss)`` (not ``loss.backward()``) so FP16 loss scaling happens; ``step()``
    and ``zero_grad()`` as usual.

    Args:
        optimizer: a fresh ``torch.optim.Optimizer`` (no state yet) over the model parameters.
        master_weights: keep FP32 master chunks; False steps directly in the parameter dtype.
        max_norm: clip gradients to this global norm at every step (0 disables).
        cpu_offload: keep master chunks and optimizer state on the CPU; the step runs there.
        loss_scaler: a ``DynamicLossScaler`` for FP16 (None for BF16/FP32).
        tp_group: tensor-parallel group: the norm and the overflow check span it.
        tp_replicated: parameters replicated over ``tp_group`` (counted once in the norm).
        pp_group: pipeline group: the global gradient norm and the FP16 overflow check span
            its stages (each holds different parameters).
        pp_counted_elsewhere: parameters whose gradient another stage also holds and counts
            in the norm (a tied embedding on the last stage): counted once.
        fused_master_step: see ``ZeroOptimizer``.
        shard_world_size, shard_rank: this rank holds chunk ``shard_rank`` of
            ``shard_world_size`` of every master (set by ``ZeroOptimizer``, which also supplies
            the collectives; 1 and 0: whole masters, no data parallelism).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, master_weights: bool = True,
                 max_norm: float = 0.0, cpu_offload: bool = False,
                 loss_scaler: Optional[DynamicLossScaler] = None, tp_group=None,
                 tp_replicated: Optional[Iterable[torch.Tensor]] = None, pp_group=None,
                 pp_counted_elsewhere: Optional[Iterable[torch.Tensor]] = None,
                 fused_master_step: Optional[bool] = False, shard_world_size: int = 1,
                 shard_rank: int = 0) -> None:
        self.validate(optimizer)
        if not (isinstance(max_norm, (int, float)) and max_norm >= 0):
            raise ValueError(f"max_norm must be >= 0 (0 disables clipping), got {max_norm!r}")
        self.optim = optimizer
        self.world, self.rank = shard_world_size, shard_rank
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 \
            else None
        tp_ids = {id(p) for p in tp_replicated} if tp_replicated is not None else set()
        # Pipeline stages hold different parameters: the norm and overflow check span them.
        self.pp_group = pp_group if pp_group is not None and dist.get_world_size(pp_group) > 1 \
            else None
        pp_skip = {id(p) for p in pp_counted_elsewhere or ()}
        self.master_weights, self.cpu_offload = master_weights, cpu_offload
        self.max_norm = float(max_norm)
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
        self._fused = fused_master_step is not False and self._fused_step_applies(
            warn=fused_master_step is True)
        self._grad_mul = 1.0  # the clipping coefficient, applied inside the fused step
        self._prepared = False
        self._found_inf = False

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
        return (f"{type(self).__name__}(master_weights={self.master_weights}, "
                f"cpu_offload={self.cpu_offload}, optimizer={type(self.optim).__name__})")

    @property
    def uses_fused_step(self) -> bool:
        """Whether ``step()`` runs the fused AdamW master step (what ``fused_master_step=``
        resolved to)."""
        return self._fused

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, *,
                 inputs=None) -> None:
        """``loss.backward()`` with loss scaling, then finish this backward's gradient reduction."""
        super().backward(loss, retain_graph, inputs=inputs)
        self._after_backward()

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor, inputs=None,
                         retain_graph: bool = False) -> None:
        """``torch.autograd.backward(tensor, grad)`` (loss-scaled), then finish this backward's
        gradient reduction."""
        super().backward_by_grad(tensor, grad, inputs, retain_graph)
        self._after_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Nothing is communicated per backward on one data-parallel rank: a plain block."""
        yield

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

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the (unscaled, averaged) gradients to a global norm over all shards.

        Returns the total norm before clipping (Inf when FP16 gradients overflowed).
        """
        self._prepare_grads()
        if self._found_inf:
            self.record_grad_norm(torch.tensor(float("inf")), norm_type)
            return torch.tensor(float("inf"))
        # The fused step keeps the coefficient aside (its BF16 gradients are scaled in FP32
        # inside the update), so the gradients to measure are the raw ones times it: a second
        # call then sees what the first one left, as with the scaled FP32 copies.
        total = self._global_norm(norm_type) * self._grad_mul
        self.record_grad_norm(torch.tensor(total), norm_type)
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
            raise ValueError(f"{type(self).__name__}.step() takes no closure; compute the loss "
                             "first")
        self._prepare_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update(self._found_inf)
        if self._found_inf:  # skip the step on every rank alike (found_inf was all-reduced)
            self.zero_grad()
            return
        if self.max_norm > 0:
            self.clip_grad_norm_(self.max_norm)
        if self._fused:
            fused_adamw_step(self.optim, self.masters, self._grad_shards, self.params,
                             self._grad_mul)
            self.zero_grad()
            return
        for m, g in zip(self.masters, self._grad_shards):
            m.grad = None if g is None else g.to(device=m.device, dtype=m.dtype)
        self.optim.step()
        for m in self.masters:
            m.grad = None
        self._publish()
        self.zero_grad()

    def accumulate_grad(self, index: int, chunk: torch.Tensor) -> None:
        """Add ``chunk`` (FP32, this rank's chunk of parameter ``index``'s gradient, reduced
        elsewhere) to the gradient the next step takes; called by ZeRO's gradient reducer."""
        cur = self._grad_shards[index]
        self._grad_shards[index] = chunk if cur is None else cur.add_(chunk)

    # ------------------------------------------------------ hooks of the data-parallel layer
    def _after_backward(self) -> None:
        """End of :meth:`backward`: nothing to reduce on one data-parallel rank."""

    def _collect_grads(self) -> None:
        """Take this rank's FP32 chunk of every local gradient (the fused step: BF16 as is)."""
        for i, (p, s) in enumerate(zip(self.params, self.shards)):
            if p.grad is not None:  # the fused step reads the BF16 gradient itself
                self._grad_shards[i] = (p.grad.detach().reshape(-1) if self._fused
                                        else self._chunk_of(p.grad, s))

    def _flag_groups(self) -> list:
        """Groups the FP16 overflow flag is all-reduced over, in order (tp ranks hold
        different shards, pp stages different parameters: all must skip alike)."""
        return [g for g in (self.tp_group, self.pp_group) if g is not None]

    def _norm_groups(self) -> list:
        """Groups the squared-norm partial sums are all-reduced over, in order."""
        return [g for g in (self.tp_group, self.pp_group) if g is not None]

    def _publish(self) -> None:
        """Write the updated masters into the working parameters."""
        with torch.no_grad():
            for p, s, m in zip(self.params, self.shards, self.masters):
                # copy_ on the Parameter itself bumps its version: FP8 weight caches see it.
                p.copy_(m[: s.numel].view(s.shape))

    def _full_chunk(self, chunk: torch.Tensor, shard: ParamShard) -> torch.Tensor:
        """The whole flattened master whose chunk this rank holds (it holds all of it)."""
        return chunk

    # ---------------------------------------------------------------------------- internals
    def _fused_step_applies(self, warn: bool) -> bool:
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

    def _prepare_grads(self) -> None:
        """Once per step: finish reduction, take FP32 chunks, unscale, detect overflow."""
        if self._prepared:
            return
        self._collect_grads()
        grads = [g for g in self._grad_shards if g is not None]
        if self.loss_scaler is not None:
            inv = 1.0 / self.loss_scaler.scale
            found = torch.zeros((), dtype=torch.float32, device=self._comm_device())
            for g in grads:
                found = torch.maximum(found, (~torch.isfinite(g)).any().to(found))
                g.mul_(inv)
            for group in self._flag_groups():
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
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
        """Where the step's small all-reduces (overflow flag, gradient norm) run. Under NCCL the
        current GPU, also when the gradient chunks live on the CPU (``cpu_offload``) or this
        rank holds none (frozen parameters): NCCL has no CPU tensors (a LoRA model with
        ``cpu_offload=True`` and ``max_norm`` failed there: Colossal-AI's
        test_low_level_zero_checkpoint_io.py on 2xH200)."""
        if dist.is_initialized() and "nccl" in str(dist.get_backend()):
            return torch.device("cuda", torch.cuda.current_device())
        for g in self._grad_shards:
            if g is not None:
                return g.device
        return self.params[0].device if self.params else torch.device("cpu")

    def _global_norm(self, norm_type: float) -> float:
        """Norm over every shard on every rank of :meth:`_norm_groups`."""
        pairs = [(g, w) for g, w in zip(self._grad_shards, self._norm_weight) if g is not None]
        local = torch.zeros((), dtype=torch.float32, device=self._comm_device())
        inf = norm_type == math.inf
        if pairs:
            # In FP32 also for BF16 gradients (the fused step's): a BF16 norm would round.
            local = (torch.stack([g.abs().max().float() for g, _ in pairs]).max() if inf else
                     torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32)
                                  ** norm_type * w for g, w in pairs]).sum())
        local = local.to(self._comm_device())  # offloaded chunks: their norm is on the CPU
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        for group in self._norm_groups():
            dist.all_reduce(local, op=op, group=group)
        return float(local) if inf else float(local) ** (1.0 / norm_type)

    # ------------------------------------------------- torch's and Colossal-AI's surface
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the (unscaled, averaged) gradient chunks the next step takes."""
        self._prepare_grads()
        if self._found_inf:
            return  # the step skips these gradients anyway
        bound = clip_value / self._grad_mul  # the fused step applies _grad_mul later
        for g in self._grad_shards:
            if g is not None:
                g.clamp_(-bound, bound)

    @property
    def grads_sharded(self) -> bool:
        """Whether each rank keeps only its chunk of every reduced gradient (ZeRO-2)."""
        return False

    def get_param_grad(self, working_param: torch.Tensor) -> Optional[torch.Tensor]:
        """The full reduced gradient of a model parameter, in its dtype (None if none).

        Collective under ZeRO-2 (the chunks are gathered): every rank calls it for the same
        parameters. See :meth:`OptimizerSurface.get_param_grad`.
        """
        i = self.param_index(working_param)
        if not self.grads_sharded:
            return working_param.grad
        chunk = self._grad_shards[i]
        if chunk is None:  # every rank alike: the same buckets reduced on all of them
            return None
        return self.full_tensor(chunk, i).to(working_param.dtype)

    @property
    def working_to_master_param(self) -> dict[int, torch.Tensor]:
        """``{id(model parameter): this rank's FP32 master chunk}`` (Colossal-AI's map; the
        chunk is the zero-padded piece ``[shard_rank]`` of ``shard_world_size``)."""
        return {id(p): m for p, m in zip(self.params, self.masters)}

    @property
    def master_to_working_param(self) -> dict[int, torch.Tensor]:
        """``{id(master chunk): model parameter}``, the inverse of
        :attr:`working_to_master_param`."""
        return {id(m): p for p, m in zip(self.params, self.masters)}

    def get_param_padding_size(self, working_param: torch.Tensor) -> int:
        """Zeros appended to the flattened parameter so it splits into equal chunks."""
        s = self.shards[self.param_index(working_param)]
        return s.chunk * self.world - s.numel

    def full_tensor(self, chunk: torch.Tensor, index: int) -> torch.Tensor:
        """A copy of the parameter-shaped tensor whose piece ``chunk`` this rank holds (a
        master, a state tensor or a gradient chunk of parameter ``index``), gathered over
        the shard ranks (collective; exact, never on the FP8 wire)."""
        s = self.shards[index]
        full = self._full_chunk(chunk.to(self.params[index].device), s)
        return full[: s.numel].view(s.shape).clone()

    def state_dict(self) -> dict:
        """torch's layout at full parameter shapes, plus each FP32 ``master_param``
        (collective over the shard ranks; see :mod:`.full_state`)."""
        return full_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`'s layout saved at any data-parallel size (or a plain
        torch optimizer's: masters then keep their values); loaded masters are written into
        the working parameters, exactly as after a step."""
        if load_full_state_dict(self, state_dict):
            self._publish()

    # ---------------------------------------------------------------------------- checkpoints
    def sync_master_from_model(self) -> None:
        """Re-read master chunks from the working params (after loading model weights)."""
        with torch.no_grad():
            for p, s, m in zip(self.params, self.shards, self.masters):
                m.zero_()
                m[: s.length].copy_(p.detach().reshape(-1)[s.start:s.end])

    def full_master_params(self) -> list[torch.Tensor]:
        """Every parameter's full master weights (FP32), gathered on every rank (collective)."""
        out = []
        for s, m in zip(self.shards, self.masters):
            full = self._full_chunk(m.to(self.params[s.index].device), s)
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
            self._publish()
