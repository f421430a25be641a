"""The options every plugin shares, declared and validated once: :class:`PluginOptions`.

Precision, FP8 GEMMs, FP8 communication, gradient clipping and FP16 loss scaling mean the same
in every plugin, so they are fields of one frozen dataclass instead of five hand-written
``__init__`` parameters, each validated again. A plugin class writes only its own arguments
and takes the shared ones through ``**options``; :func:`takes_plugin_options` then gives its
``__init__`` the full public signature (``help()``, ``inspect.signature`` and the docs tables
list every argument, in the positional order the plugin has always had; fp8boost's arguments
only, Colossal-AI's extra ones are taken by ``fp8boost.colossal.booster.plugin``), and
``Plugin.__init__`` keeps the validated object as ``plugin.options``
(``plugin.precision``, ``plugin.use_fp8``, ... read it).

Adding an option every plugin takes is one new field here (plus its row in docs/PLUGINS.md and
its tests): every plugin then accepts, validates and exposes it.

Example:
    >>> from fp8boost.plugins.options import PluginOptions
    >>> PluginOptions(precision="bf16", use_fp8=True).use_fp8
    True
    >>> PluginOptions(fp8_reduce_scatter=True)
    Traceback (most recent call last):
    ...
    ValueError: fp8_reduce_scatter=True needs fp8_communication=True
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

from fp8boost.fp8.config import Fp8Config
from fp8boost.loss.causal_lm import FusedLmLossConfig, resolve_fused_lm_loss
from fp8boost.parallel.comm.config import Fp8CommConfig
from fp8boost.parallel.wrappers import PRECISIONS


if TYPE_CHECKING:  # the comm package is imported only when FP8 communication is used
    from fp8boost.parallel.comm.config import Fp8CommConfig


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_precision(precision: object, allowed: tuple[str, ...] = PRECISIONS) -> str:
    if precision not in allowed:
        raise ValueError(f"precision={precision!r} is not supported; use one of {allowed} "
                         "(FP8 GEMMs are turned on with use_fp8=True on top of bf16)")
    return precision  # type: ignore[return-value]


def check_fp8_config(fp8_config: object) -> Optional[Fp8Config]:
    if fp8_config is not None and not isinstance(fp8_config, Fp8Config):
        raise TypeError(f"fp8_config must be an fp8boost.fp8.Fp8Config, got {type(fp8_config).__name__}")
    return fp8_config


def check_comm_config(comm_config: object):
    if comm_config is None:
        return None
    if not isinstance(comm_config, Fp8CommConfig):
        raise TypeError("comm_config must be an fp8boost.parallel.comm.config.Fp8CommConfig, "
                        f"got {type(comm_config).__name__}")
    return comm_config


def check_max_norm(max_norm: object) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"max_norm must be a number >= 0 (0 disables clipping), got {max_norm!r}")
    return float(max_norm)


def check_loss_scaling(initial_scale: object, growth_interval: object) -> tuple[float, int]:
    """Validate the fp16 dynamic loss scaling arguments (used only with ``precision="fp16"``).

    The range is ``DynamicLossScaler``'s (``min_scale=1``, ``max_scale=2**32``): a value outside
    it would otherwise fail only at ``boost``, and only under fp16.
    """
    if isinstance(initial_scale, bool) or not isinstance(initial_scale, (int, float)) \
            or not 1.0 <= initial_scale <= 2.0 ** 32:
        raise ValueError(f"initial_scale must be a number in [1, 2**32] (a power of two keeps "
                         f"scaling exact), got {initial_scale!r}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) \
            or growth_interval < 1:
        raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
    return float(initial_scale), growth_interval


def check_bucket_size(reduce_bucket_size_in_m: object, fp8_communication: bool) -> int:
    """ZeRO's ``reduce_bucket_size_in_m`` (LowLevelZero, Hybrid) as a bucket size in elements.

    None: 12 (millions of elements, 2**20), or 64 with ``fp8_communication``: each FP8
    collective carries a fixed cost (scale, cast and decode launches), so FP8 wants fewer,
    larger buckets (``LowLevelZeroPlugin``'s docstring has the measurement).
    """
    if reduce_bucket_size_in_m is None:
        reduce_bucket_size_in_m = 64 if fp8_communication else 12
    if isinstance(reduce_bucket_size_in_m, bool) or \
            not isinstance(reduce_bucket_size_in_m, (int, float)) or reduce_bucket_size_in_m <= 0:
        raise ValueError("reduce_bucket_size_in_m must be > 0 (millions of elements), got "
                         f"{reduce_bucket_size_in_m!r}")
    return max(1, int(reduce_bucket_size_in_m * 1024 * 1024))


@dataclass(frozen=True, kw_only=True)
class PluginOptions:
    """Precision, FP8 and optimizer options that every plugin takes (checked on construction).

    What ``fp8_communication`` puts on the wire differs per plugin (each plugin's docstring and
    docs/PLUGINS.md say); everything else means the same everywhere.

    Example:
        >>> from fp8boost.plugins import LowLevelZeroPlugin
        >>> LowLevelZeroPlugin(use_fp8=True, max_norm=1.0).options.max_norm
        1.0
    """

    precision: str = "bf16"
    """``"bf16"``, ``"fp16"`` (dynamic loss scaling) or ``"fp32"``: the dtype of the working
    parameters and activations; BF16/FP16 keep FP32 master weights. FP8 GEMMs come on top of
    BF16 with ``use_fp8``."""
    use_fp8: bool = False
    """Swap eligible linear layers (``nn.Linear``, HF ``Conv1D``) for FP8 ones at ``boost``
    (``convert_to_fp8``): their GEMMs run in FP8."""
    fp8_config: Optional[Fp8Config] = None
    """The FP8 recipe for ``use_fp8`` and which layers convert (None: ``Fp8Config()``)."""
    fp8_communication: bool = False
    """Put FP8 bytes on the wire for this plugin's collectives (which ones: the plugin's docs)."""
    fp8_reduce_scatter: bool = False
    """With ``fp8_communication``, reduce gradients as FP8 (e5m2, per-chunk scales) too: off by
    default because it measured slower on NVLink; for slow (inter-node) links."""
    comm_config: Optional[Fp8CommConfig] = None
    """An ``Fp8CommConfig`` (``fp8boost.parallel.comm.config``) tuning FP8 communication."""
    max_norm: float = 0.0
    """Clip the global gradient norm (over all shards) to this at every step; 0 disables."""
    initial_scale: float = 2.0 ** 16
    """FP16 dynamic loss scaling: the first scale, in [1, 2**32]."""
    growth_interval: int = 1000
    """FP16 dynamic loss scaling: steps without overflow before the scale grows."""
    fused_lm_loss: Union[bool, FusedLmLossConfig] = True
    """Fuse an HF causal LM's ``lm_head`` with its loss (``fp8boost.loss``): chunked linear +
    cross-entropy, no ``[tokens, vocab]`` logits (at 8192 tokens x 128k vocab: ~10 GB of
    logits, their FP32 copy and its gradient); the memory buys a larger micro-batch. Same loss
    as HF (``ForCausalLMLoss``: shift, ignore_index, mean or ``num_items_in_batch``); BF16
    weight gradients differ by a few ulps (accumulated per chunk). On by default because it
    applies only where it is exact in meaning: forwards with ``labels`` under autograd, of
    models whose forward is HF's standard one (checked on its source), in BF16/FP32, not under
    pipeline stages or Ulysses; everything else runs HF's forward (a one-time INFO line says
    which, and why). The cost: those forwards return ``logits=None`` (the logits are what is
    not built); False keeps them. A ``FusedLmLossConfig`` sets the chunk size."""

    fused_norm: bool = False
    """Run the model's HF RMSNorms with Llama's formula through ``F.rms_norm`` in eager mode
    (``fp8boost.norm.install_fused_rms_norms``, step 3b of ``configure``): one call instead of
    HF's six or so eager kernels each way; under ``torch.compile`` the model's own forward
    runs (inductor fuses it). Not FP8: a BF16 run gains the same. Outputs differ from HF's by
    at most one unit in the last place (one rounding instead of two). Colossal-AI's
    ``enable_fused_normalization`` / ``enable_all_optimization`` turn it on."""

    def __post_init__(self) -> None:
        check_precision(self.precision)
        for name in ("use_fp8", "fp8_communication", "fp8_reduce_scatter", "fused_norm"):
            check_bool(name, getattr(self, name))
        if self.fp8_reduce_scatter and not self.fp8_communication:
            raise ValueError("fp8_reduce_scatter=True needs fp8_communication=True")
        check_fp8_config(self.fp8_config)
        check_comm_config(self.comm_config)
        object.__setattr__(self, "max_norm", check_max_norm(self.max_norm))
        scale, interval = check_loss_scaling(self.initial_scale, self.growth_interval)
        object.__setattr__(self, "initial_scale", scale)
        object.__setattr__(self, "growth_interval", interval)
        resolve_fused_lm_loss(self.fused_lm_loss)  # raises TypeError on anything else


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(PluginOptions))


def _option_parameters() -> dict[str, inspect.Parameter]:
    """Each field of :class:`PluginOptions` as a keyword-only parameter with its default."""
    return {f.name: inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                      annotation=f.type)
            for f in dataclasses.fields(PluginOptions)}


def install_signature(cls: type, init: Callable, every: dict[str, inspect.Parameter],
                      positional: tuple[str, ...]) -> None:
    """Give ``cls`` an ``__init__`` with this public signature: ``positional`` first, in that
    order, then every other parameter of ``every`` keyword-only, with their defaults. It binds
    a call to that signature (a wrong call raises ``TypeError`` naming the class), applies the
    defaults and calls ``init(self, **arguments)``; ``help()`` and ``inspect.signature`` show
    it. The plugin decorators here and under ``fp8boost.colossal`` both build on it."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [every[n].replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in positional]
    params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for n, p in every.items() if n not in positional]
    signature = inspect.Signature(params, return_annotation=None)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as e:  # name the class, as Python's own message does
            raise TypeError(f"{cls.__name__}(): {e}") from None
        bound.apply_defaults()
        bound.arguments.pop("self")
        init(self, **bound.arguments)

    __init__.__signature__ = signature  # what help() and inspect show
    cls.__init__ = __init__


def takes_plugin_options(positional: tuple[str, ...] = (),
                         without: tuple[str, ...] = ()) -> Callable[[type], type]:
    """Class decorator: the plugin's ``__init__`` takes every :class:`PluginOptions` field.

    The plugin writes ``def __init__(self, <its own arguments>, **options)`` and passes
    ``options`` to ``Plugin.__init__``. The decorated ``__init__`` has the public signature:
    ``positional`` first, in that order (own arguments or option fields: the order callers
    have relied on), then the remaining own arguments, then the remaining option fields, all
    keyword-only. An option the plugin declares itself (e.g. ``precision=None`` in
    ``TorchDDPPlugin``) keeps the plugin's default and is the plugin's to pass on; ``without``
    names the options a plugin does not take (their defaults apply).

    ``help()``, ``inspect.signature``, IPython/Jupyter and the docs test see that signature;
    a static analyser reading the source sees the plugin's own arguments and ``**options``.

    Example:
        >>> import inspect
        >>> from fp8boost.plugins import TorchFSDPPlugin
        >>> list(inspect.signature(TorchFSDPPlugin).parameters)[:3]
        ['precision', 'max_norm', 'reshard_after_forward']
    """
    def decorate(cls: type) -> type:
        init = cls.__dict__["__init__"]
        own = dict(inspect.signature(init).parameters)
        if not own or next(iter(own)) != "self" or \
                own.pop(list(own)[-1]).kind is not inspect.Parameter.VAR_KEYWORD:
            raise TypeError(f"{cls.__name__}.__init__ must be (self, ..., **options)")
        own.pop("self")
        shared = {n: p for n, p in _option_parameters().items() if n not in own and n not in without}
        every = {**own, **shared}
        unknown = [n for n in positional if n not in every] + \
            [n for n in without if n not in OPTION_NAMES]
        if unknown:
            raise TypeError(f"{cls.__name__}: no argument named {unknown}")
        install_signature(cls, init, every, positional)
        return cls

    return decorate
