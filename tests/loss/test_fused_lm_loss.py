"""Issue 35 item 2(a): ``boost`` fuses an HF causal LM's lm_head with its loss (``fused_lm_loss``).

A tiny Llama (tied embeddings) through the Booster with the switch on and off: same loss and
gradients to 1e-5 in FP32, ``logits=None`` only where the fused path ran, nothing of size
``[tokens, vocab]`` saved for backward. Gemma-2's soft-capped logits, the fallbacks (FP8 or
non-Linear lm_head, FP16, a forward that does something else with the logits) and, on 2 gloo
ranks, the vocabulary-parallel lm_head of ``HybridParallelPlugin(tp_size=2)`` with and without
sequence parallelism, and ``TorchFSDPPlugin`` (FSDP2) over 2 ranks.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers

from fp8boost import _state
from fp8boost.booster import Booster, MixedPrecision
from fp8boost.loss import FusedLossForward, head_recipe, install_fused_lm_loss
from tests.dist_utils import run_distributed

V, B, T = 96, 2, 9


def _llama(tie: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=1, num_hidden_layers=2, vocab_size=V,
                                   tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt that is not trained on
    return ids, labels


def _step(model, fused, **extra):
    booster = Booster(mixed_precision=MixedPrecision("fp32", fused_lm_loss=fused), device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    boosted, opt, *_ = booster.boost(model, opt)
    ids, labels = _batch()
    out = boosted(input_ids=ids, labels=labels, **extra)
    booster.backward(out.loss, opt)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out, grads, boosted


def _assert_same(on, off):
    (out_on, g_on), (out_off, g_off) = on, off
    torch.testing.assert_close(out_on.loss, out_off.loss, rtol=1e-5, atol=0)
    assert g_on.keys() == g_off.keys()
    for name in g_on:
        torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("extra", [{}, {"num_items_in_batch": torch.tensor(11)}],
                         ids=["mean", "num_items"])
def test_booster_on_equals_off_tied_llama_fp32(extra):
    model = _llama(tie=True)
    off_model = copy.deepcopy(model)
    out_on, g_on, boosted = _step(model, True, **extra)
    out_off, g_off, _ = _step(off_model, False, **extra)
    assert isinstance(vars(model)["forward"], FusedLossForward)
    assert "forward" not in vars(off_model)
    assert out_on.logits is None and out_off.logits.shape == (B, T, V)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    _assert_same((out_on, g_on), (out_off, g_off))
    # Without labels, or without autograd, the fused model runs HF's forward: logits back.
    ids, labels = _batch()
    assert boosted(input_ids=ids).logits.shape == (B, T, V)
    with torch.no_grad():
        plain = boosted(input_ids=ids, labels=labels, **extra)
    assert plain.logits.shape == (B, T, V)
    torch.testing.assert_close(plain.loss, out_off.loss, rtol=1e-5, atol=0)


def test_no_tokens_by_vocab_tensor_is_saved_for_backward():
    ids, labels = _batch()
    found = {}
    for fused in (True, False):
        model = _llama(tie=False)
        install_fused_lm_loss(model, fused)
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t,
                                                      lambda t: t):
            model(input_ids=ids, labels=labels).loss.backward()
        found[fused] = [s for s in shapes if s[-1:] == (V,) and s.numel() >= B * T * V]
    assert found[True] == [] and found[False], found  # the hook does see HF's logits


def test_whole_model_compiles_to_one_graph_with_the_fused_loss():
    torch._dynamo.reset()
    model = _llama(tie=True)
    ref = copy.deepcopy(model)
    install_fused_lm_loss(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # raises on a break
    ids, labels = _batch()
    out = compiled(input_ids=ids, labels=labels)
    out.loss.backward()
    want = ref(input_ids=ids, labels=labels)
    want.loss.backward()
    assert out.logits is None
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_gemma2_softcapped_logits_match():
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, num_hidden_layers=1,
                                    vocab_size=V, final_logit_softcapping=2.0)
    model = transformers.Gemma2ForCausalLM(cfg)
    recipe = head_recipe(model)
    assert recipe.softcap == 2.0 and recipe.logit_scale == 1.0
    off_model = copy.deepcopy(model)
    out_on, g_on, _ = _step(model, True)
    out_off, g_off, _ = _step(off_model, False)
    assert out_on.logits is None
    _assert_same((out_on, g_on), (out_off, g_off))


class _ZLossLlama(transformers.LlamaForCausalLM):
    """A forward that adds a z-loss on the logits: the fused loss must not replace it."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        z_loss = logits.logsumexp(-1).pow(2).mean()  # everything above is the standard head
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss + z_loss,
                                                                    logits=logits)


def test_models_it_does_not_fit_keep_hf_forward(caplog):
    from fp8boost.fp8 import Fp8Config, convert_to_fp8

    z = _ZLossLlama(_llama().config)
    assert "z_loss = logits.logsumexp" in install_fused_lm_loss(z)
    half = _llama().half()
    assert "FP16" in install_fused_lm_loss(half)
    fp8 = _llama(tie=False)
    convert_to_fp8(fp8, Fp8Config(backend="emulated", min_numel=0, skip_module_names=()))
    with pytest.warns(UserWarning, match="lm_head runs in FP8"):
        assert install_fused_lm_loss(fp8) == "its lm_head is an FP8 layer"
    assert install_fused_lm_loss(torch.nn.Linear(2, 2)) == "not an HF causal LM"
    assert install_fused_lm_loss(_llama(), False) == "fused_lm_loss=False"
    for m in (z, half, fp8):
        assert "forward" not in vars(m)
    ids, labels = _batch()
    assert z(input_ids=ids, labels=labels).logits is not None


def test_decision_is_logged_once(caplog):
    _state.forget_logged(("fused-lm-loss", "LlamaForCausalLM", "on"))
    with caplog.at_level(logging.INFO, logger="fp8boost.loss"):
        for _ in range(2):
            assert install_fused_lm_loss(_llama()) is None
    lines = [r.getMessage() for r in caplog.records if "fused lm_head + loss" in r.getMessage()]
    assert len(lines) == 1 and "logits=None" in lines[0] and "fused_lm_loss=False" in lines[0]


def test_switch_is_validated():
    from fp8boost.loss import FusedLmLossConfig
    from fp8boost.plugins import LowLevelZeroPlugin

    assert LowLevelZeroPlugin().fused_lm_loss is True
    cfg = FusedLmLossConfig(chunk_size=4)
    assert LowLevelZeroPlugin(fused_lm_loss=cfg).fused_lm_loss is cfg
    with pytest.raises(TypeError, match="fused_lm_loss must be"):
        LowLevelZeroPlugin(fused_lm_loss="on")
    with pytest.raises(TypeError, match="fused_lm_loss must be"):
        MixedPrecision("bf16", fused_lm_loss=1)
    with pytest.raises(ValueError, match="chunk_size"):
        FusedLmLossConfig(chunk_size=0)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2: this rank's shard


def _run(plugin_cls, ids, labels, tie: bool, **kw):
    from tests.plugins.hybrid_cases import tiny_model

    model = tiny_model(tie=tie)
    booster = Booster(plugin=plugin_cls(precision="fp32", **kw), device="cpu")
    boosted, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out = boosted(input_ids=ids, labels=labels)
    booster.backward(out.loss, opt)
    return (out.loss.detach(), out.logits is None,
            {n: _local(p.grad).clone() for n, p in model.named_parameters()})


def _distributed_runs(rank: int, world: int) -> dict:
    """tp 2 (vocabulary-parallel lm_head), with and without split-gather sequence parallelism,
    and FSDP2 over 2 ranks (tied embeddings; each rank its half of the batch): fused vs not."""
    from fp8boost.plugins import HybridParallelPlugin, TorchFSDPPlugin
    from tests.plugins.hybrid_cases import global_batch

    ids = global_batch(0)
    labels = ids.clone()
    labels[1, :5] = -100
    runs = {(name, fused): _run(HybridParallelPlugin, ids, labels, False, tp_size=2,
                                enable_sequence_parallelism=sp, fused_lm_loss=fused)
            for name, sp, fused in (("tp", False, False), ("tp", False, True),
                                    ("tp_sp", True, True))}
    mine = slice(rank * 2, rank * 2 + 2)
    for fused in (False, True):
        runs[("fsdp", fused)] = _run(TorchFSDPPlugin, ids[mine], labels[mine], True,
                                     fused_lm_loss=fused)
    report = {}
    for (name, fused), (loss, no_logits, grads) in runs.items():
        ref_loss, _, ref_grads = runs[("tp" if name == "tp_sp" else name, False)]
        rel = max(((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item()
                  for n in ref_grads)
        report[(name, fused)] = (abs(loss - ref_loss).item() / ref_loss.item(), no_logits, rel)
    return report


def test_tp2_vocab_parallel_with_and_without_sp_and_fsdp2_match_hf():
    for rank, report in enumerate(run_distributed(_distributed_runs, 2)):
        for key, (loss_rel, no_logits, grad_rel) in report.items():
            assert no_logits == key[1], (rank, key)  # logits=None exactly where fused
            assert loss_rel <= 1e-6 and grad_rel <= 1e-5, (rank, key, report)
