"""One small, documented config class per FP8 scaling recipe (issue 38, item 4).

:class:`~fp8boost.fp8.config.Fp8Config` keeps its flat fields: every layer, the CLI and saved
configs read ``cfg.recipe``, ``cfg.block_size``, ... as before. These classes are the typed way
to choose a recipe and its knobs, each holding only the fields its recipe reads:
``Fp8Config(recipe=Blockwise(block_size=64))`` is ``Fp8Config(recipe="blockwise",
fp8_format="e4m3", block_size=64)``, and :attr:`Fp8Config.recipe_config` gives the object back.

A class's defaults are the named preset of the same name (:meth:`Fp8Config.from_recipe`):
``Rowwise()`` is ``from_recipe("rowwise")`` (e4m3, power-of-two scales, as torchao's rowwise),
``Blockwise()`` is ``from_recipe("blockwise")`` (DeepSeek-V3). The bare string
``Fp8Config(recipe="rowwise")`` keeps Fp8Config's own field defaults instead (hybrid formats,
FP32 scales), as it always did.

This module imports nothing of fp8boost (``config`` imports it), so it holds the choices that
both validate: ``FORMATS`` and ``AMAX_ALGOS``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

FORMATS = ("hybrid", "e4m3")
AMAX_ALGOS = ("max", "most_recent")
# A field's checks, so that a recipe class and Fp8Config refuse a value with the same words.
_CHOICES = MappingProxyType({"fp8_format": FORMATS, "amax_compute_algo": AMAX_ALGOS})
_BOOLS = ("power_of_2_scale", "wgrad_high_precision")
_INT_MINIMUM = MappingProxyType({
    "amax_history_len": (1, "; use 1 to scale from the last step only"),
    "margin": (0, ""), "block_size": (None, "")})


def check_recipe_fields(owner: str, values: Mapping[str, Any]) -> None:
    """Validate the recipe fields among ``values``; errors name ``owner.field`` and the fix.

    Fields that no recipe class holds are left to the caller.

    Example:
        >>> check_recipe_fields("Blockwise", {"block_size": 48})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Blockwise.block_size must be a power of two >= 16, got 48; use 128 ...
    """
    for name, value in values.items():
        if name in _CHOICES and value not in _CHOICES[name]:
            raise ValueError(f"{owner}.{name}={value!r} is not supported; use one of "
                             f"{_CHOICES[name]}")
        if name in _BOOLS and not isinstance(value, bool):
            raise TypeError(f"{owner}.{name} must be a bool, got {type(value).__name__}")
        if name in _INT_MINIMUM:
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__}")
            minimum, fix = _INT_MINIMUM[name]
            if minimum is not None and value < minimum:
                raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}{fix}")
    b = values.get("block_size")
    if b is not None and (b < 16 or b & (b - 1)):
        raise ValueError(f"{owner}.block_size must be a power of two >= 16, got {b}; "
                         "use 128 (DeepSeek-V3's, and the one cuBLAS runs)")


@dataclass(frozen=True, kw_only=True)
class ScalingRecipe:
    """What the recipe classes share: their name, the Fp8Config fields they set, validation.

    Not a recipe of its own: use :class:`Tensorwise`, :class:`Delayed`, :class:`Rowwise` or
    :class:`Blockwise`.
    """

    name: ClassVar[str] = ""
    """The ``Fp8Config.recipe`` string of this recipe."""

    fixed_fields: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    """Fp8Config fields this recipe sets to one value, with no knob (blockwise: e4m3)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise TypeError("ScalingRecipe is the base class; use Tensorwise(), Delayed(), "
                            "Rowwise() or Blockwise()")
        check_recipe_fields(type(self).__name__, self.knobs())

    def knobs(self) -> dict[str, Any]:
        """This object's fields by name (the Fp8Config fields of the same names)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def config_fields(self) -> dict[str, Any]:
        """Every Fp8Config field this recipe sets: ``recipe`` (its name), fixed ones, knobs.

        Example:
            >>> Blockwise(block_size=64).config_fields()["fp8_format"]
            'e4m3'
        """
        return {"recipe": self.name, **self.fixed_fields, **self.knobs()}

    @classmethod
    def from_fields(cls, source: Any) -> "ScalingRecipe":
        """The recipe object of the flat fields of ``source`` (an Fp8Config)."""
        return cls(**{f.name: getattr(source, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True, kw_only=True)
class Tensorwise(ScalingRecipe):
    """Current scaling, one scale per tensor, from that tensor's own amax (the default).

    Choose it first: the fastest recipe, and exact about the step it scales. It loses when
    activations grow outlier channels, since one outlier then sets the scale of the whole
    tensor: move to :class:`Rowwise` or :class:`Blockwise`.

    Example:
        >>> from fp8boost.fp8 import Fp8Config
        >>> Fp8Config(recipe=Tensorwise(power_of_2_scale=True)) == Fp8Config.from_recipe(
        ...     "tensorwise_pow2")
        True
    """

    name: ClassVar[str] = "tensorwise"

    fp8_format: str = "hybrid"
    """``hybrid``: e4m3 activations and weights, e5m2 gradients; ``e4m3`` everywhere (the
    ``tensorwise_e4m3`` preset)."""

    margin: int = 0
    """Each scale is divided by ``2**margin``; current scaling needs no head-room, 0 is right."""

    power_of_2_scale: bool = False
    """Round each scale down to a power of two (the ``tensorwise_pow2`` preset)."""


@dataclass(frozen=True, kw_only=True)
class Delayed(ScalingRecipe):
    """Delayed scaling, one scale per tensor from a history of past amax values (TE's recipe).

    Cheaper than current scaling (no amax pass before the cast) but one step stale: a tensor
    that grows past its history's maximum saturates for a step. Choose it to match a
    Transformer Engine run; otherwise :class:`Tensorwise` is as fast here and exact.

    Example:
        >>> from fp8boost.fp8 import Fp8Config
        >>> Fp8Config(recipe=Delayed(amax_history_len=32)).amax_history_len
        32
    """

    name: ClassVar[str] = "delayed"

    fp8_format: str = "hybrid"
    """``hybrid``: e4m3 activations and weights, e5m2 gradients; ``e4m3`` everywhere."""

    amax_history_len: int = 16
    """How many past amax values each tensor keeps (>= 1; 1 scales from the last step only)."""

    amax_compute_algo: str = "max"
    """The amax a scale comes from: ``max`` over the history, or its ``most_recent`` entry."""

    margin: int = 0
    """Each scale is divided by ``2**margin``: head-room against growth between steps."""

    power_of_2_scale: bool = False
    """Round each scale down to a power of two, so scaling is exact in the mantissa."""


@dataclass(frozen=True, kw_only=True)
class Rowwise(ScalingRecipe):
    """Current scaling with one scale per row of each GEMM operand (torchao's rowwise).

    Choose it for large models whose activations grow outlier channels: an outlier sets the
    scale of its rows only. Defaults are the ``rowwise`` preset (e4m3 everywhere, power-of-two
    scales); ``wgrad_high_precision=True`` is ``rowwise_with_gw_hp``.

    Example:
        >>> from fp8boost.fp8 import Fp8Config
        >>> Fp8Config.from_recipe("rowwise").recipe_config == Rowwise()
        True
    """

    name: ClassVar[str] = "rowwise"

    fp8_format: str = "e4m3"
    """``e4m3`` everywhere (with a scale per row, precision beats e5m2's range for gradients
    too), or ``hybrid`` (e5m2 gradients)."""

    margin: int = 0
    """Each row scale is divided by ``2**margin``."""

    power_of_2_scale: bool = True
    """Round each row scale down to a power of two, as torchao's rowwise recipe does."""

    wgrad_high_precision: bool = False
    """Run the weight-gradient GEMM in the input's dtype (BF16 in training) instead of FP8; the
    layer then saves its input in high precision (2 bytes per element instead of 1)."""


@dataclass(frozen=True, kw_only=True)
class Blockwise(ScalingRecipe):
    """DeepSeek-V3's scaling: 1 x ``block_size`` tiles for activations and gradients along each
    GEMM's reduced dim, ``block_size`` x ``block_size`` blocks for weights; e4m3 everywhere.

    Choose it where outliers defeat even per-row scales, or to train as DeepSeek-V3 did.
    Gradients are always e4m3 (cuBLAS's blockwise GEMMs take e4m3 operands only), so this class
    has no ``fp8_format`` and sets ``Fp8Config.fp8_format="e4m3"``.

    Example:
        >>> from fp8boost.fp8 import Fp8Config
        >>> cfg = Fp8Config(recipe=Blockwise(block_size=64))
        >>> cfg.recipe, cfg.fp8_format, cfg.block_size
        ('blockwise', 'e4m3', 64)
    """

    name: ClassVar[str] = "blockwise"
    fixed_fields: ClassVar[Mapping[str, Any]] = MappingProxyType({"fp8_format": "e4m3"})

    block_size: int = 128
    """Tile length and weight block side, a power of two >= 16. cuBLAS's blockwise GEMM takes
    128 only; other sizes run the dequantizing fallback, with a warning."""

    margin: int = 0
    """Each tile and block scale is divided by ``2**margin``."""

    power_of_2_scale: bool = False
    """Round each tile and block scale down to a power of two (``blockwise_pow2``); off keeps
    FP32 scales, as DeepSeek-V3 trained."""

    wgrad_high_precision: bool = False
    """Run the weight-gradient GEMM in the input's dtype (BF16 in training) instead of FP8; the
    layer then saves its input in high precision (2 bytes per element instead of 1)."""


RECIPE_CLASSES: Mapping[str, type[ScalingRecipe]] = MappingProxyType(
    {cls.name: cls for cls in (Tensorwise, Delayed, Rowwise, Blockwise)})
"""Each ``Fp8Config.recipe`` string and its class."""

FIELD_RECIPES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    name: tuple(r for r, cls in RECIPE_CLASSES.items()
                if name in cls.fixed_fields or name in {f.name for f in dataclasses.fields(cls)})
    for cls in RECIPE_CLASSES.values()
    for name in (*cls.fixed_fields, *(f.name for f in dataclasses.fields(cls)))})
"""Each Fp8Config field a recipe class sets and the recipes that read it."""
