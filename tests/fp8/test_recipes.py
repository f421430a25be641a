"""Per-recipe configuration (issue 38, item 4): one class per recipe in fp8boost.fp8.recipes,
``Fp8Config(recipe=<object>)``, ``Fp8Config.recipe_config``, misplaced or conflicting fields
refused, and the flat form every reader and saved config sees left as it was."""
from __future__ import annotations

import dataclasses
import doctest
import importlib
import pickle

import pytest

import fp8boost.fp8 as fp8
from fp8boost.fp8 import Blockwise, Delayed, Fp8Config, Rowwise, ScalingRecipe, Tensorwise
from fp8boost.fp8.config import NAMED_RECIPES, RECIPES
from fp8boost.fp8.recipes import RECIPE_CLASSES

# Each named preset as a recipe object, plus the non-recipe fields the preset also sets.
PRESETS = {
    "tensorwise": (Tensorwise(), {}),
    "tensorwise_pow2": (Tensorwise(power_of_2_scale=True), {}),
    "tensorwise_e4m3": (Tensorwise(fp8_format="e4m3"), {}),
    "delayed": (Delayed(), {}),
    "rowwise": (Rowwise(), {}),
    "rowwise_with_gw_hp": (Rowwise(wgrad_high_precision=True),
                           {"expert_wgrad": "high_precision"}),
    "blockwise": (Blockwise(), {}),
    "blockwise_pow2": (Blockwise(power_of_2_scale=True), {}),
}

# asdict(Fp8Config()) before the recipe classes existed, key order included, and what each
# named preset changed in it: the flat form must not move.
FLAT_DEFAULTS = {
    "recipe": "tensorwise", "fp8_format": "hybrid", "amax_history_len": 16,
    "amax_compute_algo": "max", "margin": 0, "power_of_2_scale": False, "block_size": 128,
    "wgrad_high_precision": False, "expert_wgrad": "auto", "backend": "auto",
    "fast_accum_fprop": True, "fast_accum_dgrad": False, "fast_accum_wgrad": False,
    "cache_weight_cast": True, "compiled_casts": "inductor", "share_input_casts": True,
    "recompute_weight_cast": True, "skip_module_names": ("lm_head",), "min_features": 16,
    "min_numel": None}
FLAT_PRESETS = {
    "tensorwise": {},
    "tensorwise_pow2": {"power_of_2_scale": True},
    "delayed": {"recipe": "delayed"},
    "tensorwise_e4m3": {"fp8_format": "e4m3"},
    "rowwise": {"recipe": "rowwise", "fp8_format": "e4m3", "power_of_2_scale": True},
    "rowwise_with_gw_hp": {"recipe": "rowwise", "fp8_format": "e4m3", "power_of_2_scale": True,
                           "wgrad_high_precision": True, "expert_wgrad": "high_precision"},
    "blockwise": {"recipe": "blockwise", "fp8_format": "e4m3"},
    "blockwise_pow2": {"recipe": "blockwise", "fp8_format": "e4m3", "power_of_2_scale": True},
}

NON_DEFAULT = [
    Tensorwise(fp8_format="e4m3", margin=1, power_of_2_scale=True),
    Delayed(fp8_format="e4m3", amax_history_len=8, amax_compute_algo="most_recent", margin=2,
            power_of_2_scale=True),
    Rowwise(fp8_format="hybrid", margin=1, power_of_2_scale=False, wgrad_high_precision=True),
    Blockwise(block_size=64, margin=3, power_of_2_scale=True, wgrad_high_precision=True),
]


def test_one_class_per_recipe_name():
    assert set(RECIPE_CLASSES) == set(RECIPES)
    for name, cls in RECIPE_CLASSES.items():
        assert cls.name == name and issubclass(cls, ScalingRecipe) and cls.__doc__
    assert {type(r) for r in NON_DEFAULT} == set(RECIPE_CLASSES.values())


@pytest.mark.parametrize("recipe", NON_DEFAULT + [cls() for cls in RECIPE_CLASSES.values()],
                         ids=repr)
def test_recipe_object_round_trips(recipe):
    cfg = Fp8Config(recipe=recipe, backend="emulated")
    assert type(cfg.recipe) is str and cfg.recipe == recipe.name
    assert cfg.recipe_config == recipe and type(cfg.recipe_config) is type(recipe)
    for name, value in recipe.config_fields().items():
        assert getattr(cfg, name) == value, name
    # the object is the same config as its flat fields passed by name
    assert cfg == Fp8Config(backend="emulated", **recipe.config_fields())
    assert pickle.loads(pickle.dumps(cfg)) == cfg and hash(cfg) == hash(cfg.replace())


def test_preset_table_covers_every_named_recipe():
    assert set(PRESETS) == set(NAMED_RECIPES) == set(FLAT_PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_named_recipe_maps_to_its_class_and_values(name):
    recipe, others = PRESETS[name]
    cfg = Fp8Config.from_recipe(name)
    assert type(cfg.recipe_config) is type(recipe) and cfg.recipe_config == recipe
    assert Fp8Config(recipe=recipe, **others) == cfg


@pytest.mark.parametrize("name", sorted(FLAT_PRESETS))
def test_serialised_form_is_unchanged(name):
    cfg = Fp8Config.from_recipe(name)
    flat = dataclasses.asdict(cfg)
    assert list(flat) == list(FLAT_DEFAULTS)  # same keys, same order
    assert flat == {**FLAT_DEFAULTS, **FLAT_PRESETS[name]}
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    # built from the recipe object instead: the same flat form, recipe as its string
    recipe, others = PRESETS[name]
    assert dataclasses.asdict(Fp8Config(recipe=recipe, **others)) == flat
    assert f"recipe={flat['recipe']!r}" in repr(Fp8Config(recipe=recipe))


def test_field_defaults_are_unchanged():
    assert {f.name: f.default for f in dataclasses.fields(Fp8Config)} == FLAT_DEFAULTS


def test_string_recipes_keep_the_field_defaults():
    # the bare string is not the preset: Fp8Config(recipe="rowwise") stays hybrid, FP32 scales
    assert Fp8Config(recipe="rowwise").recipe_config == Rowwise(fp8_format="hybrid",
                                                                power_of_2_scale=False)
    assert Fp8Config(recipe="blockwise", fp8_format="e4m3", block_size=64).recipe_config \
        == Blockwise(block_size=64)
    assert Fp8Config().recipe_config == Tensorwise()


def test_conflicting_flat_field_names_both():
    with pytest.raises(ValueError, match=r"Blockwise\(block_size=64.*block_size=32"):
        Fp8Config(recipe=Blockwise(block_size=64), block_size=32)
    with pytest.raises(ValueError, match=r"power_of_2_scale is set twice"):
        Fp8Config(recipe=Tensorwise(), power_of_2_scale=True)
    twice = r"amax_history_len is set twice.*Delayed\(\.\.\., amax_history_len=8\)"
    with pytest.raises(ValueError, match=twice):
        Fp8Config(recipe=Delayed(amax_history_len=4), amax_history_len=8)
    # the same value twice is no conflict
    assert Fp8Config(recipe=Rowwise(), fp8_format="e4m3").fp8_format == "e4m3"
    assert Fp8Config(recipe=Blockwise(block_size=64), block_size=64).block_size == 64


def test_a_flat_field_at_its_default_yields_to_the_object():
    # documented: a flat default cannot be told from one not passed
    assert Fp8Config(recipe=Blockwise(), fp8_format="hybrid").fp8_format == "e4m3"
    assert Fp8Config(recipe=Rowwise(), power_of_2_scale=False).power_of_2_scale


@pytest.mark.parametrize("recipe, field, value, owners", [
    ("tensorwise", "block_size", 64, "'blockwise'"),
    ("rowwise", "block_size", 256, "'blockwise'"),
    ("delayed", "block_size", 32, "'blockwise'"),
    ("tensorwise", "amax_history_len", 32, "'delayed'"),
    ("rowwise", "amax_compute_algo", "most_recent", "'delayed'"),
    ("blockwise", "amax_history_len", 8, "'delayed'"),
    ("delayed", "wgrad_high_precision", True, "'rowwise'/'blockwise'"),
    ("tensorwise", "wgrad_high_precision", True, "'rowwise'/'blockwise'"),
])
def test_a_field_of_another_recipe_is_refused(recipe, field, value, owners):
    fmt = "e4m3" if recipe == "blockwise" else "hybrid"
    with pytest.raises(ValueError, match=rf"Fp8Config\.{field}=.* applies to recipe={owners} "
                                         rf"only \(recipe is '{recipe}'\); leave it at"):
        Fp8Config(recipe=recipe, fp8_format=fmt, **{field: value})
    obj = RECIPE_CLASSES[recipe]()
    with pytest.raises(ValueError, match=rf"{field}=.* applies to recipe={owners}"):
        Fp8Config(recipe=obj, **{field: value})


def test_fields_of_another_recipe_at_their_defaults_are_accepted():
    cfg = Fp8Config(recipe="tensorwise", block_size=128, amax_history_len=16,
                    amax_compute_algo="max", wgrad_high_precision=False)
    assert cfg == Fp8Config()


def test_the_refusal_points_to_a_recipe_object_or_preset():
    with pytest.raises(ValueError, match=r"Fp8Config\(recipe=Blockwise\(block_size=64\)\)"):
        Fp8Config(block_size=64)
    with pytest.raises(ValueError, match=r"from_recipe\('rowwise_with_gw_hp'\)"):
        Fp8Config(wgrad_high_precision=True)
    with pytest.raises(ValueError, match=r"Delayed\(amax_history_len=4\)"):
        Fp8Config.from_recipe("delayed", amax_history_len=4).replace(recipe="tensorwise")


@pytest.mark.parametrize("make, error, fragment", [
    (lambda: Blockwise(block_size=48), ValueError, r"Blockwise\.block_size must be a power"),
    (lambda: Blockwise(block_size=128.0), TypeError, r"Blockwise\.block_size must be an int"),
    (lambda: Delayed(amax_history_len=0), ValueError, r"Delayed\.amax_history_len must be >= 1"),
    (lambda: Delayed(amax_compute_algo="mean"), ValueError, r"Delayed\.amax_compute_algo"),
    (lambda: Delayed(margin=-1), ValueError, r"Delayed\.margin must be >= 0"),
    (lambda: Tensorwise(fp8_format="e5m2"), ValueError, r"Tensorwise\.fp8_format='e5m2'"),
    (lambda: Tensorwise(power_of_2_scale=1), TypeError, r"Tensorwise\.power_of_2_scale"),
    (lambda: Rowwise(wgrad_high_precision=1), TypeError, r"Rowwise\.wgrad_high_precision"),
    (lambda: Blockwise(fp8_format="e4m3"), TypeError, r"fp8_format"),  # no knob: always e4m3
    (lambda: Tensorwise(block_size=64), TypeError, r"block_size"),
    (lambda: ScalingRecipe(), TypeError, r"base class"),
    (lambda: Delayed(16), TypeError, r"positional"),
])
def test_each_class_validates_its_own_fields(make, error, fragment):
    with pytest.raises(error, match=fragment):
        make()


def test_recipe_objects_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Blockwise().block_size = 64


def test_fp8config_checks_the_recipe_fields_as_the_classes_do():
    with pytest.raises(TypeError, match=r"Fp8Config\.power_of_2_scale must be a bool"):
        Fp8Config(power_of_2_scale="yes")
    with pytest.raises(ValueError, match=r"Fp8Config\.block_size must be a power of two"):
        Fp8Config(recipe="blockwise", fp8_format="e4m3", block_size=48)


def test_replace_with_a_recipe_object_replaces_the_whole_recipe():
    cfg = Fp8Config.from_recipe("blockwise", block_size=64, backend="emulated", min_numel=0)
    moved = cfg.replace(recipe=Rowwise())
    assert moved.recipe_config == Rowwise() and moved.block_size == 128
    assert moved.backend == "emulated" and moved.min_numel == 0  # the other fields are kept
    assert cfg.replace(recipe=Delayed(margin=1)).recipe_config == Delayed(margin=1)
    with pytest.raises(ValueError, match="block_size"):
        cfg.replace(recipe="rowwise")  # a string keeps the fields, block_size=64 among them
    with pytest.raises(ValueError, match="block_size is set twice"):
        cfg.replace(recipe=Blockwise(), block_size=32)


def test_recipe_classes_are_exported():
    for name in ("Tensorwise", "Delayed", "Rowwise", "Blockwise", "ScalingRecipe"):
        assert name in fp8.__all__ and hasattr(fp8, name)
    assert all(hasattr(fp8, name) for name in fp8.__all__)


@pytest.mark.parametrize("module", ["fp8boost.fp8.recipes", "fp8boost.fp8.config"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
