"""The per-recipe strategy of an :class:`~fp8boost.fp8.linear.Fp8Linear`, chosen once at its
construction (:func:`make_casts`): how its operands are scaled.

* :class:`TensorwiseCasts`: current scaling, one scale per tensor (the layer's GEMMs run in
  :class:`~fp8boost.fp8.matmul.Fp8Matmul`). Under tensor parallelism an operand split over a
  group is scaled from the whole tensor's amax (all-reduced, MAX).
* :class:`DelayedCasts`: scales from an amax history (the layer's ``fp8_amax_history`` /
  ``fp8_scale`` buffers, bound by the layer before each forward), with the replay log that
  makes an activation recomputation cast with the scales its forward used.
* :class:`GranularCasts`: rowwise and blockwise, whose casts and GEMMs are
  :func:`~fp8boost.fp8.linear_granular.granular_forward`'s; the strategy keeps their
  tensor-parallel row groups and prepares the GEMM choice.

A strategy holds the layer's resolved backend (:meth:`TensorwiseCasts.use_backend`) and its
tensor-parallel groups; the weight's bytes come from the layer's
:class:`~fp8boost.fp8.operands.OperandSource`.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .backend_base import Fp8Backend
from .config import GRANULAR_RECIPES, Fp8Config
from .linear_granular import RowGroups, prepare_granular, row_groups
from .recompute import DelayedReplayLog, compiling as _compiling, recomputing
from .scaling import DelayedScalingState, Fp8Tensor, amax, scale_from_amax

ROLES = ("input", "weight", "grad")


class TensorwiseCasts:
    """Current scaling, one scale per tensor (the ``tensorwise*`` recipes)."""

    granular = False
    delayed = False

    def __init__(self, config: Fp8Config) -> None:
        self.config = config
        self.backend: Optional[Fp8Backend] = None
        """The layer's resolved backend (None until :meth:`use_backend`)."""
        self.amax_groups: dict[str, object] = {}
        """``{role: process group}`` of the operands whose amax is all-reduced."""

    def use_backend(self, backend: Fp8Backend, device: torch.device) -> None:
        """Cast and multiply with ``backend`` (the layer resolved it for ``device``)."""
        self.backend = backend

    def set_amax_groups(self, groups: dict[str, object]) -> None:
        """Tensor parallelism: the operands split over a group (roles checked by the layer)."""
        self.amax_groups = {k: g for k, g in groups.items() if g is not None}

    def set_amax_reduce_fn(self, fn) -> None:
        """Delayed scaling's distribution hook; current scaling reduces through its groups."""

    def bind(self, history: torch.Tensor, scale: torch.Tensor) -> None:
        """Delayed scaling's buffers; current scaling keeps none."""

    def loaded(self, initialized: Optional[list[bool]]) -> None:
        """After a load (delayed scaling: which histories now hold a loaded amax)."""

    def cast_fn(self):
        """The backend's cast, or under ``torch.compile`` with ``compiled_casts="inductor"``
        the reference torch-op cast, which inductor fuses into the producing kernels."""
        backend = self.backend
        if self.config.compiled_casts == "inductor" and _compiling():
            return functools.partial(Fp8Backend.quantize, backend)
        return backend.quantize

    def quantize(self, role: str, x: torch.Tensor, dtype: torch.dtype, with_transpose: bool,
                 replay_scale: Optional[torch.Tensor] = None) -> Fp8Tensor:
        """Every FP8 cast of the layer (tests spy on it). The result's ``.amax`` is the amax its
        scale came from (``scale_from_amax`` of it is the very scale, bit for bit)."""
        cfg, cast = self.config, self.cast_fn()
        group = self.amax_groups.get(role)
        if group is not None:  # a shard: scale from the whole tensor's amax
            a = amax(x)
            torch.distributed.all_reduce(a, op=torch.distributed.ReduceOp.MAX, group=group)
            scale = scale_from_amax(a, dtype, cfg.margin, cfg.power_of_2_scale)
            q, _ = cast(x, dtype, scale=scale, with_transpose=with_transpose)
        else:
            q, a = cast(x, dtype, margin=cfg.margin, power_of_2=cfg.power_of_2_scale,
                        with_transpose=with_transpose)
        q.amax = a
        return q

    def recast_weight_t(self, weight: torch.Tensor, w_amax: torch.Tensor) -> Fp8Tensor:
        """Backward: W^T cast with the scale of the forward's cast (same amax, same bytes)."""
        cfg = self.config
        scale = scale_from_amax(w_amax, cfg.fwd_dtype, cfg.margin, cfg.power_of_2_scale)
        q, _ = self.cast_fn()(weight.detach().t(), cfg.fwd_dtype, scale=scale,
                              with_transpose=False)
        # K-major, as the GEMMs take it (under compile the copy fuses into the cast)
        return Fp8Tensor(q.data.contiguous(), q.inv_scale)

    def replayed_weight(self) -> Optional[object]:
        """Delayed scaling under recomputation: what the forward used for the weight."""
        return None

    def remember_weight(self, wq: Fp8Tensor) -> None:
        """Delayed scaling: a forward used this (cached) weight cast."""

    def begin_forward(self) -> None:
        """Delayed scaling: note whether a backward (perhaps a recomputation) follows."""


class DelayedCasts(TensorwiseCasts):
    """Delayed scaling: each role's scale comes from its amax history (one step stale)."""

    delayed = True

    def __init__(self, config: Fp8Config) -> None:
        super().__init__(config)
        dtypes = (config.fwd_dtype, config.fwd_dtype, config.grad_dtype)
        self.states = {role: DelayedScalingState(dt, config.amax_history_len,
                                                 config.amax_compute_algo, config.margin,
                                                 config.power_of_2_scale)
                       for role, dt in zip(ROLES, dtypes)}
        self.replay_log = DelayedReplayLog()
        self._history: Optional[torch.Tensor] = None
        self._scale: Optional[torch.Tensor] = None

    def set_amax_reduce_fn(self, fn) -> None:
        for state in self.states.values():
            state.amax_reduce_fn = fn

    def bind(self, history: torch.Tensor, scale: torch.Tensor) -> None:
        """The layer's ``fp8_amax_history`` [3, len] and ``fp8_scale`` [3] buffers (rebound
        before each forward: ``.to()`` replaces them)."""
        self._history, self._scale = history, scale

    def loaded(self, initialized: Optional[list[bool]]) -> None:
        for role, init in zip(ROLES, initialized or ()):
            self.states[role].initialized = init

    def quantize(self, role: str, x: torch.Tensor, dtype: torch.dtype, with_transpose: bool,
                 replay_scale: Optional[torch.Tensor] = None) -> Fp8Tensor:
        """Cast with the history's scale and record the new amax. ``replay_scale`` (or a
        recomputed input): cast with the scale the forward used, recording nothing."""
        cast = self.cast_fn()
        i = ROLES.index(role)
        state = self.states[role].bind(self._history[i], self._scale[i])
        if replay_scale is not None or (role == "input" and recomputing()):
            # Activation checkpointing: cast with the scale the forward used (the history has
            # moved on since), and record nothing: the forward did.
            scale = replay_scale if replay_scale is not None else self.replay_log.replay(role)
            if scale is not None:
                q, _ = cast(x, dtype, scale=scale, with_transpose=with_transpose)
                return q
        if not state.initialized:
            state.seed(state.reduce(amax(x)))
        scale = state.scale.clone()
        q, a = cast(x, dtype, scale=scale, with_transpose=with_transpose)
        state.record(state.reduce(a))
        if role != "grad":
            self.replay_log.remember(role, scale)
        return q

    def replayed_weight(self) -> Optional[object]:
        return self.replay_log.replay("weight") if recomputing() else None

    def remember_weight(self, wq: Fp8Tensor) -> None:
        self.replay_log.remember("weight", wq)

    def begin_forward(self) -> None:
        if not _compiling():  # read here: grad mode is off inside the autograd function
            self.replay_log.active = torch.is_grad_enabled()


class GranularCasts(TensorwiseCasts):
    """Rowwise and blockwise: scales per row, tile or block, in ``granular_forward``."""

    granular = True

    def __init__(self, config: Fp8Config) -> None:
        super().__init__(config)
        self.row_groups: Optional[RowGroups] = None
        """Rowwise under tensor parallelism: the per-row amaxes reduced (``row_groups``)."""

    def use_backend(self, backend: Fp8Backend, device: torch.device) -> None:
        super().use_backend(backend, device)
        prepare_granular(backend, self.config.recipe, device)  # eagerly, not in a traced forward

    def set_amax_groups(self, groups: dict[str, object]) -> None:
        self.row_groups = row_groups(groups, self.config.recipe)
        self.amax_groups = {}  # no tensor-wide amax


def make_casts(config: Fp8Config) -> TensorwiseCasts:
    """The strategy of ``config.recipe``.

    Example:
        >>> from fp8boost.fp8 import Fp8Config
        >>> from fp8boost.fp8.casts import make_casts
        >>> type(make_casts(Fp8Config.from_recipe("delayed"))).__name__
        'DelayedCasts'
    """
    if config.recipe in GRANULAR_RECIPES:
        return GranularCasts(config)
    return DelayedCasts(config) if config.recipe == "delayed" else TensorwiseCasts(config)
