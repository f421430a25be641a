"""The conversion's record (``fp8boost.fp8.record``, issue 38 item 5): what ``convert_to_fp8``
decided, kept on the modules, read by every engine instead of ``isinstance``.

The record must match the conversion report, stay right when engines move modules (new
names, new containers, copies), be empty for a model never converted, and answer for FP8
modules built by hand.
"""
from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

from fp8boost.fp8 import (Fp8Config, Fp8Linear, Fp8Record, convert_from_fp8, convert_to_fp8,
                          fp8_entry, fp8_layers, fp8_record, is_fp8_layer)
from fp8boost.fp8.record import (ENTRY_ATTR, EXPERTS, LINEAR, Fp8Entry, recorded_experts,
                                 recorded_experts_modules, recorded_linear, recorded_linears)


def emu(recipe: str = "tensorwise") -> Fp8Config:
    return Fp8Config.from_recipe(recipe, backend="emulated", min_numel=0)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.small = nn.Linear(64, 10)  # a dim not divisible by 16: kept
        self.head = nn.Linear(64, 64)
        self.tied = self.head  # the same module under two names


def test_record_matches_the_report_and_the_modules():
    model = Net()
    report = convert_to_fp8(model, emu())
    record = fp8_record(model)
    assert report.record == record
    assert list(record.linears) == [n for n, m in model.named_modules() if is_fp8_layer(m)]
    assert set(record.linears) == set(report.converted) - {"tied"}  # one name per module
    assert set(record.linears.values()) == {"tensorwise"}
    assert "small" in report.skipped and "small" not in record.linears
    assert record.experts == () and record.granular == () and bool(record)
    assert recorded_linears(model) == fp8_layers(model)
    for name, module in model.named_modules():
        assert recorded_linear(module) == is_fp8_layer(module), name
        assert (module.__dict__.get(ENTRY_ATTR) is not None) == is_fp8_layer(module), name


def test_each_module_keeps_its_own_recipe():
    model = Net()
    convert_to_fp8(model.attn, emu("blockwise"))
    convert_to_fp8(model.mlp, emu("delayed"))
    report = convert_to_fp8(model, emu("rowwise"))  # the rest; attn and mlp are already FP8
    assert set(report.already_fp8) == {"attn.0", "attn.1", "mlp.0", "mlp.2"}
    record = fp8_record(model)
    assert record.linears == {"attn.0": "blockwise", "attn.1": "blockwise", "mlp.0": "delayed",
                              "mlp.2": "delayed", "head": "rowwise"}
    assert record.granular == ("attn.0", "attn.1", "head")
    assert fp8_entry(model.attn[0]) == Fp8Entry(LINEAR, "blockwise")
    assert fp8_entry(model.head).granular and not fp8_entry(model.mlp[0]).granular


def test_a_model_never_converted_has_an_empty_record():
    model = Net()
    assert fp8_record(model) == Fp8Record() and not fp8_record(model)
    assert fp8_entry(None) is None and not recorded_linear(None) and not recorded_experts(None)
    assert recorded_linears(model) == [] and recorded_experts_modules(model) == []


def test_hand_built_fp8_layers_are_answered_as_conversion_would_record_them():
    model = nn.Sequential(Fp8Linear(64, 64, config=emu("rowwise")),
                          Fp8Linear.from_linear(nn.Linear(32, 32), emu()))
    assert all(ENTRY_ATTR not in m.__dict__ for m in model)  # never converted
    assert fp8_record(model).linears == {"0": "rowwise", "1": "tensorwise"}
    report = convert_to_fp8(model, emu())
    assert report.already_fp8 == ["0", "1"] and report.record == fp8_record(model)
    assert all(ENTRY_ATTR in m.__dict__ for m in model)  # recorded by the conversion now


def test_the_record_follows_modules_that_engines_move_copy_or_wrap():
    model = Net()
    convert_to_fp8(model, emu("blockwise"))
    # A pipeline stage re-roots layers under a new container: new names, same entries.
    stage = nn.ModuleDict({"block": model.mlp, "out": model.head})
    assert fp8_record(stage).linears == {"block.0": "blockwise", "block.2": "blockwise",
                                         "out": "blockwise"}
    # A wrapper held outside the submodules (as EpExperts holds its experts) keeps the entry.
    class Holder(nn.Module):
        def __init__(self, inner):
            super().__init__()
            object.__setattr__(self, "inner", inner)
    holder = Holder(model.head)
    assert not recorded_linear(holder) and recorded_linear(holder.inner)
    # A class swapped in place (FSDP2's fully_shard does this) keeps the instance dict.
    layer = model.attn[0]
    layer.__class__ = type("FSDPFp8Linear", (type(layer),), {})
    assert fp8_entry(layer) == Fp8Entry(LINEAR, "blockwise")
    # Copies and pickles carry the record.
    twin = copy.deepcopy(model)
    assert fp8_record(twin) == fp8_record(model)
    assert fp8_record(pickle.loads(pickle.dumps(model.mlp))).linears == {"0": "blockwise",
                                                                           "2": "blockwise"}


def test_converting_back_empties_the_record():
    model = Net()
    convert_to_fp8(model, emu())
    assert convert_from_fp8(model) == 5
    assert fp8_record(model) == Fp8Record()


def test_fp8_experts_are_recorded_as_experts():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=64, intermediate_size=32,
                                     num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    report = convert_to_fp8(model, emu())
    record = fp8_record(model)
    assert record == report.record
    assert list(record.experts) == report.experts and len(record.experts) == 2
    assert all(fp8_entry(model.get_submodule(n)) == Fp8Entry(EXPERTS, "tensorwise")
               for n in record.experts)
    assert [id(m) for m in recorded_experts_modules(model)] == \
        [id(model.get_submodule(n)) for n in record.experts]
    assert set(record.linears) == {n for n in report.converted}
    convert_from_fp8(model)
    assert fp8_record(model) == Fp8Record()
