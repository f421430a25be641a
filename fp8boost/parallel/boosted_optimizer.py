"""The declared interface of the optimizer that ``Booster.boost`` returns.

Every plugin wraps the user's torch optimizer in one of three classes:

* ``ZeroOptimizer`` (:mod:`fp8boost.parallel.zero`): FP32 master weights, optionally sharded
  over data-parallel ranks (ZeRO-1/2); also the single-process master-weight optimizer;
* ``OptimizerWrapper`` (:mod:`fp8boost.parallel.wrappers`): no master weights (FP32 training);
* ``FsdpOptimizer`` (:mod:`fp8boost.parallel.fsdp.optimizer`): over FSDP2's sharded FP32
  parameters.

:class:`BoostedOptimizer` is what the Booster, the plugins and the checkpoint IO may call on
any of them; :class:`ShardedCheckpointState` is the extra surface of the wrappers saved by the
safetensors checkpoint formats (``ZeroOptimizer`` and ``OptimizerWrapper``; FSDP goes through
DCP instead). :class:`OptimizerProxy` is their common base: the ``torch.optim`` surface of the
wrapped optimizer, the shared ``backward`` (non-finite guard, fp16 loss scaling) and the
defaults of the members that mean nothing for some wrappers, so a caller never needs
``hasattr`` to find out which wrapper it holds. :class:`DirectOptimizerProxy` adds what the two
wrappers without master copies share (``OptimizerWrapper``, ``FsdpOptimizer``): the non-finite
guard's verdict on the parameters' own gradients.

This module sits at the bottom of ``parallel/`` and imports nothing from it at run time, so
every wrapper (``parallel/zero`` and ``plugins/`` alike) can import it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ContextManager, Optional, Protocol, runtime_checkable

import torch

from .optimizer_surface import OptimizerSurface

if TYPE_CHECKING:  # annotations only: importing zero/ here would be circular
    from fp8boost.parallel.nonfinite import NonFiniteGuard
    from fp8boost.parallel.zero.loss_scaler import DynamicLossScaler
    from fp8boost.parallel.zero.sharding import ParamShard

__all__ = ["BoostedOptimizer", "ShardedCheckpointState", "OptimizerProxy", "DirectOptimizerProxy"]


@runtime_checkable
class BoostedOptimizer(Protocol):
    """What every optimizer returned by ``Booster.boost`` implements.

    Attributes:
        optim: the user's torch optimizer (its param groups may point at master weights or
            sharded parameters rather than the model's own tensors).
        params: the model parameters it trains, in param-group order.
        loss_scaler: the dynamic loss scaler (fp16), or None.
        nonfinite_guard: set by ``Booster.boost``; consulted before every step (None: off).
    """

    optim: torch.optim.Optimizer
    params: list[torch.Tensor]
    loss_scaler: Optional[DynamicLossScaler]
    nonfinite_guard: Optional[NonFiniteGuard]

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's param groups (learning-rate schedulers write them)."""

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""

    @property
    def defaults(self) -> dict:
        """The wrapped optimizer's defaults."""

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, *,
                 inputs: Optional[Any] = None) -> None:
        """``loss.backward()`` plus what the wrapper needs (loss scaling, gradient reduction);
        ``inputs`` as torch's (Colossal-AI's ``OptimizerWrapper.backward`` takes it too)."""

    def step(self, closure: Any = None) -> Any:
        """One optimizer step (skipped on every rank alike on overflow / non-finite values)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients and this step's bookkeeping."""

    def no_sync(self) -> ContextManager[None]:
        """Accumulate gradients locally inside the block (no gradient communication)."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients to a global norm; returns the norm before clipping."""

    def exact_working_params(self) -> dict[int, torch.Tensor]:
        """``{id(param): exact value}`` for parameters whose working copy is lossy (collective)."""

    def sync_master_from_model(self) -> None:
        """Re-read derived state (master weights) from the model's parameters after a load."""


@runtime_checkable
class ShardedCheckpointState(Protocol):
    """The optimizer state as pieces of flattened full-size tensors (safetensors formats).

    Attributes:
        shard_world_size: ranks the state is split over (1: any rank holds all of it).
        shard_rank: this rank's index among them.
    """

    shard_world_size: int
    shard_rank: int

    def checkpoint_layout(self) -> list[ParamShard]:
        """Per parameter: which range of the flattened full state this rank holds."""

    def checkpoint_state(self) -> tuple[dict, dict, list[dict], dict]:
        """This rank's (sharded pieces, replicated values, param_groups, extra)."""

    def load_checkpoint_state(self, sharded: dict, replicated: dict, param_groups: list[dict],
                              extra: dict) -> None:
        """Inverse of :meth:`checkpoint_state` (pieces already cut to this rank's ranges)."""


class OptimizerProxy(OptimizerSurface):
    """Base of the boosted optimizers: the ``torch.optim`` surface of a wrapped ``self.optim``
    (torch's and Colossal-AI's methods: :class:`~.optimizer_surface.OptimizerSurface`) and the
    defaults of the :class:`BoostedOptimizer` members a wrapper may have no use for."""

    optim: torch.optim.Optimizer

    #: set by ``Booster.boost``: skips steps with a NaN/Inf loss or gradient (see ``nonfinite``)
    nonfinite_guard: Optional[NonFiniteGuard] = None
    #: fp16 dynamic loss scaling; None where the wrapper has none (BF16/FP32)
    loss_scaler: Optional[DynamicLossScaler] = None

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

    @property
    def state(self) -> Any:
        return self.optim.state

    @property
    def defaults(self) -> dict:
        return self.optim.defaults

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, *,
                 inputs: Optional[Any] = None) -> None:
        """``loss.backward()``, after the non-finite guard has seen the loss and scaled by the
        fp16 loss scaler (if any). ``inputs`` (keyword): accumulate into these tensors only,
        as torch's ``inputs=``.

        Raises:
            TypeError: ``retain_graph`` is not a bool (Colossal-AI's order is ``(loss, inputs,
                retain_graph)``: pass ``inputs=`` by keyword).
        """
        if not isinstance(retain_graph, bool):
            raise TypeError(f"backward(loss, retain_graph): retain_graph must be a bool, got "
                            f"{type(retain_graph).__name__}; pass inputs=... by keyword")
        if self.nonfinite_guard is not None:
            self.nonfinite_guard.observe_loss(loss)
        if self.loss_scaler is not None:
            loss = loss * self.loss_scaler.scale
        loss.backward(retain_graph=retain_graph, inputs=inputs)

    def exact_working_params(self) -> dict[int, torch.Tensor]:
        """None of the working parameters is a lossy copy: nothing to substitute."""
        return {}

    def sync_master_from_model(self) -> None:
        """No state derived from the parameters: nothing to refresh after a load."""


class DirectOptimizerProxy(OptimizerProxy):
    """An :class:`OptimizerProxy` whose wrapped optimizer steps ``params`` themselves (their own
    ``.grad``, no master copies): ``OptimizerWrapper`` and ``FsdpOptimizer``. Adds the
    non-finite guard's verdict on those gradients, taken once per step."""

    params: list[torch.Tensor]
    _skip_step: Optional[bool] = None  # this step's guard verdict (None: not checked yet)

    def guard_skips_step(self) -> bool:
        """Whether the non-finite guard skips this step (the same verdict on every rank).

        The gradients are checked once per step, at the first call; False without a guard, and
        with fp16 loss scaling, whose overflow check decides instead.
        """
        if self.nonfinite_guard is None or self.loss_scaler is not None:
            return False
        if self._skip_step is None:
            self._skip_step = self.nonfinite_guard.check([p.grad for p in self.params],
                                                         self.params)
        return self._skip_step

    def forget_guard_verdict(self) -> None:
        """End of the step: the next :meth:`guard_skips_step` checks the next gradients."""
        self._skip_step = None
