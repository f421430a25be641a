"""``colossalai.booster``: fp8boost's ``Booster`` and ``Plugin`` under Colossal-AI's path.

``Booster`` keeps Colossal-AI's positional order ``(device, mixed_precision, plugin)``
(fp8boost's own is ``(plugin, mixed_precision, device)``); keyword calls are the same, and so
are Colossal-AI's defaults where fp8boost's differ: ``save_model`` writes one file unless asked
to shard (``shard=False``; fp8boost's own Booster shards by default, into the folder
``from_pretrained`` loads).

Example:
    >>> from fp8boost.colossal.booster import Booster
    >>> from fp8boost.colossal.booster.plugin import LowLevelZeroPlugin
    >>> booster = Booster(plugin=LowLevelZeroPlugin(stage=2, use_fp8=True))  # doctest: +SKIP
"""
from fp8boost import booster as _booster
from fp8boost.colossal.positional import with_colossal_order
from fp8boost.plugins import Plugin

_Ordered = with_colossal_order(_booster.Booster, ("device", "mixed_precision", "plugin"))


class Booster(_Ordered):
    """fp8boost's :class:`~fp8boost.booster.Booster` with Colossal-AI's order and defaults."""

    def save_model(self, model, checkpoint=None, shard: bool = False, *args, **kwargs) -> None:
        """:meth:`fp8boost.booster.Booster.save_model` with Colossal-AI's default
        ``shard=False``: ``save_model(model, "model.pt")`` writes that one file."""
        return super().save_model(model, checkpoint, shard, *args, **kwargs)


Booster.__module__ = __name__

__all__ = ["Booster", "Plugin"]
