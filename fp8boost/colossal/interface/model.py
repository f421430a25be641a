"""``colossalai.interface.model``: ``ModelWrapper`` and ``AMPModelMixin``, the classes of
boosted models.

Every model ``booster.boost`` returns is fp8boost's ``parallel.wrappers.ModelWrapper`` (or a
subclass): ``module`` is the engine-wrapped model, ``unwrap()`` the user's own object. These
classes make ``isinstance`` say so through an ABC subclass hook (nothing registered at import).
"""
from __future__ import annotations

from abc import ABCMeta

from torch import nn

from fp8boost.parallel import wrappers

__all__ = ["ModelWrapper", "AMPModelMixin"]


class ModelWrapper(wrappers.ModelWrapper, metaclass=ABCMeta):
    """Colossal-AI's ``ModelWrapper``: every model ``booster.boost`` returns is one.

    ``module`` is the wrapped model (under DDP the ``DistributedDataParallel`` around it);
    ``unwrap()`` returns the user's own model through every wrapper; ``forward`` calls
    ``module``. Built directly it wraps ``module`` as Colossal-AI's does.

    Args:
        module: the model to wrap.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> wrapped = ModelWrapper(layer)
        >>> wrapped.unwrap() is layer, wrapped.module is layer
        (True, True)
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        if cls is ModelWrapper and issubclass(subclass, wrappers.ModelWrapper):
            return True
        return NotImplemented


class AMPModelMixin(metaclass=ABCMeta):
    """Colossal-AI's mixin of models trained with master weights: ``update_master_params()``
    re-reads the masters from the model's parameters (after writing them by hand). Every
    boosted model is one; the masters are those of the optimizers boosted with it.

    Example:
        >>> import torch
        >>> from fp8boost.booster import Booster
        >>> model = torch.nn.Linear(4, 4)
        >>> model, opt, *_ = Booster(mixed_precision="bf16", device="cpu").boost(
        ...     model, torch.optim.SGD(model.parameters()))
        >>> isinstance(model, AMPModelMixin)
        True
        >>> with torch.no_grad():
        ...     _ = model.unwrap().weight.zero_()
        >>> model.update_master_params()
        >>> float(opt.full_master_params()[0].abs().sum())
        0.0
    """

    def update_master_params(self) -> None:
        """Re-read master weights from the parameters (nothing to do without masters)."""

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        if cls is AMPModelMixin and issubclass(subclass, wrappers.ModelWrapper):
            return True
        return NotImplemented
