import warnings

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


def test_default_size_filter_is_waived_without_fp8_hardware(monkeypatch):
    """min_numel is a speed rule: with emulated FP8 (no FP8 tensor cores) its *default* would
    silently turn use_fp8=True into BF16 on every small model, so it is not applied there; an
    explicit min_numel, or a hardware backend, keeps it."""
    from fp8boost.fp8 import min_numel

    def small():
        return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))

    assert len(convert_to_fp8(small(), Fp8Config(backend="emulated")).converted) == 2
    monkeypatch.setattr(min_numel, "_fp8_gpu_present", lambda: False)
    assert len(convert_to_fp8(small(), Fp8Config()).converted) == 2  # auto on a CPU machine
    rep = convert_to_fp8(small(), Fp8Config(backend="emulated", min_numel=4096 * 4096 - 1))
    assert not rep.converted and "min_numel" in rep.skipped["0"]  # explicit: applied
    for backend in ("triton", "cublas"):  # a hardware backend: where the rule was measured
        rep = convert_to_fp8(small(), Fp8Config(backend=backend))
        assert not rep.converted and "min_numel" in rep.skipped["1"], backend
    monkeypatch.setattr(min_numel, "_fp8_gpu_present", lambda: True)
    from fp8boost import _state
    _state.reset()  # the "nothing converted" warning is once per reason and process
    with pytest.warns(UserWarning, match="no linear layer was converted"):
        rep = convert_to_fp8(small(), Fp8Config())  # auto with an FP8 GPU here
    assert not rep.converted


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
    report = convert_to_fp8(model, Fp8Config(backend="triton"))  # hardware: the rule applies
    assert report.converted == ["big"]
    assert "min_numel" in report.skipped["mlp"]


# ------------------------------------------------------------------ issue 13: HF Conv1D, report


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def test_gpt2_conv1d_layers_convert_keeping_parameters_and_checkpoint_layout(tmp_path):
    from fp8boost.fp8.convert import Fp8Conv1D
    model = tiny_gpt2()
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    report = convert_to_fp8(model, EMU)
    # c_attn, c_proj (attention), c_fc, c_proj (MLP) per block; the tied head stays.
    assert len(report.converted) == 8 and "lm_head" in report.skipped
    assert isinstance(model.transformer.h[0].attn.c_attn, Fp8Conv1D)
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes  # [in, out] kept
    assert all(p is params[n] for n, p in model.named_parameters())
    ids = torch.randint(0, 256, (2, 16))
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    with torch.no_grad():
        # The reloaded model is plain BF16/FP32 Conv1D: equal up to FP8 rounding of the GEMMs.
        torch.testing.assert_close(model(ids).logits, reloaded(ids).logits, atol=0.1, rtol=0.1)
    assert convert_from_fp8(model) == 8
    assert type(model.transformer.h[0].mlp.c_fc).__name__ == "Conv1D"
    assert all(p is params[n] for n, p in model.named_parameters())


def test_fp8_conv1d_matches_fp8_linear_bit_exactly():
    # Tensorwise scales do not depend on layout: the [in, out] layer must compute exactly what an
    # Fp8Linear holding the transposed weight computes, forward and backward.
    from transformers.pytorch_utils import Conv1D
    from fp8boost.fp8.convert import Fp8Conv1D
    torch.manual_seed(0)
    conv = Conv1D(48, 32)
    lin = nn.Linear(32, 48)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        conv.bias.normal_()
        lin.bias.copy_(conv.bias)
    f_conv, f_lin = Fp8Conv1D.from_conv1d(conv, EMU), Fp8Linear.from_linear(lin, EMU)
    x = torch.randn(3, 5, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = f_conv(xa), f_lin(xb)
    assert torch.equal(ya, yb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(conv.weight.grad, lin.weight.grad.t())
    assert torch.equal(conv.bias.grad, lin.bias.grad)


def test_gpt2_trains_in_fp8_on_cpu_close_to_bf16():
    # 6 AdamW steps of a tiny GPT-2 with Booster(mixed_precision="fp8") vs "bf16" on the same
    # batches. FP8 (e4m3/e5m2) GEMM error is a few percent per element but averages out in the
    # loss: measured max |diff| 0.003 nats (losses 5.54 -> 4.73); we allow 0.02 nats.
    from fp8boost.booster import Booster
    from fp8boost.booster.mixed_precision import MixedPrecision
    from fp8boost.fp8.convert import Fp8Conv1D
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = {}
    for mode in ("bf16", "fp8"):
        model = tiny_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mp = MixedPrecision("fp8", EMU) if mode == "fp8" else "bf16"
        booster = Booster(mixed_precision=mp, device="cpu")
        model, opt, *_ = booster.boost(model, opt)
        if mode == "fp8":
            assert sum(isinstance(m, Fp8Conv1D) for m in model.modules()) == 8
        losses[mode] = []
        for _ in range(6):
            loss = model(ids, labels=ids).loss
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            losses[mode].append(float(loss.detach()))
    assert losses["fp8"][-1] < losses["fp8"][0] - 0.2  # it learns
    diffs = [abs(a - b) for a, b in zip(losses["fp8"], losses["bf16"])]
    assert max(diffs) < 0.02, (losses, diffs)


def test_linear_subclass_converts_only_when_the_filter_accepts_it():
    class LoraLike(nn.Linear):
        pass

    model = nn.Sequential(LoraLike(32, 32), nn.Linear(32, 32))
    report = convert_to_fp8(model, EMU)
    assert report.converted == ["1"] and "subclass" in report.skipped["0"]
    report = convert_to_fp8(model, EMU, module_filter_fn=lambda m, name: True)
    assert report.converted == ["0"] and report.already_fp8 == ["1"]
    assert isinstance(model[0], Fp8Linear)


def test_report_counts_layers_already_in_fp8_and_does_not_warn():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    convert_to_fp8(model, EMU)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an already-FP8 model is not a "nothing converted"
        report = convert_to_fp8(model, EMU)
    assert report.converted == [] and report.already_fp8 == ["0", "1"]
    assert "2 already in FP8" in str(report)


def test_nothing_converted_warning_gives_only_advice_that_applies():
    from fp8boost import _state
    _state.reset()
    convs = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3))
    with pytest.warns(UserWarning, match="no nn.Linear or transformers Conv1D") as rec:
        convert_to_fp8(convs, EMU)
    assert "min_numel" not in str(rec[0].message)
    odd = nn.Sequential(nn.Linear(30, 30))  # min_numel=0 already: do not suggest it again
    with pytest.warns(UserWarning, match="divisible by 16") as rec:
        convert_to_fp8(odd, EMU)
    assert "min_numel=0" not in str(rec[0].message)
    assert "convert_to_fp8(model, fp8_config)" in str(rec[0].message)  # where the config goes
    small = nn.Sequential(nn.Linear(32, 32))
    with pytest.warns(UserWarning, match=r"Fp8Config\(min_numel=0\)"):
        convert_to_fp8(small, Fp8Config(backend="cublas"))  # hardware: default filter applies
