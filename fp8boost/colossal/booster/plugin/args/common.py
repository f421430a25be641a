"""What the Colossal-AI-facing plugins share: their argument checks and the class decorator.

Each plugin of :mod:`fp8boost.colossal.booster.plugin.args` takes Colossal-AI's arguments that
fp8boost's own plugin (``fp8boost.plugins``) does not: it checks their types, raises
``ValueError`` naming the fp8boost alternative for what fp8boost does not support, logs once
per process (``fp8boost._state.log_once``, INFO, key ``"colossal-args.<plugin>.<arg>"``) what
fp8boost does instead when a value that tunes Colossal-AI internals is passed, and hands the
mapped values to the fp8boost plugin. :func:`takes_colossal_args` gives such a class its public
signature: the fp8boost plugin's, plus Colossal-AI's arguments as keywords.
"""
from __future__ import annotations

import inspect
import logging
from types import MappingProxyType
from typing import Callable, Mapping

import torch

from fp8boost import _state
from fp8boost.plugins.options import install_signature

# the name fp8boost's plugins log under, which users filter by (these checks lived there)
logger = logging.getLogger("fp8boost.plugins")


def takes_colossal_args(positional: tuple[str, ...]) -> Callable[[type], type]:
    """Class decorator for a subclass of an fp8boost plugin that also takes Colossal-AI's
    arguments.

    The subclass writes ``def __init__(self, *, <Colossal-AI's arguments>, **native)`` and
    passes ``native`` (mapped) to the fp8boost plugin. The decorated ``__init__`` has the
    public signature: ``positional`` first, in that order, then every other argument of the
    base plugin and of the subclass, keyword-only, with their defaults; ``help()`` and
    ``inspect.signature`` show it, and a wrong call raises ``TypeError`` naming the class.

    Example:
        >>> import inspect
        >>> from fp8boost.colossal.booster.plugin.args import TorchDDPPlugin
        >>> "check_reduction" in inspect.signature(TorchDDPPlugin).parameters
        True
    """
    def decorate(cls: type) -> type:
        init = cls.__dict__["__init__"]
        own = dict(inspect.signature(init).parameters)
        own.pop("self")
        if not own or own.pop(list(own)[-1]).kind is not inspect.Parameter.VAR_KEYWORD:
            raise TypeError(f"{cls.__name__}.__init__ must be (self, *, ..., **native)")
        every = {**dict(inspect.signature(cls.__mro__[1]).parameters), **own}
        unknown = [n for n in positional if n not in every]
        if unknown:
            raise TypeError(f"{cls.__name__}: no argument named {unknown}")
        install_signature(cls, init, every, positional)
        return cls

    return decorate


def check_type(name: str, value: object, kinds: tuple[type, ...], what: str) -> None:
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise TypeError(f"{name} must be {what}, got {value!r}")


def log_info(plugin: str, name: str, message: str) -> None:
    _state.log_once(logger, f"colossal-args.{plugin}.{name}", f"fp8boost: {message}",
                    level=logging.INFO)


# ------------------------------------------------------------------------- loss scaling
LOSS_SCALE_DEFAULTS = MappingProxyType({"min_scale": 1.0, "growth_factor": 2.0,
                                        "backoff_factor": 0.5, "hysteresis": 2,
                                        "max_scale": 2.0 ** 32})
"""Colossal-AI's fp16 dynamic loss scaling arguments and defaults (both plugins)."""


def loss_scale_args(plugin: str, precision: str, *, min_scale: float, growth_factor: float,
                    backoff_factor: float, hysteresis: int, max_scale: float) -> dict:
    """Check Colossal-AI's loss-scaling arguments; returns the ``DynamicLossScaler`` keywords.

    They matter only under ``precision="fp16"`` (Colossal-AI ignores them otherwise, and so
    does fp8boost, silently at the defaults). ``hysteresis`` is not implemented: fp8boost backs
    the scale off at every overflow (``hysteresis=1``), said once under fp16 otherwise.
    """
    for name, value in (("min_scale", min_scale), ("growth_factor", growth_factor),
                        ("backoff_factor", backoff_factor), ("max_scale", max_scale)):
        check_type(name, value, (int, float), "a number")
    check_type("hysteresis", hysteresis, (int,), "an int >= 1")
    if hysteresis < 1:
        raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")
    if not growth_factor > 1.0:
        raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
    if not 0.0 < min_scale <= max_scale:
        raise ValueError(f"need 0 < min_scale <= max_scale, got min_scale={min_scale!r}, "
                         f"max_scale={max_scale!r}")
    given = dict(min_scale=min_scale, growth_factor=growth_factor,
                 backoff_factor=backoff_factor, hysteresis=hysteresis, max_scale=max_scale)
    changed = [n for n, v in given.items() if v != LOSS_SCALE_DEFAULTS[n]]
    if precision != "fp16":
        if changed:
            log_info(plugin, "loss-scale", f"{changed} not used: dynamic loss scaling runs only "
                  f"with precision='fp16' (precision={precision!r}), as in Colossal-AI")
        return {}
    if hysteresis != 1:
        log_info(plugin, "hysteresis", f"hysteresis={hysteresis} is not used: fp8boost's "
              "DynamicLossScaler backs the scale off at every overflow (hysteresis=1); the "
              "overflowing step is skipped either way")
    return dict(min_scale=float(min_scale), growth_factor=float(growth_factor),
                backoff_factor=float(backoff_factor), max_scale=float(max_scale))


def check_comm_dtype(plugin: str, communication_dtype: object, precision: str) -> None:
    if communication_dtype is None:
        return
    if not isinstance(communication_dtype, torch.dtype):
        raise TypeError(f"communication_dtype must be a torch.dtype or None, got "
                        f"{communication_dtype!r}")
    working = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    if communication_dtype != working:
        raise ValueError(
            f"communication_dtype={communication_dtype} differs from precision={precision!r}: "
            "fp8boost's ZeRO communicates in the working dtype; use communication_dtype=None, "
            "or fp8_communication=True to put FP8 on the wire")
    log_info(plugin, "communication_dtype", f"communication_dtype={communication_dtype} is the "
          "working dtype, which fp8boost's ZeRO communicates in anyway")


def check_bools(**values: object) -> None:
    for name, value in values.items():
        check_type(name, value, (bool,), "True or False")


MODEL_OWN = "fp8boost runs the model's own modules (SDPA attention, its normalization)"
SHARDFORMER_TUNING = MappingProxyType({
    "enable_flash_attention": (False, "fp8boost runs the model's own attention (SDPA, which "
                                      "uses flash attention through PyTorch)"),
    "enable_jit_fused": (False, MODEL_OWN),
})
"""Colossal-AI's Shardformer switches (name -> (default, what fp8boost does instead)), taken
by the Gemini, Hybrid and MoE plugins. ``enable_fused_normalization`` and
``enable_all_optimization`` are not here: they map onto fp8boost's ``fused_norm``
(:func:`map_fused_norm`)."""


def map_fused_norm(plugin: str, native: dict, enable_fused_normalization: bool,
                   enable_all_optimization: bool) -> None:
    """Colossal-AI's ``enable_fused_normalization`` (or ``enable_all_optimization``) turns on
    fp8boost's ``fused_norm`` in the native arguments ``native`` (in place): HF's RMSNorms
    through ``F.rms_norm``, as Colossal-AI's Shardformer swaps in its fused RMSNorm.
    ``enable_all_optimization`` logs once what it does and does not turn on."""
    check_bools(enable_fused_normalization=enable_fused_normalization,
                enable_all_optimization=enable_all_optimization)
    native["fused_norm"] = bool(native.get("fused_norm", False) or enable_fused_normalization
                                or enable_all_optimization)
    if enable_all_optimization:
        log_info(plugin, "enable_all_optimization", "enable_all_optimization=True: fp8boost "
                 "fuses the model's RMSNorms (fused_norm=True); for the rest of Colossal-AI's "
                 "kernels it runs the model's own modules (SDPA attention, its activations)")


def tuning_rows(values: Mapping[str, object], table: Mapping[str, tuple]) -> list[tuple]:
    """``(name, value, default, instead)`` rows for :func:`log_tuning` from a table like
    :data:`SHARDFORMER_TUNING` and the values passed."""
    return [(name, values[name], default, instead) for name, (default, instead) in table.items()]


def pick(values: Mapping[str, object], names) -> dict:
    """``{name: values[name]}`` for ``names``: an ``__init__`` hands a group of its own
    arguments on (``pick(locals(), NAMES)``) without listing each one twice."""
    return {name: values[name] for name in names}


def log_tuning(plugin: str, rows) -> None:
    """INFO once for each (name, value, default, what fp8boost does) whose value is not the
    default."""
    for name, value, default, instead in rows:
        if value != default:
            log_info(plugin, name, f"{name}={value!r} is not used: {instead}")


