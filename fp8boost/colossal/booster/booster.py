"""``colossalai.booster.booster``: the ``Booster`` with Colossal-AI's order and defaults.

``Booster`` keeps Colossal-AI's positional order ``(device, mixed_precision, plugin)``
(fp8boost's own is ``(plugin, mixed_precision, device)``); keyword calls are the same, and so
are Colossal-AI's defaults where fp8boost's differ: ``save_model`` writes one file unless asked
to shard (``shard=False``; fp8boost's own Booster shards by default, into the folder
``from_pretrained`` loads). ``booster.checkpoint_io`` is the plugin's checkpoint IO with
Colossal-AI's method signatures (:func:`fp8boost.colossal.checkpoint_io.checkpoint_io_for`).

Example:
    >>> from fp8boost.colossal.booster.booster import Booster
    >>> booster = Booster(device="cpu")
    >>> booster.checkpoint_io._sync_io()  # saves are synchronous: nothing is pending
"""
from __future__ import annotations

import logging

from fp8boost import _state, booster as _booster
from fp8boost.colossal.checkpoint_io import checkpoint_io_for
from fp8boost.colossal.positional import with_colossal_order
from fp8boost.plugins import Plugin

from .amp import FP16TorchMixedPrecision

__all__ = ["Booster", "Plugin"]

_Ordered = with_colossal_order(_booster.Booster, ("device", "mixed_precision", "plugin"))


class Booster(_Ordered):
    """fp8boost's :class:`~fp8boost.booster.Booster` with Colossal-AI's order and defaults."""

    def __init__(self, *args, **kwargs) -> None:
        args, kwargs = _native_amp(args, kwargs)
        super().__init__(*args, **kwargs)

    def save_model(self, model, checkpoint=None, shard: bool = False, *args, **kwargs) -> None:
        """:meth:`fp8boost.booster.Booster.save_model` with Colossal-AI's default
        ``shard=False``: ``save_model(model, "model.pt")`` writes that one file."""
        return super().save_model(model, checkpoint, shard, *args, **kwargs)

    @property
    def checkpoint_io(self):
        """The plugin's checkpoint IO with Colossal-AI's signatures (``save_model(model,
        checkpoint, shard, ...)``, ``_sync_d2h()``, ``_sync_io()``, ...): a
        ``HybridParallelCheckpointIO`` / ``MoECheckpointIO`` for the hybrid / MoE plugins, else
        a ``GeneralCheckpointIO`` (:func:`fp8boost.colossal.checkpoint_io.checkpoint_io_for`)."""
        return checkpoint_io_for(self.plugin)


Booster.__module__ = __name__


def _native_amp(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """An ``FP16TorchMixedPrecision`` (Colossal-AI's position 1 or the keyword) becomes
    fp8boost's ``"fp16"``, said once at INFO (see :mod:`.amp`)."""
    args = list(args)
    where = 1 if len(args) > 1 and isinstance(args[1], FP16TorchMixedPrecision) else None
    amp = args[where] if where is not None else kwargs.get("mixed_precision")
    if not isinstance(amp, FP16TorchMixedPrecision):
        return tuple(args), kwargs
    _state.log_once(logging.getLogger("fp8boost.colossal"), "colossal-fp16-torch-amp",
                    "fp8boost: Booster(mixed_precision=FP16TorchMixedPrecision()) trains in "
                    "fp8boost's 'fp16': FP16 weights with FP32 master copies and dynamic loss "
                    "scaling, in place of autocast over FP32 weights (configure() alone gives "
                    "torch AMP)", level=logging.INFO)
    if where is not None:
        args[where] = "fp16"
    else:
        kwargs = {**kwargs, "mixed_precision": "fp16"}
    return tuple(args), kwargs
