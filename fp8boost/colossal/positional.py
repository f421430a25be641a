"""Colossal-AI's positional argument order over fp8boost's classes.

fp8boost's plugins and Booster take Colossal-AI's argument names, but their own positional
order (``HybridParallelPlugin(tp_size, pp_size, precision, ...)``), which fp8boost users rely
on. Colossal-AI's constructors take every argument positionally, in another order
(``HybridParallelPlugin(tp_size, pp_size, sp_size, precision, ...)``, ``Booster(device,
mixed_precision, plugin)``). :func:`with_colossal_order` makes a subclass that binds positional
arguments by Colossal-AI's order and hands everything to the fp8boost class as keywords: no
second implementation, and ``isinstance`` against either class holds.

Example:
    >>> from fp8boost.plugins import TorchDDPPlugin
    >>> DDP = with_colossal_order(TorchDDPPlugin, ("broadcast_buffers", "bucket_cap_mb"))
    >>> isinstance(DDP(True, 25), TorchDDPPlugin)
    True
"""
from __future__ import annotations

import inspect
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence


def _colossal_signature(cls: type, order: Sequence[str],
                        defaults: Mapping[str, Any]) -> inspect.Signature:
    ours = dict(inspect.signature(cls).parameters)
    for name, value in defaults.items():
        ours[name] = ours[name].replace(default=value)
    missing = [n for n in order if n not in ours]
    if missing:  # a programming error in this package, caught by its tests
        raise TypeError(f"{cls.__name__} does not take Colossal-AI's {missing}")
    params = [ours[n].replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in order]
    rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind is not p.VAR_KEYWORD else p
            for n, p in ours.items() if n not in order]
    return inspect.Signature(params + sorted(rest, key=lambda p: p.kind))


def with_colossal_order(cls: type, order: Sequence[str],
                        defaults: Optional[Mapping[str, Any]] = None,
                        methods: Optional[Mapping[str, Any]] = None) -> type:
    """A subclass of ``cls`` whose positional arguments follow ``order`` (Colossal-AI's).

    Positional arguments are bound to ``order`` by position and passed on as keywords;
    more positionals than ``order`` has, or a name given both ways, raise ``TypeError`` as
    Python does. ``defaults`` are Colossal-AI's defaults where they differ from fp8boost's
    (applied when the argument is not given; the signature shows them). ``methods`` are
    added to the subclass (what only the Colossal-AI-facing class answers differently, e.g.
    ``get_checkpoint_io``).
    """
    order, defaults = tuple(order), dict(defaults or {})
    signature = _colossal_signature(cls, order, defaults)

    def __init__(self, *args, **kwargs):  # noqa: N807 - the constructor of the subclass
        if len(args) > len(order):
            raise TypeError(f"{cls.__name__}() takes at most {len(order)} positional arguments "
                            f"(Colossal-AI's order: {', '.join(order)}), got {len(args)}")
        for name, value in zip(order, args):
            if name in kwargs:
                raise TypeError(f"{cls.__name__}() got multiple values for argument {name!r}")
            kwargs[name] = value
        cls.__init__(self, **{**defaults, **kwargs})

    __init__.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         *signature.parameters.values()])
    namespace = {"__init__": __init__, "__doc__": cls.__doc__, "__signature__": signature,
                 "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                 "colossal_order": order, "colossal_defaults": MappingProxyType(defaults),
                 **(methods or {})}
    return type(cls.__name__, (cls,), namespace)
