"""install_fused_rms_norms: which HF norms take F.rms_norm, and that the model still trains,
pickles, deep-copies and compiles as before (CPU; the GPU test times it against HF's)."""
from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fp8boost import _state
from fp8boost.norm import FusedForward, install_fused_rms_norms, llama_rms_norm


def _llama(dtype=torch.bfloat16) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # not all ones: the weight's multiply must matter
                p.uniform_(0.5, 1.5)
    return model


class GemmaStyleRMSNorm(nn.Module):
    """Gemma's formula (``1 + weight``): not Llama's, must keep its own forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def _outliers(*shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g)
    x[..., ::7] *= 50.0  # outlier channels, as in LLM activations
    return x


def test_every_llama_norm_is_fused_and_the_model_trains_as_before():
    model, ref = _llama(), _llama()
    report = install_fused_rms_norms(model)
    assert report.fused == ("model.layers.0.input_layernorm",
                            "model.layers.0.post_attention_layernorm",
                            "model.layers.1.input_layernorm",
                            "model.layers.1.post_attention_layernorm", "model.norm")
    assert dict(report.kept) == {}
    assert install_fused_rms_norms(model) == report  # idempotent
    assert isinstance(model.model.norm, LlamaRMSNorm)
    assert list(model.state_dict()) == list(ref.state_dict())
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    loss, ref_loss = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
    loss.backward()
    ref_loss.backward()
    assert loss.item() != 0 and abs(loss.item() - ref_loss.item()) < 1e-2 * ref_loss.item()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = ((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm()).item()
        assert err < 3e-2, (name, err)


def test_one_norm_is_as_close_to_the_exact_result_as_hfs():
    # F.rms_norm rounds once where HF rounds twice: never farther from the FP64 result than
    # HF's by more than one BF16 ulp, and both within 2**-7 relative.
    norm = LlamaRMSNorm(256, eps=1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = _outliers(64, 256).bfloat16()
    with torch.no_grad():
        hf = norm(x).double()
        install_fused_rms_norms(norm)
        fused = norm(x).double()
    assert isinstance(norm.forward, FusedForward) and not torch.equal(fused, hf)
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    ulp = exact.abs() * 2.0 ** -7
    assert ((fused - exact).abs() <= ulp).all() and ((hf - exact).abs() <= ulp).all()
    assert ((fused - hf).abs() <= ulp).all()


def test_other_formulas_and_meta_weights_keep_their_forward():
    model = nn.ModuleDict({"llama": LlamaRMSNorm(32), "gemma": GemmaStyleRMSNorm(32),
                           "linear": nn.Linear(32, 32)})
    with torch.device("meta"):
        model["meta"] = LlamaRMSNorm(32)
    report = install_fused_rms_norms(model)
    assert report.fused == ("llama",)
    assert report.kept["gemma"].startswith("its forward is not Llama's RMSNorm formula")
    assert "meta device" in report.kept["meta"]
    assert "forward" not in model["gemma"].__dict__
    with pytest.raises(TypeError, match="nn.Module"):
        install_fused_rms_norms(torch.zeros(3))


def test_mixed_dtypes_and_compiling_run_the_models_own_forward(monkeypatch):
    norm = LlamaRMSNorm(32)  # FP32 weight
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    install_fused_rms_norms(norm)
    x = _outliers(4, 32)
    own = llama_rms_norm(x.bfloat16(), norm.weight, norm.variance_epsilon)
    _state.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = norm(x.bfloat16())  # BF16 input, FP32 weight: HF returns FP32
    assert torch.equal(y, own) and y.dtype == torch.float32
    assert any("does not mix" in str(w.message) for w in caught)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(norm(x), llama_rms_norm(x, norm.weight, norm.variance_epsilon))


def test_a_fused_model_pickles_deep_copies_and_compiles_without_breaks():
    model = _llama()
    install_fused_rms_norms(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
        clone = copy.deepcopy(model)
        assert clone.model.norm.forward.module is clone.model.norm
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert loaded.model.norm.forward.module is loaded.model.norm
        assert torch.equal(clone(ids).logits, want) and torch.equal(loaded(ids).logits, want)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.model.norm)(torch.randn(2, 16, 64).bfloat16())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_boost_installs_it_with_fused_norm_and_not_by_default():
    from fp8boost.booster import Booster, MixedPrecision
    for on in (True, False):
        model = _llama(torch.float32)
        booster = Booster(mixed_precision=MixedPrecision(precision="bf16", fused_norm=on))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt, *_ = booster.boost(model, opt)
        report = booster.plugin.norm_report
        norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
        assert all(isinstance(m.__dict__.get("forward"), FusedForward) == on for m in norms)
        assert (len(report.fused) if on else report) == (5 if on else None)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
        booster.backward(model(ids, labels=ids).loss, opt)
        opt.step()
    with pytest.raises(TypeError, match="fused_norm"):
        MixedPrecision(precision="bf16", fused_norm="yes")
