"""The FP8 direct all-gather as a collaborator of ``ZeroOptimizer``.

The optimizer only sees parameters; which of its FP8-gathered weights may feed their
``Fp8Linear``'s GEMM directly depends on the model (see :mod:`.direct_plan`). This object holds
that decision: it is built with the optimizer's parameters, bound to a model by whoever holds
both (the plugin, through ``ZeroOptimizer.bind_fp8_layers``), and asked for the plan at every
parameter all-gather.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from fp8boost import _state

from .direct_plan import build_direct_plan, weight_owners

if TYPE_CHECKING:  # imported when bound: the plan pulls in fp8.linear and the wire kernels
    from .direct_plan import ZeroDirectPlan

__all__ = ["DirectGather"]


class DirectGather:
    """Which FP8-gathered weights of one ZeRO optimizer feed their layers' GEMMs directly.

    Args:
        params: the optimizer's working parameters, in index order.
        shapes: each parameter's full shape.
        fp8_mask: which parameters are all-gathered in FP8 over more than one rank (all False:
            binding finds nothing and an unbound gather logs nothing).
        comm_config: the ``Fp8CommConfig`` of the optimizer's collectives (None: the default).
        world: the ranks each parameter is chunked over (blockwise weights take the block
            variant when their chunks hold whole blocks; None: they never do).

    Example:
        >>> import torch                                                       # doctest: +SKIP
        >>> gather = DirectGather(params, [p.shape for p in params], mask, None)  # doctest: +SKIP
        >>> gather.bind(model)                                                 # doctest: +SKIP
        >>> all_gather_params(..., direct=gather.plan())                       # doctest: +SKIP
    """

    def __init__(self, params: list[torch.Tensor], shapes: list[torch.Size],
                 fp8_mask: list[bool], comm_config=None, world: Optional[int] = None) -> None:
        self.params = params
        self.shapes = shapes
        self.fp8_mask = fp8_mask
        self.comm_config = comm_config
        self.world = world
        self._plan: Optional[ZeroDirectPlan] = None  # None until bind()
        self._hooks: list = []  # the bound layers' re-hand-over hooks

    def bind(self, model: nn.Module) -> None:
        """Decide the direct weights from ``model``'s layers and attach their hooks.

        Binding again replaces the previous plan and removes its hooks.
        """
        self.remove_hooks()
        self._plan = build_direct_plan(self.params, self.shapes, self.fp8_mask,
                                       weight_owners(model), self.comm_config, self.world)
        # Each direct layer gets its operand back after another optimizer's step (the layer
        # drops it at every step in the process; see direct_plan's module docstring).
        self._hooks = self._plan.attach()

    def plan(self) -> Optional[ZeroDirectPlan]:
        """The bound plan, or None (unbound: logged once, weights are re-cast by layers)."""
        if self._plan is None and any(self.fp8_mask):
            _state.log_once(logging.getLogger("fp8boost.parallel.zero"), "zero-fp8-ag-unbound",
                            "fp8boost: ZeRO FP8 all-gather decodes weights and Fp8Linear re-casts "
                            "them: no model was bound (ZeroOptimizer.bind_fp8_layers), so the "
                            "optimizer does not know which layers consume its parameters")
        return self._plan or None

    def remove_hooks(self) -> None:
        """Detach the bound layers' hooks (the plan itself stays in use for gathers)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
