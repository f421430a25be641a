"""One meaning per config field (issue 24 item 4): the ``min_numel`` default is an explicit
``None``, so a user's 16777216 (the library default's value) counts as a choice; FP8-ness is
queried through ``is_fp8_layer`` only."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8boost.fp8 import Fp8Config, convert_to_fp8, fp8_layers, is_fp8_layer
from fp8boost.fp8 import convert as conv
from fp8boost.fp8 import min_numel
from fp8boost.fp8.config import DEFAULT_MIN_NUMEL


def _small() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))


def test_min_numel_none_is_the_library_default_and_an_explicit_default_value_applies(
        monkeypatch):
    monkeypatch.setattr(min_numel, "_fp8_gpu_present", lambda: False)
    assert Fp8Config().min_numel is None
    # Unset: a speed rule, waived without FP8 tensor cores.
    assert conv.min_numel_limit(Fp8Config(backend="emulated")) == 0
    assert len(convert_to_fp8(_small(), Fp8Config(backend="emulated")).converted) == 2
    # Set to the very value of the default: the user's choice, applied on every backend.
    explicit = Fp8Config(backend="emulated", min_numel=DEFAULT_MIN_NUMEL)
    assert conv.min_numel_limit(explicit) == DEFAULT_MIN_NUMEL
    rep = convert_to_fp8(_small(), explicit)
    assert not rep.converted and f"min_numel={DEFAULT_MIN_NUMEL}" in rep.skipped["0"]
    # Unset on FP8 hardware: the default applies.
    assert conv.min_numel_limit(Fp8Config(backend="cublas")) == DEFAULT_MIN_NUMEL
    monkeypatch.setattr(min_numel, "_fp8_gpu_present", lambda: True)
    assert conv.min_numel_limit(Fp8Config()) == DEFAULT_MIN_NUMEL


def test_min_numel_validation():
    assert Fp8Config(min_numel=0).min_numel == 0
    with pytest.raises(TypeError, match="min_numel must be an int or None"):
        Fp8Config(min_numel=1.5)
    with pytest.raises(ValueError, match="min_numel must be >= 0"):
        Fp8Config(min_numel=-1)
    assert Fp8Config.from_recipe("delayed").min_numel is None


def test_is_fp8_layer_and_fp8_layers():
    model = _small()
    convert_to_fp8(model, Fp8Config(backend="emulated", min_numel=0))
    assert is_fp8_layer(model[0]) and is_fp8_layer(model[1])
    assert not is_fp8_layer(nn.Linear(16, 16)) and not is_fp8_layer(model)
    assert fp8_layers(model) == [model[0], model[1]]
    assert torch.is_tensor(model[0](torch.randn(2, 64)))
