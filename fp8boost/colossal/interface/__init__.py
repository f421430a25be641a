"""``colossalai.interface``: the classes of what ``booster.boost`` returns.

``isinstance(optimizer, OptimizerWrapper)`` holds for every optimizer an fp8boost plugin's
``boost`` returns, and ``isinstance(model, ModelWrapper)`` for every model; both answer
Colossal-AI's methods (``clip_grad_by_norm``, ``get_grad_norm``, ``unwrap``, ``state_dict``,
...). Built directly, ``OptimizerWrapper(optim)`` / ``ModelWrapper(module)`` wrap plain torch
objects as Colossal-AI's do.

Example:
    >>> import torch
    >>> from fp8boost.booster import Booster
    >>> from fp8boost.colossal.interface import ModelWrapper, OptimizerWrapper
    >>> model = torch.nn.Linear(4, 2)
    >>> model, opt, *_ = Booster(device="cpu").boost(model, torch.optim.SGD(model.parameters()))
    >>> isinstance(model, ModelWrapper), isinstance(opt, OptimizerWrapper)
    (True, True)
"""
from .model import AMPModelMixin, ModelWrapper
from .optimizer import OptimizerWrapper

__all__ = ["OptimizerWrapper", "ModelWrapper", "AMPModelMixin"]
