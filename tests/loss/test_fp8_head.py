"""The FP8 lm_head inside the fused linear + cross-entropy (issue 35 item 2b), on CPU.

The emulated backend dequantizes the FP8 operands and multiplies in FP32, so the chunked FP8
head must equal, to FP32 rounding, a reference built from the public quantizers on the whole
batch: per-token and per-row scales do not depend on the chunking. Blockwise is checked against
the BF16 head within FP8 tolerance (its 1x128 tiles are the same per chunk too, but the reference
would re-implement the tile layout)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8boost.fp8.granular import emulated_mm, quantize_cols_t, quantize_rows
from fp8boost.fp8.scaling import E4M3, E5M2
from fp8boost.loss import FusedLmLossConfig, chunked_linear_cross_entropy
from fp8boost.loss.fp8_head import HEAD_RECIPES, head_config

pytestmark = pytest.mark.filterwarnings("ignore:.*FP8 tensor cores unavailable.*")

N, H, V = 48, 32, 96


def _data(seed=0, loud=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.3
    if loud:
        h[3, 5] = 40.0  # an activation outlier: its token's row scale, nobody else's
        h[17] *= 8.0
        w[7] *= 20.0  # one loud vocabulary row
    y = torch.randint(0, V, (N,), generator=g)
    y[::5] = -100
    return h.requires_grad_(), w.requires_grad_(), y


def _rowwise_reference(h, w, y):
    """Loss and dL/dh of the rowwise FP8 head, unchunked, from the quantizers themselves."""
    cfg = head_config("rowwise")
    kw = dict(power_of_2=cfg.power_of_2_scale)
    z = emulated_mm(quantize_rows(h.detach(), E4M3, **kw), quantize_rows(w.detach(), E4M3, **kw),
                    out_dtype=torch.float32)
    valid = y != -100
    loss = F.cross_entropy(z, y, ignore_index=-100)
    p = torch.softmax(z, dim=1)
    p[valid, y[valid]] -= 1.0
    g = p * valid.unsqueeze(1) / valid.sum()
    grad_h = emulated_mm(quantize_rows(g, E5M2, **kw),
                         quantize_cols_t(w.detach(), E4M3, **kw), out_dtype=torch.float32)
    return loss, grad_h, g.t() @ h.detach()


@pytest.mark.parametrize("chunk", [None, 16, 13])  # 13 does not divide N
def test_rowwise_head_equals_the_quantizer_reference(chunk):
    h, w, y = _data()
    loss = chunked_linear_cross_entropy(h, w, y, chunk_size=chunk, fp8_recipe="rowwise")
    loss.backward()
    ref_loss, ref_gh, ref_gw = _rowwise_reference(h, w, y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, ref_gh, rtol=1e-5, atol=1e-6)
    # the weight gradient is the high-precision product of the FP8 logits' gradient
    torch.testing.assert_close(w.grad, ref_gw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe", HEAD_RECIPES)
def test_fp8_head_is_close_to_the_high_precision_head_and_not_equal(recipe):
    # Logits of order 1 (FP8's ~3% relative error of a logit moves a peaked softmax a lot:
    # that is what a convergence run measures, not this test).
    h, w, y = _data(seed=1, loud=False)
    exact = chunked_linear_cross_entropy(h, w, y, chunk_size=16)
    exact.backward()
    e_gh, e_gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    fp8 = chunked_linear_cross_entropy(h, w, y, chunk_size=16, fp8_recipe=recipe)
    fp8.backward()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert abs(fp8.item() - exact.item()) / exact.item() < 1e-2  # measured 0.08-0.2%
    assert rel(h.grad, e_gh) < 0.1 and rel(w.grad, e_gw) < 0.05  # 3-5.5%, 1.7-2%
    # FP8 rounding happened: a head silently left in high precision would be equal
    assert fp8.item() != exact.item() and rel(h.grad, e_gh) > 1e-4


def test_bad_recipe_names_raise_before_any_gemm():
    h, w, y = _data()
    with pytest.raises(ValueError, match="rowwise or blockwise"):
        chunked_linear_cross_entropy(h, w, y, fp8_recipe="tensorwise")
    with pytest.raises(ValueError, match="fp8_recipe"):
        FusedLmLossConfig(fp8_recipe="delayed")
    assert FusedLmLossConfig(fp8_recipe="blockwise").fp8_recipe == "blockwise"


def test_boosted_llama_trains_with_the_fp8_head():
    transformers = pytest.importorskip("transformers")
    from fp8boost.booster import Booster, MixedPrecision

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_hidden_layers=2, vocab_size=256)
    ids = torch.randint(0, 256, (2, 32))
    losses = {}
    for name, setting in (("bf16", True), ("fp8", FusedLmLossConfig(fp8_recipe="rowwise"))):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        booster = Booster(mixed_precision=MixedPrecision("bf16", fused_lm_loss=setting))
        model, opt, *_ = booster.boost(model, opt)
        seen = []
        for _ in range(3):
            out = model(input_ids=ids, labels=ids)
            assert out.logits is None  # the fused path ran
            booster.backward(out.loss, opt)
            opt.step()
            opt.zero_grad()
            seen.append(out.loss.item())
        losses[name] = seen
    assert losses["fp8"][-1] < losses["fp8"][0]
    assert losses["fp8"] != losses["bf16"]  # FP8 rounding reached the loss
    for a, b in zip(losses["fp8"], losses["bf16"]):
        assert abs(a - b) / b < 2e-2
