"""What a training script may call on every boosted optimizer, beyond ``step``/``zero_grad``.

Two vocabularies meet here: torch's (``state_dict`` / ``load_state_dict``, ``param_groups``)
and Colossal-AI's ``OptimizerWrapper`` (``clip_grad_by_norm``, ``clip_grad_by_value``,
``get_grad_norm``, ``unwrap``, ``unwrap_model``, ``get_param_grad``, ``backward_by_grad``,
``parameters``). :class:`OptimizerSurface` implements them once, as a mixin of
``OptimizerProxy`` (``boosted_optimizer.py``), so ``ZeroOptimizer``, ``FsdpOptimizer`` and
the plugins' ``OptimizerWrapper`` all answer them. A wrapper whose gradients or state do not
live where the defaults look overrides a hook:

* ``clip_grad_value_`` — the default clamps each parameter's own ``.grad``; the master-weight
  optimizers clamp their FP32 gradient chunks, the FSDP one unscales fp16 gradients first;
* ``get_param_grad`` — ZeRO-2 keeps only a chunk of each gradient and gathers it;
* ``state_dict`` / ``load_state_dict`` — ZeRO and FSDP gather their sharded state into plain
  full-size tensors (and cut it back on load).

The gradient norm that ``get_grad_norm`` reports is the one clipping measured last
(``record_grad_norm``, called by every ``clip_grad_norm_``): measuring it on every step would
cost a host synchronisation that clipping pays anyway.

Like ``boosted_optimizer.py`` this module imports nothing from ``parallel/``.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

if TYPE_CHECKING:
    from fp8boost.parallel.zero.loss_scaler import DynamicLossScaler

__all__ = ["OptimizerSurface", "LOSS_SCALER_KEY"]

#: the key ``state_dict()`` adds beside torch's ``state`` / ``param_groups`` when fp16 loss
#: scaling is on (the scale is part of what a resumed run needs to continue bit-exactly)
LOSS_SCALER_KEY = "loss_scaler"

# keyword arguments Colossal-AI forwards to torch's clip functions that only pick a kernel
_SPEED_HINTS = ("foreach",)


def check_no_extra_args(method: str, args: tuple, kwargs: dict) -> None:
    """Refuse extra arguments other than speed hints (they would change nothing here).

    Raises:
        TypeError: naming the unexpected arguments.
    """
    unknown = sorted(set(kwargs) - set(_SPEED_HINTS))
    if args or unknown:
        raise TypeError(f"{method}() got unexpected arguments {list(args) + unknown}; it takes "
                        f"the documented ones (plus {', '.join(_SPEED_HINTS)}, a kernel choice)")


class OptimizerSurface:
    """torch's and Colossal-AI's optimizer methods over a wrapped ``self.optim``.

    Example:
        >>> import torch
        >>> from fp8boost.booster import Booster
        >>> model = torch.nn.Linear(4, 2)
        >>> model, opt, *_ = Booster(device="cpu").boost(
        ...     model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> opt.backward(model(torch.ones(3, 4)).sum())
        >>> float(opt.clip_grad_by_norm(1.0)) > 0, opt.get_grad_norm() > 0
        (True, True)
        >>> opt.step(); sorted(opt.state_dict())
        ['param_groups', 'state']
        >>> opt.unwrap_model() is model, opt.unwrap() is opt.optim
        (True, True)
    """

    optim: torch.optim.Optimizer
    params: list[torch.Tensor]
    loss_scaler: Optional[DynamicLossScaler]
    param_groups: list[dict]

    # (norm_type, norm tensor) of the last clipping; a tensor so no host sync happens here
    _measured_norm: Optional[tuple[float, torch.Tensor]] = None
    _model_ref: Optional[weakref.ref] = None  # weak: the model holds its optimizers strongly
    _index_by_id: Optional[dict[int, int]] = None

    # ------------------------------------------------------------------ torch's surface
    @property
    def parameters(self) -> list[torch.Tensor]:
        """The tensors the wrapped optimizer steps, in param-group order (Colossal-AI's
        ``OptimizerWrapper.parameters``; ZeRO: the FP32 master chunks)."""
        return [p for group in self.param_groups for p in group["params"]]

    def add_param_group(self, param_group: dict) -> None:
        """Refused: a boosted optimizer's shards, masters and gradient hooks are built once.

        Raises:
            NotImplementedError: always, naming the fix.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot take a new param group after booster.boost(): its "
            "master weights, shards and gradient hooks are built once; give the torch "
            "optimizer every param group before boost() (a group with lr=0 can start frozen)")

    def state_dict(self) -> dict:
        """torch's ``Optimizer.state_dict()`` (``state`` by parameter index, ``param_groups``),
        plus ``"loss_scaler"`` under fp16 loss scaling.

        Loading it back with :meth:`load_state_dict` into the same configuration resumes
        bit-exactly. Where the state is sharded over ranks, the wrapper overrides this
        (ZeRO, FSDP: tensors gathered to full parameter shapes, a collective).
        """
        out = self.optim.state_dict()
        if self.loss_scaler is not None:
            out = {**out, LOSS_SCALER_KEY: self.loss_scaler.state_dict()}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Inverse of :meth:`state_dict` (torch's ``Optimizer.load_state_dict``)."""
        state_dict = dict(state_dict)
        scaler = state_dict.pop(LOSS_SCALER_KEY, None)
        self.optim.load_state_dict(state_dict)
        self.load_loss_scaler_state(scaler)

    def load_loss_scaler_state(self, scaler: Optional[dict]) -> None:
        """Restore the fp16 loss scaler saved by :meth:`state_dict` (if both exist)."""
        if scaler is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scaler)

    # ----------------------------------------------------------- Colossal-AI's surface
    def clip_grad_by_norm(self, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0,
                          error_if_nonfinite: bool = False, *args: Any,
                          **kwargs: Any) -> torch.Tensor:
        """Clip the gradients to a global norm; returns the norm before clipping.

        Same result as ``torch.nn.utils.clip_grad_norm_`` over every parameter of the model
        on one process: the norm spans every shard and rank (each tensor-parallel replica
        counted once), measured on unscaled (fp16) gradients.

        Args:
            max_norm: the largest norm the gradients keep.
            norm_type: the p of the p-norm (``float("inf")`` or ``"inf"`` for the max norm).
            error_if_nonfinite: raise when the norm is NaN/Inf (else the step skips, as every
                rank agrees on the non-finite gradients).

        Raises:
            RuntimeError: ``error_if_nonfinite`` and a non-finite norm.
            TypeError: other arguments than ``foreach`` (a kernel choice).
        """
        check_no_extra_args("clip_grad_by_norm", args, kwargs)
        norm_type = float(norm_type)
        norm = self.clip_grad_norm_(float(max_norm), norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               f"non-finite ({float(norm)}), so they cannot be clipped; pass "
                               "error_if_nonfinite=False to let the step skip them instead")
        return norm

    def clip_grad_by_value(self, clip_value: Union[float, int], *args: Any,
                           **kwargs: Any) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]`` (unscaled values).

        Raises:
            TypeError: other arguments than ``foreach`` (a kernel choice).
        """
        check_no_extra_args("clip_grad_by_value", args, kwargs)
        self.clip_grad_value_(float(clip_value))

    def clip_grad_value_(self, clip_value: float) -> None:
        """Hook of :meth:`clip_grad_by_value`: the parameters' own gradients (no fp16
        scaling here; wrappers with a loss scaler or gradient chunks override it)."""
        torch.nn.utils.clip_grad_value_(self.params, clip_value)

    def record_grad_norm(self, norm: torch.Tensor, norm_type: float) -> None:
        """Remember the norm a ``clip_grad_norm_`` measured (for :meth:`get_grad_norm`)."""
        self._measured_norm = (float(norm_type), norm)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Colossal-AI's: only its torch-AMP optimizer has it (``FP16TorchMixedPrecision``).

        Raises:
            NotImplementedError: always, naming the fix.
        """
        raise NotImplementedError(
            "scale_loss is only available for optimizers with mixed precision training "
            "(Colossal-AI's FP16TorchMixedPrecision().configure); a boosted optimizer scales "
            "the loss in optimizer.backward(loss) / booster.backward(loss, optimizer)")

    def unscale_grad(self) -> None:
        """Colossal-AI's: only its torch-AMP optimizer has it.

        Raises:
            NotImplementedError: always, naming the fix.
        """
        raise NotImplementedError(
            "unscale_grad is only available for optimizers with mixed precision training "
            "(Colossal-AI's FP16TorchMixedPrecision().configure); a boosted optimizer unscales "
            "its gradients itself, before clip_grad_by_norm and step")

    def get_grad_norm(self, norm_type: Union[float, int] = 2.0, **kwargs: Any) -> Optional[float]:
        """The gradient norm measured by the last clipping, as a float; None before any.

        As in Colossal-AI, the step measures it when it clips (the plugin's ``max_norm > 0``);
        a ``clip_grad_by_norm`` call measures it too. Other keyword arguments are ignored, as
        there.

        Raises:
            ValueError: ``norm_type`` differs from the one that was measured.
        """
        if self._measured_norm is None:
            return None
        measured_type, norm = self._measured_norm
        if float(norm_type) != measured_type:
            raise ValueError(f"get_grad_norm(norm_type={norm_type}): the last clipping measured "
                             f"the {measured_type}-norm; ask for that, or call "
                             f"clip_grad_by_norm(max_norm, norm_type={norm_type}) first")
        return float(norm)

    def unwrap(self) -> torch.optim.Optimizer:
        """The user's torch optimizer (its param groups may hold master weights or shards)."""
        return self.optim

    def bind_model(self, model: nn.Module) -> None:
        """Remember the boosted model this optimizer trains (``Plugin.configure`` calls it)."""
        self._model_ref = weakref.ref(model)

    def unwrap_model(self) -> nn.Module:
        """The boosted model returned by ``booster.boost`` together with this optimizer.

        Raises:
            RuntimeError: this optimizer was not boosted with a model, or the model is gone.
        """
        model = self._model_ref() if self._model_ref is not None else None
        if model is None:
            raise RuntimeError(f"this {type(self).__name__} knows no model: unwrap_model() "
                               "returns the model booster.boost(model, optimizer) returned with "
                               "it (boost them together and keep a reference to the model)")
        return model

    def param_index(self, param: torch.Tensor) -> int:
        """The position of a model parameter among those this optimizer trains.

        Raises:
            ValueError: ``param`` is not one of them.
        """
        if self._index_by_id is None:
            self._index_by_id = {id(p): i for i, p in enumerate(self.params)}
        index = self._index_by_id.get(id(param))
        if index is None:
            raise ValueError("this parameter is not trained by this optimizer: pass a parameter "
                             "of the model booster.boost() returned with it")
        return index

    def get_param_grad(self, working_param: torch.Tensor) -> Optional[torch.Tensor]:
        """The full, data-parallel-reduced gradient of a model parameter (None if it has none).

        Call after ``backward`` and before ``step`` (which frees the gradients). Under fp16 it
        is still multiplied by the loss scale, as in Colossal-AI. Collective where the gradient
        is sharded (FSDP's DTensors, ZeRO-2): every rank calls it for the same parameters.

        Raises:
            ValueError: ``working_param`` is not trained by this optimizer.
        """
        self.param_index(working_param)
        grad = working_param.grad
        if grad is not None and hasattr(grad, "full_tensor"):  # FSDP2: a sharded DTensor
            grad = grad.full_tensor()
        return grad

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor,
                         inputs: Optional[Any] = None, retain_graph: bool = False) -> None:
        """``torch.autograd.backward(tensor, grad)`` with fp16 loss scaling applied to
        ``grad`` (Colossal-AI's pipeline entry point)."""
        if self.loss_scaler is not None:
            grad = grad * self.loss_scaler.scale
        torch.autograd.backward(tensor, grad, inputs=inputs, retain_graph=retain_graph)
