"""``colossalai.zero.gemini``: the classes of what ``GeminiPlugin`` boosts return.

In Colossal-AI, ``GeminiPlugin``'s ``boost`` returns a ``GeminiDDP`` model and a
``GeminiOptimizer``. fp8boost's ``GeminiPlugin`` shards with FSDP2 instead of Colossal-AI's
chunks, and returns its ``ModelWrapper`` and ``FsdpOptimizer``; ``isinstance`` against these
classes holds for exactly those a ``GeminiPlugin`` boosted (the optimizer: through the model
boosted with it, which it keeps a weak reference to). Nothing is registered at import.

Built directly (Colossal-AI's pre-``Booster`` API: ``GeminiDDP(model, ...)``,
``GeminiOptimizer(optim, model, ...)``, ``GeminiAdamOptimizer(model, ...)``) they raise
``TypeError`` naming ``Booster(plugin=GeminiPlugin(...)).boost(model, optimizer)``, which
builds both; ``get_static_torch_model`` raises ``NotImplementedError`` naming
``booster.save_model``.

Example:
    >>> from fp8boost.colossal.zero.gemini import GeminiDDP, GeminiOptimizer
    >>> GeminiDDP(None)
    Traceback (most recent call last):
    ...
    TypeError: GeminiDDP is built by booster.boost(model, optimizer) with GeminiPlugin...
"""
from __future__ import annotations

from abc import ABCMeta
from typing import Any, NoReturn

from fp8boost import plugins as _plugins
from fp8boost.colossal.booster.plugin.hybrid_parallel_plugin import BoostedByMeta
from fp8boost.colossal.interface import ModelWrapper
from fp8boost.parallel.fsdp.optimizer import FsdpOptimizer

__all__ = ["GeminiDDP", "GeminiOptimizer", "GeminiAdamOptimizer", "get_static_torch_model"]

_BOOST = ("booster.boost(model, optimizer) with GeminiPlugin; boost the plain model and torch "
          "optimizer (e.g. HybridAdam) instead of wrapping them")


def _boosted_by_gemini(optimizer: Any) -> bool:
    if not isinstance(optimizer, FsdpOptimizer):
        return False
    try:
        model = optimizer.unwrap_model()
    except RuntimeError:  # boosted without a model, or the model is gone
        return False
    boosted_by = getattr(model, "boosted_by", None)
    return isinstance(boosted_by, type) and issubclass(boosted_by, _plugins.GeminiPlugin)


class GeminiDDP(ModelWrapper, metaclass=BoostedByMeta):
    """Colossal-AI's class of the models ``GeminiPlugin`` boosts: ``isinstance(model,
    GeminiDDP)`` holds for those, and only those. ``module`` is the user's model, its
    parameters sharded in place by FSDP2; ``unwrap()`` returns it.

    Raises:
        TypeError: when built directly.
    """

    plugin_classes = (_plugins.GeminiPlugin,)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"GeminiDDP is built by {_BOOST}")


class _BoostedByGemini(ABCMeta):
    def __instancecheck__(cls, obj: Any) -> bool:
        if cls is GeminiOptimizer and _boosted_by_gemini(obj):
            return True
        return super().__instancecheck__(obj)


class GeminiOptimizer(FsdpOptimizer, metaclass=_BoostedByGemini):
    """Colossal-AI's class of the optimizers ``GeminiPlugin`` boosts: ``isinstance(optimizer,
    GeminiOptimizer)`` holds for those (while the model boosted with it exists). Its methods are
    :class:`~fp8boost.parallel.fsdp.optimizer.FsdpOptimizer`'s, Colossal-AI's
    ``OptimizerWrapper`` surface among them.

    Raises:
        TypeError: when built directly.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{type(self).__name__} is built by {_BOOST}")


class GeminiAdamOptimizer(GeminiOptimizer):
    """Colossal-AI's ``GeminiOptimizer`` over ``HybridAdam``: build ``HybridAdam(
    model.parameters(), ...)`` and boost it with ``GeminiPlugin`` (no boosted optimizer is a
    ``GeminiAdamOptimizer``, as in Colossal-AI).

    Raises:
        TypeError: when built directly.
    """


def get_static_torch_model(zero_ddp_model: Any, device: Any = "cpu", dtype: Any = None,
                           only_rank_0: bool = True) -> NoReturn:
    """Colossal-AI's copy of a Gemini model as a plain torch model: not offered.

    Raises:
        NotImplementedError: always, naming ``booster.save_model``.
    """
    raise NotImplementedError(
        "get_static_torch_model is not offered by fp8boost: GeminiPlugin keeps the parameters "
        "sharded (FSDP2); booster.save_model(model, directory, shard=True) writes the full "
        "weights in Hugging Face's layout, which from_pretrained (or load_state_dict of "
        "safetensors.torch.load_file) reads into a plain model")
