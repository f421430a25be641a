"""Fp8Config for the rowwise and blockwise recipes (issue 26): named recipes, the new fields,
and combinations refused with a ValueError that names the fix."""
from __future__ import annotations

import pytest
import torch

from fp8boost.fp8 import Fp8Config
from fp8boost.fp8.config import GRANULAR_RECIPES, NAMED_RECIPES, RECIPES


def test_recipe_field_takes_the_granular_algorithms():
    assert set(GRANULAR_RECIPES) <= set(RECIPES)
    for recipe in GRANULAR_RECIPES:
        fmt = "e4m3" if recipe == "blockwise" else "hybrid"  # blockwise: e4m3 only (below)
        cfg = Fp8Config(recipe=recipe, fp8_format=fmt)
        # the bare field keeps the field defaults; the named presets choose formats/scales
        assert cfg.fp8_format == fmt and not cfg.power_of_2_scale and cfg.block_size == 128


@pytest.mark.parametrize("name, fields", [
    ("rowwise", {"recipe": "rowwise", "fp8_format": "e4m3", "power_of_2_scale": True,
                 "wgrad_high_precision": False}),
    ("rowwise_with_gw_hp", {"recipe": "rowwise", "fp8_format": "e4m3",
                            "power_of_2_scale": True, "wgrad_high_precision": True}),
    ("blockwise", {"recipe": "blockwise", "fp8_format": "e4m3", "power_of_2_scale": False,
                   "block_size": 128}),
    ("blockwise_pow2", {"recipe": "blockwise", "power_of_2_scale": True}),
])
def test_named_granular_recipes(name, fields):
    assert name in NAMED_RECIPES
    cfg = Fp8Config.from_recipe(name, backend="emulated")
    for field, value in fields.items():
        assert getattr(cfg, field) == value, field
    assert cfg.grad_dtype == torch.float8_e4m3fn  # e4m3 gradients, as torchao and DeepSeek-V3


def test_named_preset_in_the_recipe_field_points_to_from_recipe():
    with pytest.raises(ValueError, match=r"from_recipe\('rowwise_with_gw_hp'\)"):
        Fp8Config(recipe="rowwise_with_gw_hp")


@pytest.mark.parametrize("size", [8, 100, 0, -128])
def test_block_size_must_be_a_power_of_two_of_at_least_16(size):
    with pytest.raises(ValueError, match="block_size must be a power of two >= 16"):
        Fp8Config(recipe="blockwise", fp8_format="e4m3", block_size=size)


def test_block_size_types_and_recipes():
    assert Fp8Config(recipe="blockwise", fp8_format="e4m3", block_size=64).block_size == 64
    with pytest.raises(TypeError, match="block_size must be an int"):
        Fp8Config(recipe="blockwise", fp8_format="e4m3", block_size=128.0)
    with pytest.raises(TypeError, match="block_size must be an int"):
        Fp8Config(recipe="blockwise", fp8_format="e4m3", block_size=True)
    for recipe in ("tensorwise", "delayed", "rowwise"):
        with pytest.raises(ValueError, match="applies to recipe='blockwise' only"):
            Fp8Config(recipe=recipe, block_size=64)


def test_wgrad_high_precision_only_with_granular_recipes():
    assert Fp8Config(recipe="blockwise", fp8_format="e4m3", wgrad_high_precision=True).wgrad_high_precision
    for recipe in ("tensorwise", "delayed"):
        with pytest.raises(ValueError, match="from_recipe\\('rowwise_with_gw_hp'\\)"):
            Fp8Config(recipe=recipe, wgrad_high_precision=True)
    with pytest.raises(TypeError, match="wgrad_high_precision must be a bool"):
        Fp8Config(recipe="rowwise", wgrad_high_precision=1)


def test_replace_moves_between_recipes_and_revalidates():
    cfg = Fp8Config.from_recipe("blockwise", block_size=256)
    assert cfg.replace(block_size=128, recipe="rowwise").recipe == "rowwise"
    with pytest.raises(ValueError, match="block_size"):
        cfg.replace(recipe="tensorwise")


def test_blockwise_refuses_e5m2_gradients():
    # cuBLAS's blockwise GEMMs take e4m3 only (an e5m2 operand was refused on an H100)
    with pytest.raises(ValueError, match="fp8_format='e4m3'"):
        Fp8Config(recipe="blockwise")
    with pytest.raises(ValueError, match="from_recipe\\('blockwise'\\)"):
        Fp8Config.from_recipe("blockwise", fp8_format="hybrid")
    assert Fp8Config(recipe="rowwise").fp8_format == "hybrid"  # rowwise runs e5m2 on cuBLAS
