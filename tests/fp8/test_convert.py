import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from fp8boost.fp8 import Fp8Config, Fp8Linear, convert_from_fp8, convert_to_fp8

EMU = Fp8Config(backend="emulated", min_numel=0)


def tiny_llama(tie=False):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


def test_llama_conversion_keeps_parameters_and_skips_head():
    model = tiny_llama()
    params_before = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built BEFORE conversion
    report = convert_to_fp8(model, EMU)
    per_layer = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert len(report.converted) == 2 * len(per_layer)
    assert "lm_head" in report.skipped and "lm_head" in str(report)
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert type(model.lm_head) is nn.Linear
    for n, p in model.named_parameters():
        assert p is params_before[n]  # same Parameter objects, same names
    ids = torch.randint(0, 256, (2, 16))
    w = model.model.layers[0].mlp.up_proj.weight
    before = w.detach().clone()
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert not torch.equal(before, w.detach())  # the pre-conversion optimizer updates FP8 layers


def test_tied_weights_stay_tied_and_inverse_restores_plain_linear():
    model = tiny_llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    convert_to_fp8(model, EMU, module_filter_fn=lambda m, name: True)  # even convert the head
    assert isinstance(model.lm_head, Fp8Linear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    keys = set(model.state_dict())
    assert convert_from_fp8(model) == 15
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert set(model.state_dict()) == keys


def test_gpt2_style_two_class_head_is_kept_with_reason():
    # Colossal-AI crashes on a [2, 768] score head; we keep it in BF16 and say why.
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(768, 768))
    model.add_module("score", nn.Linear(768, 2))
    model.add_module("odd", nn.Linear(100, 768))
    report = convert_to_fp8(model, EMU)
    assert report.converted == ["proj"]
    assert "divisible by 16" in report.skipped["score"]
    assert "divisible by 16" in report.skipped["odd"]
    x = torch.randn(3, 768)
    assert model.score(model.proj(x)).shape == (3, 2)  # the mixed FP8 -> BF16 chain runs


def test_size_filters_and_shared_modules():
    shared = nn.Linear(64, 64)
    model = nn.ModuleDict({"a": shared, "b": shared, "small": nn.Linear(16, 16)})
    report = convert_to_fp8(model, EMU.replace(min_numel=1024))
    assert model["a"] is model["b"] and isinstance(model["a"], Fp8Linear)
    assert "min_numel" in report.skipped["small"]
    again = convert_to_fp8(model, EMU.replace(min_numel=1024))
    assert again.converted == [] and list(again.skipped) == ["small"]  # idempotent


def test_bad_arguments():
    with pytest.raises(TypeError, match="Fp8Config"):
        convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), config={"recipe": "tensorwise"})
    with pytest.raises(ValueError, match="from_linear"):
        convert_to_fp8(nn.Linear(16, 16), EMU)
    with pytest.raises(TypeError, match="module_filter_fn"):
        convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), EMU, module_filter_fn=3)


def test_from_linear_builds_on_meta_and_shares_storage():
    lin = nn.Linear(32, 32)
    f = Fp8Linear.from_linear(lin, EMU)
    assert f.weight is lin.weight and f.bias is lin.bias
    assert f.weight.device.type == "cpu"


def test_default_filter_keeps_layers_too_small_to_gain():
    # Measured on an H200: whole-model steps lost speed with FP8 layers below 4096*4096 elements.
    model = nn.Sequential()
    with torch.device("meta"):
        model.add_module("big", nn.Linear(4096, 4096))
        model.add_module("mlp", nn.Linear(2048, 5632))
    report = convert_to_fp8(model, Fp8Config(backend="emulated"))
    assert report.converted == ["big"]
    assert "min_numel" in report.skipped["mlp"]
