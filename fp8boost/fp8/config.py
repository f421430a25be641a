"""FP8 training configuration: one frozen, validated object per run.

A recipe is a config object, never a bag of kwargs. Two names, two things: the ``recipe``
field is the scaling algorithm (``tensorwise``, ``delayed``, ``rowwise`` or ``blockwise``); a
*named recipe* (:meth:`Fp8Config.from_recipe`: ``tensorwise``, ``tensorwise_pow2``,
``tensorwise_e4m3``, ``delayed``, ``rowwise``, ``rowwise_with_gw_hp``, ``blockwise``,
``blockwise_pow2``) is a preset of several fields, the scaling algorithm among them. A
recipe can also be one object of :mod:`fp8boost.fp8.recipes` (``Tensorwise``, ``Delayed``,
``Rowwise``, ``Blockwise``), holding only that recipe's fields: ``Fp8Config(recipe=
Blockwise(block_size=64))``; the config stores it as its flat fields, so every reader of
``cfg.recipe``/``cfg.block_size`` and every saved config sees the same thing as before.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional, Union

import torch

# FORMATS and AMAX_ALGOS live with the recipe classes that check them; still importable here.
from .recipes import (AMAX_ALGOS, FIELD_RECIPES, FORMATS, RECIPE_CLASSES, ScalingRecipe,
                      check_recipe_fields)

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")
GRANULAR_RECIPES = ("rowwise", "blockwise")
"""The recipes with one scale per row or tile (``fp8boost.fp8.granular``), not per tensor."""
BACKENDS = ("auto", "triton", "cublas", "emulated")
COMPILED_CASTS = ("inductor", "kernel")
EXPERT_WGRADS = ("auto", "fp8", "high_precision")
DEFAULT_MIN_NUMEL = 4096 * 4096
"""The library default of ``Fp8Config.min_numel`` (used where that field is None)."""


@dataclass(frozen=True, kw_only=True)
class Fp8Config:
    """How linear layers run their GEMMs in FP8.

    The fields come in four groups: the scaling recipe (``recipe`` .. ``wgrad_high_precision``,
    also settable as one :mod:`~fp8boost.fp8.recipes` object), the GEMMs (``expert_wgrad`` ..
    ``fast_accum_wgrad``), the casts (``cache_weight_cast`` .. ``recompute_weight_cast``) and
    the default layer filter (``skip_module_names`` .. ``min_numel``). A recipe field that the
    chosen recipe does not read is refused unless it keeps its default.

    Example:
        >>> from fp8boost.fp8 import Blockwise, Fp8Config
        >>> cfg = Fp8Config.from_recipe("delayed", amax_history_len=32)
        >>> cfg.recipe, cfg.amax_history_len
        ('delayed', 32)
        >>> Fp8Config(recipe=Blockwise(block_size=64)) == Fp8Config(
        ...     recipe="blockwise", fp8_format="e4m3", block_size=64)
        True
    """

    # -- The scaling recipe: `recipe` and the fields of the recipe classes (fp8boost.fp8.
    # recipes), kept flat because every layer, the CLI and saved configs read these names.
    recipe: Union[str, ScalingRecipe] = "tensorwise"
    """Scaling algorithm. ``tensorwise``: current ("real-time") per-tensor scaling, the scale is
    computed from the tensor being cast. ``delayed``: TE-style, the scale comes from a history of
    past amax values (cheaper, one step stale). ``rowwise``: current scaling with one scale per
    row of each GEMM operand in its NT form (amax over the reduced dim; the weight-gradient
    operands are scaled along the token axis). ``blockwise`` (DeepSeek-V3): activations and
    gradients in 1 x ``block_size`` tiles along each GEMM's reduced dim, weights in
    ``block_size`` x ``block_size`` blocks. Both in ``fp8boost.fp8.granular``; they survive
    outliers that set a per-tensor scale. The named recipes of :meth:`from_recipe`
    (``tensorwise_pow2``, ``rowwise_with_gw_hp``, ...) are presets that set this field and
    others: ``Fp8Config(recipe="tensorwise_pow2")`` is refused with a pointer to
    ``from_recipe``. The named ``rowwise``/``blockwise`` presets also set e4m3 gradients and
    (rowwise) power-of-2 scales: ``Fp8Config(recipe="rowwise")`` alone keeps the field
    defaults (hybrid formats, FP32 scales).

    Also a recipe object (``Tensorwise()``, ``Delayed()``, ``Rowwise()``, ``Blockwise()``, in
    :mod:`fp8boost.fp8.recipes`; their defaults are the named presets): it is stored as its
    name and its fields, so this field always reads as a string and :attr:`recipe_config`
    gives the object back. A flat field passed with a different non-default value too is
    refused; one left at its default cannot be told from one not passed, the object's wins."""

    fp8_format: str = "hybrid"
    """``hybrid``: e4m3 for activations and weights, e5m2 for gradients (range over precision).
    ``e4m3``: e4m3 everywhere."""

    amax_history_len: int = 16
    """Delayed scaling only: how many past amax values are kept per tensor (the other recipes
    read no history, so a non-default value with them is refused)."""

    amax_compute_algo: str = "max"
    """Delayed scaling only: ``max`` over the history, or the ``most_recent`` entry (a
    non-default value with another recipe is refused)."""

    margin: int = 0
    """Scale is divided by ``2**margin``: head-room against growth between steps. Rowwise and
    blockwise apply it to every row/tile scale (current scaling needs none: 0 is right)."""

    power_of_2_scale: bool = False
    """Round each scale down to a power of two, so scaling is exact in the mantissa. Applies
    to every recipe, per row or tile for rowwise/blockwise (the named ``rowwise`` recipe turns
    it on, as torchao's rowwise recipe does; ``blockwise`` keeps FP32 scales as DeepSeek-V3
    trained, ``blockwise_pow2`` rounds them)."""

    block_size: int = 128
    """Blockwise only: the tile length (activations and gradients: 1 x block_size along each
    GEMM's reduced dim) and the weight block side (block_size x block_size). A power of two
    >= 16; cuBLAS's blockwise GEMM takes 128 only (other sizes run the dequantizing fallback,
    with a warning). Dims that are not multiples of it end in a partial tile/block scaled from
    its own elements."""

    wgrad_high_precision: bool = False
    """Rowwise/blockwise only: compute the weight gradient ``dy^T . x`` in high precision (the
    input's dtype, BF16 in training) instead of FP8, as torchao's ``rowwise_with_gw_hp``. As
    there, the layer then saves its input in high precision for backward (not an FP8 copy):
    2 bytes per element instead of 1, for an exact weight gradient."""

    # -- GEMMs: the MoE weight gradient, the backend, tensor-core accumulation.
    expert_wgrad: str = "auto"
    """Fused-expert (MoE) modules: the weight gradient's grouped GEMM in ``fp8`` (``dy^T`` and
    ``x^T`` cast per (expert, column), ``x^T`` saved in FP8) or ``high_precision`` (the
    input's dtype, BF16 in training: ``torch._grouped_mm`` on CUDA; ``x`` saved as it is, as
    in BF16 training, 2 bytes per element instead of 1); the forward and input-gradient GEMMs
    stay FP8 either way. ``auto``: on the GPU, the faster of the two at the module's shape,
    timed once and cached (:mod:`fp8boost.fp8.moe.choice`, which also keeps the experts in
    BF16 where FP8 is slower under the default ``min_numel``); elsewhere ``fp8``. torch's FP8
    K-grouped GEMM ran the Qwen3-30B-A3B expert shapes (128 experts x 768) at 0.21-0.31x
    BF16's speed on an H200 (issue 34)."""

    backend: str = "auto"
    """``auto`` (triton on sm89+, else emulated, with a one-time warning), ``triton``,
    ``cublas`` (``torch._scaled_mm``) or ``emulated`` (exact FP8 rounding, FP32 matmul; any
    device, used by the CPU tests)."""

    fast_accum_fprop: bool = True
    """Fast (less precise) tensor-core accumulation in the forward GEMM."""

    fast_accum_dgrad: bool = False
    """Fast accumulation in the input-gradient GEMM (off: gradients want precision).
    Blockwise GEMMs always promote to FP32 (per 128 of K, the recipe's point) and ignore the
    three ``fast_accum_*`` fields."""

    fast_accum_wgrad: bool = False
    """Fast accumulation in the weight-gradient GEMM (off: long K = tokens)."""

    # -- Casts to FP8: caching, compiled casts, sharing, recomputation in backward.
    cache_weight_cast: bool = True
    """Reuse the weight's FP8 cast while the weight is unchanged, from its second forward on
    (micro-batches, gradient accumulation, recomputation). A weight read once per optimizer
    step is cast each time and nothing is kept (the cache would only pin memory). Compiled
    layers cannot read the cache; a pipeline schedule casts their weights once per step instead
    (``fp8boost.fp8.cast_once``), which this switch turns off too. Rowwise and
    blockwise: a frozen weight's (LoRA base) two operands are kept across steps; a trained
    weight is cast in every forward (no micro-batch cache yet)."""

    compiled_casts: str = "inductor"
    """Under ``torch.compile``, how activations, gradients and weights are cast to FP8.
    ``inductor``: amax, scale and saturating cast as plain torch ops, which inductor fuses into
    the kernels that produce the tensor (RMSNorm, SiLU*mul, residual adds) and may recompute in
    backward instead of saving; only the GEMM stays an opaque op. The scale may differ from
    eager's in the last bit (inductor's FP32 division), so compiled and eager casts can round a
    few elements differently. ``kernel``: fp8boost's Triton cast kernel as one opaque op per
    cast (bit-identical to eager, but nothing fuses into it). Eager mode always uses the
    kernel."""

    share_input_casts: bool = True
    """Eager mode: layers that read the same input tensor (q/k/v, gate/up) share one FP8 cast
    of it (one amax + cast instead of three, and one saved FP8 copy for backward), under the
    tensorwise, rowwise and blockwise recipes (delayed scaling keeps a history per layer and
    never shares). Exact: the shared cast is the one each layer would have made. Under
    ``torch.compile`` the compiler's common-subexpression elimination does the same."""

    recompute_weight_cast: bool = True
    """Current scaling: backward re-casts the weight for the input-gradient GEMM (from the
    Parameter, which is kept anyway, with the forward cast's amax: the same bytes) instead of
    holding its transposed FP8 copy from forward to backward. Saves 1 byte per weight element
    of activation memory for one weight cast more per backward; a cached weight cast (see
    ``cache_weight_cast``) is used as it is. ``False`` keeps the copy (the earlier behaviour).
    Eager and compiled (``bench/saved_activations.py`` measures what each layer keeps).
    Rowwise/blockwise: the same choice (re-quantize W's dgrad operand from the Parameter in
    backward, or keep its FP8 copy from forward)."""

    # -- The default layer filter of convert_to_fp8: which linear layers stay high precision.
    skip_module_names: tuple[str, ...] = ("lm_head",)
    """Default filter: linear layers whose qualified name ends with one of these stay high precision."""

    min_features: int = 16
    """Default filter: layers with in or out features below this stay high precision."""

    min_numel: Optional[int] = None
    """Default filter: layers with fewer weight elements than this stay high precision (too small
    to gain). ``None`` (the default) means the library default, ``DEFAULT_MIN_NUMEL`` =
    4096*4096, a speed rule applied only where FP8 can be fast (backend ``triton`` or
    ``cublas``, or ``auto`` with an sm89+ GPU present); without FP8 tensor cores it is waived
    (logged once), so small models still run FP8 numerics. Any int, 4096*4096 included, is an
    explicit choice and applies on every backend; ``convert.min_numel_limit`` resolves the
    field, in one place. The library default comes from whole-model training steps on an H200
    (bench/results/threshold_h200_2026-11-22.json): converting every linear layer made a 125M
    Llama 0.37x and a 1B Llama (2048x5632 MLP) 0.81x as fast as BF16, while a Llama-7B-shaped
    model (4096x4096 and 4096x11008 layers) ran 1.17x faster. Re-measured on an H100
    (bench/results/single_gpu_h100_1b*_2026-11-23.json): every layer of the 1B model in FP8 is
    0.90-1.02x BF16 in eager (1.08x on an H200), but 1.10-1.14x BF16 under torch.compile
    (1.19x on an H200), so pass 0 when compiling a small model. Set 0 to convert every
    eligible layer (also to test FP8 numerics)."""

    def __post_init__(self) -> None:
        if isinstance(self.recipe, ScalingRecipe):
            self._take_recipe_object(self.recipe)
        if self.recipe in NAMED_RECIPES and self.recipe not in RECIPES:
            # `recipe` is the scaling algorithm; the named recipes are presets of several fields.
            raise ValueError(
                f"Fp8Config(recipe={self.recipe!r}): {self.recipe!r} is a named recipe, not a "
                f"scaling algorithm; use Fp8Config.from_recipe({self.recipe!r}). The recipe "
                f"field takes {RECIPES}")
        _check_choice("recipe", self.recipe, RECIPES)
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("compiled_casts", self.compiled_casts, COMPILED_CASTS)
        _check_choice("expert_wgrad", self.expert_wgrad, EXPERT_WGRADS)
        # The recipe fields are checked by the same code (and words) as the recipe classes.
        check_recipe_fields("Fp8Config", {name: getattr(self, name) for name in FIELD_RECIPES})
        for name in ("min_features", "min_numel"):
            value = getattr(self, name)
            if name == "min_numel" and value is None:  # the library default (see the field)
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                kind = "an int or None" if name == "min_numel" else "an int"
                raise TypeError(f"Fp8Config.{name} must be {kind}, got {type(value).__name__}")
        self._check_recipe_fit()
        if self.min_features < 1:
            raise ValueError(f"Fp8Config.min_features must be >= 1, got {self.min_features}")
        if self.min_numel is not None and self.min_numel < 0:
            raise ValueError(f"Fp8Config.min_numel must be >= 0, got {self.min_numel}; use 0 to "
                             "convert every eligible layer whatever its size")
        if isinstance(self.skip_module_names, str) or not all(
                isinstance(n, str) for n in self.skip_module_names):
            raise TypeError("Fp8Config.skip_module_names must be a tuple of str, "
                            "e.g. ('lm_head',)")
        object.__setattr__(self, "skip_module_names", tuple(self.skip_module_names))

    def _take_recipe_object(self, recipe: ScalingRecipe) -> None:
        """Store a recipe object as ``recipe`` (its name) and its fields, flat."""
        for name, value in recipe.config_fields().items():
            current = getattr(self, name)
            # A flat field at its default cannot be told from one not passed: the object wins.
            if name != "recipe" and current != _DEFAULTS[name] and current != value:
                kind = type(recipe).__name__
                fix = (f"{kind} always sets {name}={value!r}; drop {name}={current!r}"
                       if name in recipe.fixed_fields else
                       f"set it in the recipe object only: {kind}(..., {name}={current!r})")
                raise ValueError(f"Fp8Config(recipe={recipe!r}, {name}={current!r}): {name} is "
                                 f"set twice, differently; {fix}")
            object.__setattr__(self, name, value)

    def _check_recipe_fit(self) -> None:
        """The recipe fields fit the recipe: the ones it does not read keep their defaults."""
        if self.recipe == "blockwise" and self.fp8_format != "e4m3":
            # cuBLAS's blockwise GEMMs (torch's scaled_mm BlockWise1x128/128x128) take e4m3
            # operands only: an e5m2 gradient is refused on the GPU (measured on an H100,
            # torch 2.11). DeepSeek-V3 trained its gradients in e4m3 with 1x128 tiles too.
            raise ValueError(
                f"Fp8Config(recipe='blockwise', fp8_format={self.fp8_format!r}): blockwise "
                "scaling casts gradients to e4m3 (cuBLAS's blockwise GEMMs take e4m3 only); use "
                "Fp8Config.from_recipe('blockwise') or fp8_format='e4m3'")
        for name, recipes in FIELD_RECIPES.items():
            value, default = getattr(self, name), _DEFAULTS[name]
            if self.recipe in recipes or value == default:
                continue
            # Refused rather than ignored: a knob of another recipe set here does nothing.
            fix = f"Fp8Config(recipe={RECIPE_CLASSES[recipes[0]].__name__}({name}={value!r}))"
            presets = [n for n, fields in NAMED_RECIPES.items() if fields.get(name) == value]
            if presets:
                fix += f" or Fp8Config.from_recipe({presets[0]!r})"
            where = "/".join(repr(r) for r in recipes)
            raise ValueError(f"Fp8Config.{name}={value!r} applies to recipe={where} only (recipe "
                             f"is {self.recipe!r}); leave it at {default!r}, or choose that "
                             f"recipe: {fix}")

    @property
    def recipe_config(self) -> ScalingRecipe:
        """The recipe and its fields as one object of :mod:`fp8boost.fp8.recipes` (read-only).

        Example:
            >>> from fp8boost.fp8 import Blockwise
            >>> Fp8Config.from_recipe("blockwise").recipe_config == Blockwise()
            True
        """
        return RECIPE_CLASSES[self.recipe].from_fields(self)

    @property
    def fwd_dtype(self) -> torch.dtype:
        """FP8 dtype of activations and weights."""
        return torch.float8_e4m3fn

    @property
    def grad_dtype(self) -> torch.dtype:
        """FP8 dtype of output gradients."""
        return torch.float8_e5m2 if self.fp8_format == "hybrid" else torch.float8_e4m3fn

    def replace(self, **changes) -> "Fp8Config":
        """A copy with some fields changed (validated again).

        A recipe object in ``changes`` replaces the whole recipe: the recipe fields it does not
        set go back to their defaults (a string ``recipe`` keeps them, and so may be refused).

        Example:
            >>> from fp8boost.fp8 import Rowwise
            >>> cfg = Fp8Config.from_recipe("blockwise", block_size=64).replace(recipe=Rowwise())
            >>> cfg.recipe, cfg.block_size
            ('rowwise', 128)
        """
        if isinstance(changes.get("recipe"), ScalingRecipe):
            changes = {**{name: _DEFAULTS[name] for name in FIELD_RECIPES}, **changes}
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_recipe(cls, name: str, **overrides) -> "Fp8Config":
        """Build a named recipe, optionally overriding fields.

        Recipes: ``tensorwise`` (default: current scaling, hybrid formats),
        ``tensorwise_pow2`` (power-of-two scales), ``delayed`` (amax history of 16, max),
        ``tensorwise_e4m3`` (e4m3 for gradients too), ``rowwise`` (per-row scales, e4m3
        everywhere, power-of-two scales: torchao's rowwise), ``rowwise_with_gw_hp`` (the same
        with the weight gradient in high precision), ``blockwise`` (DeepSeek-V3: 1x128 tiles,
        128x128 weight blocks, e4m3 everywhere, FP32 scales), ``blockwise_pow2`` (its scales
        rounded to powers of two).

        Example:
            >>> Fp8Config.from_recipe("rowwise").power_of_2_scale
            True
        """
        if name not in NAMED_RECIPES:
            raise ValueError(f"unknown FP8 recipe {name!r}; choose one of {sorted(NAMED_RECIPES)}")
        return cls(**{**NAMED_RECIPES[name], **overrides})


NAMED_RECIPES: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    name: MappingProxyType(fields) for name, fields in {
        "tensorwise": {},
        "tensorwise_pow2": {"power_of_2_scale": True},
        "delayed": {"recipe": "delayed", "amax_history_len": 16, "amax_compute_algo": "max"},
        "tensorwise_e4m3": {"fp8_format": "e4m3"},
        # With a scale per row/tile, e4m3's precision beats e5m2's range for gradients too
        # (torchao's rowwise recipes and DeepSeek-V3 use e4m3 everywhere).
        "rowwise": {"recipe": "rowwise", "fp8_format": "e4m3", "power_of_2_scale": True},
        "rowwise_with_gw_hp": {"recipe": "rowwise", "fp8_format": "e4m3",
                               "power_of_2_scale": True, "wgrad_high_precision": True,
                               "expert_wgrad": "high_precision"},
        "blockwise": {"recipe": "blockwise", "fp8_format": "e4m3"},
        "blockwise_pow2": {"recipe": "blockwise", "fp8_format": "e4m3", "power_of_2_scale": True},
    }.items()})


_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {f.name: f.default for f in dataclasses.fields(Fp8Config)})
"""Each Fp8Config field's default (none has a default factory)."""


def option_value(text: str) -> Union[bool, int, str]:
    """A field value written on a command line (``--fp8-option margin=1``): ``true`` /
    ``false`` as a bool, an integer as an int, else the text (every field that takes a value
    from text is a bool, an int or a name; ``Fp8Config`` checks the result).

    Example:
        >>> option_value("False"), option_value("-2"), option_value("hybrid")
        (False, -2, 'hybrid')
    """
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return int(text) if text.lstrip("-").isdigit() else text


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Fp8Config.{name}={value!r} is not supported; use one of {choices}")
