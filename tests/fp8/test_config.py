import dataclasses

import pytest
import torch

from fp8boost.fp8 import Fp8Config
from fp8boost.fp8.config import NAMED_RECIPES, RECIPES


def test_defaults_are_tensorwise_hybrid():
    cfg = Fp8Config()
    assert cfg.recipe == "tensorwise" and cfg.fp8_format == "hybrid" and cfg.backend == "auto"
    assert cfg.fwd_dtype == torch.float8_e4m3fn and cfg.grad_dtype == torch.float8_e5m2
    assert cfg.fast_accum_fprop and not cfg.fast_accum_dgrad and not cfg.fast_accum_wgrad
    assert Fp8Config(fp8_format="e4m3").grad_dtype == torch.float8_e4m3fn


def test_frozen_and_keyword_only():
    cfg = Fp8Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.recipe = "delayed"
    with pytest.raises(TypeError):
        Fp8Config("delayed")  # positional args are refused


@pytest.mark.parametrize("name", sorted(NAMED_RECIPES))
def test_named_recipes_build(name):
    cfg = Fp8Config.from_recipe(name)
    assert isinstance(cfg, Fp8Config)
    assert Fp8Config.from_recipe("delayed").recipe == "delayed"
    assert Fp8Config.from_recipe("tensorwise_pow2").power_of_2_scale
    assert Fp8Config.from_recipe("delayed", amax_history_len=4).amax_history_len == 4


@pytest.mark.parametrize("kwargs, fragment", [
    ({"recipe": "columnwise"}, "recipe"),
    ({"fp8_format": "e5m2"}, "fp8_format"),
    ({"backend": "cuda"}, "backend"),
    ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
    ({"amax_history_len": 0}, "amax_history_len"),
    ({"margin": -1}, "margin"),
    ({"min_features": 0}, "min_features"),
    ({"min_numel": -1}, r"min_numel must be >= 0, got -1"),  # issue 13: name the field
])
def test_bad_values_raise_value_error_naming_the_field(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        Fp8Config(**kwargs)


def test_bad_types_raise_type_error():
    with pytest.raises(TypeError, match="amax_history_len"):
        Fp8Config(amax_history_len=2.5)
    with pytest.raises(TypeError, match="skip_module_names"):
        Fp8Config(skip_module_names="lm_head")


def test_unknown_recipe_lists_the_choices():
    with pytest.raises(ValueError, match="tensorwise"):
        Fp8Config.from_recipe("colwise")


def test_replace_revalidates():
    cfg = Fp8Config()
    assert cfg.replace(margin=2).margin == 2
    with pytest.raises(ValueError):
        cfg.replace(margin=-3)


def test_named_recipe_passed_as_recipe_field_points_to_from_recipe():
    # issue 13: `recipe` takes the scaling algorithms, from_recipe the named presets.
    for name in set(NAMED_RECIPES) - set(RECIPES):
        with pytest.raises(ValueError, match=rf"from_recipe\('{name}'\)"):
            Fp8Config(recipe=name)
    assert Fp8Config.from_recipe("tensorwise_pow2").recipe == "tensorwise"
