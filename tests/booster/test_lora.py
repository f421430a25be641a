"""Booster.enable_lora / save_lora_as_pretrained in one process: FP8 frozen base, BF16 adapters.

A tiny Llama with LoRA on q_proj/v_proj and the MLP, bf16 + emulated FP8 (no plugin, so no
process group). Checked: the base layers are Fp8Linear and the adapters are not; the loss falls;
the base weights stay bit-identical while the adapters change; each frozen weight is cast to FP8
once (with its transpose) and reused across steps, recast only after a load; saved adapters load
with ``PeftModel.from_pretrained`` and give the trained model's outputs (fp32, atol 1e-5).
"""
from __future__ import annotations

import sys

import pytest
import torch

from tests.plugins.hybrid_cases import global_batch, tiny_model

pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def _booster():
    from fp8boost.booster import Booster, MixedPrecision
    from fp8boost.fp8 import Fp8Config
    return Booster(mixed_precision=MixedPrecision("fp8", Fp8Config(backend="emulated",
                                                                   min_numel=0)), device="cpu")


def _config(**kw):
    from peft import LoraConfig
    return LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, **kw)


def _weight_casts(model) -> dict:
    """Spy on every base layer's weight casts: {layer name: count}."""
    from fp8boost.fp8 import Fp8Linear
    counts = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Fp8Linear) and name.endswith("base_layer"):
            counts[name] = 0
            orig = mod.casts.quantize

            def spy(role, *a, _orig=orig, _name=name, **k):
                counts[_name] += role == "weight"
                return _orig(role, *a, **k)
            mod.casts.quantize = spy
    return counts


def test_enable_lora_fp8_base_trains_adapters_and_caches_frozen_casts(tmp_path):
    from peft import PeftModel

    from fp8boost.fp8 import Fp8Linear, is_fp8_layer
    from fp8boost.fp8.convert import convert_from_fp8
    from fp8boost.fp8.linear import weights_loaded

    booster = _booster()
    model = booster.enable_lora(tiny_model(), lora_config=_config())
    assert isinstance(model, PeftModel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapped, opt, *_ = booster.boost(model, opt)
    names = dict(model.named_modules())
    bases = [n for n in names if n.endswith("base_layer")]
    assert len(bases) == 2 * len(TARGETS) and all(is_fp8_layer(names[n]) for n in bases)
    assert not any(is_fp8_layer(m) for n, m in names.items() if ".lora_" in n)
    base0 = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora0 = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    counts = _weight_casts(model)
    ids = global_batch(0)
    losses = []
    for _ in range(4):
        loss = wrapped(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    now = dict(model.named_parameters())
    assert all(torch.equal(now[n], t) for n, t in base0.items())
    assert all(not torch.equal(now[n], t) for n, t in lora0.items() if "lora_B" in n)
    assert all(now[n].grad is None for n in base0)  # no weight-gradient GEMM for the base
    # Each frozen weight was cast once (forward + its transpose), not once per step.
    assert set(counts.values()) == {1}, counts
    layer = names[bases[0]]
    assert isinstance(layer, Fp8Linear) and layer.operands.cached_transpose(layer.weight) is not None
    weights_loaded(model)  # a loader wrote the weights: the next forward casts again, once
    for _ in range(2):
        wrapped(input_ids=ids, labels=ids).loss.backward()
    assert set(counts.values()) == {2}, counts
    layer.load_state_dict(layer.state_dict())
    wrapped(input_ids=ids, labels=ids).loss.backward()
    assert counts[bases[0]] == 3 and counts[bases[1]] == 2

    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        booster.save_lora_as_pretrained(wrapped, tmp_path / "file")
    booster.save_lora_as_pretrained(wrapped, tmp_path / "adapters")
    # The trained model in fp32, without FP8: its base is the bf16-rounded initial base.
    convert_from_fp8(model)
    model.float().eval()
    fresh = PeftModel.from_pretrained(tiny_model().to(torch.bfloat16).float(),
                                      tmp_path / "adapters").eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = fresh(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_enable_lora_bad_input_fails_clearly(monkeypatch):
    from fp8boost.booster import Booster
    from fp8boost.plugins import HybridParallelPlugin

    booster = _booster()
    with pytest.raises(ValueError, match="use_fp8=True"):
        booster.enable_lora(tiny_model(), lora_config=_config(), quantize=True)
    with pytest.raises(ValueError, match="use_fp8=True"):
        booster.enable_lora(tiny_model(), lora_config=_config(), bnb_quantization_config={})
    with pytest.raises(TypeError, match="peft.LoraConfig"):
        booster.enable_lora(tiny_model(), lora_config={"r": 8})
    with pytest.raises(ValueError, match="lora_config"):
        booster.enable_lora(tiny_model())
    with pytest.raises(ValueError, match="use_dora"):
        booster.enable_lora(tiny_model(), lora_config=_config(use_dora=True))
    with pytest.raises(ValueError, match="pp_size"):
        Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2)) \
            .enable_lora(tiny_model(), lora_config=_config())
    model = tiny_model()
    wrapped, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="before booster.boost"):
        booster.enable_lora(wrapped, lora_config=_config())
    with pytest.raises(TypeError, match="enable_lora"):
        booster.save_lora_as_pretrained(wrapped, "unused")
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match="pip install peft"):
        booster.enable_lora(tiny_model(), lora_config=None)
