"""Booster without a plugin (single process), argument checking, clipping, loss scaling.

Nothing here starts a process group: in the "raise before any collective" tests, every
process-group entry point and collective is replaced by a tripwire, so an argument error that
surfaced only after communication started would fail the test.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fp8boost.booster import Booster, MixedPrecision
from fp8boost.fp8 import Fp8Config, Fp8Linear
from fp8boost.parallel.zero import ZeroOptimizer
from fp8boost.plugins import LowLevelZeroPlugin, TorchDDPPlugin
from tests.plugins import helpers as H

EMULATED = Fp8Config(backend="emulated", min_numel=0)  # tiny layers: convert them anyway
_TRIPWIRED = ("init_process_group", "new_group", "barrier", "broadcast", "broadcast_object_list",
              "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
              "all_to_all_single", "send", "recv")


@pytest.fixture
def no_collectives(monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("a process group / collective was used before the argument error")
    for name in _TRIPWIRED:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, tripwire)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)


def _boost(mp, optim=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), seed=0):
    booster = Booster(mixed_precision=mp, device="cpu")
    model = H.make_mlp(seed)
    model, opt, *_ = booster.boost(model, optim(model))
    return booster, model, opt


@pytest.mark.parametrize("prec,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                        ("fp16", torch.float16), ("fp8", torch.bfloat16)])
def test_mixed_precision_without_plugin_trains(prec, dtype):
    mp = MixedPrecision(prec, EMULATED) if prec == "fp8" else prec
    booster, model, opt = _boost(mp)
    inner = model.unwrap()
    assert all(p.dtype == dtype for p in inner.parameters())
    assert (prec == "fp8") == any(isinstance(m, Fp8Linear) for m in inner.modules())
    if prec != "fp32":  # FP32 master weights live in the optimizer
        assert isinstance(opt, ZeroOptimizer) and all(m.dtype == torch.float32 for m in opt.masters)
    x, y = H.global_batch(0)  # FP32 inputs: the wrapper casts them to the model dtype
    losses = []
    for _ in range(15):
        loss = F.mse_loss(model(x).float(), y)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_bf16_master_weights_match_fp32_training():
    """BF16 O2 tracks FP32 training; the error is BF16 rounding of activations and grads."""
    _, m32, o32 = _boost("fp32")
    b16, m16, o16 = _boost("bf16")
    b32 = Booster(mixed_precision="fp32", device="cpu")
    l32 = H.train(b32, m32, o32, 0, 1, 5)
    l16 = H.train(b16, m16, o16, 0, 1, 5)
    assert H.max_rel(l16, l32) < 1e-2, (l16, l32)
    # BF16 working params are exactly the rounded masters after every step.
    for p, w in zip(m16.unwrap().parameters(), o16.full_master_params()):
        assert torch.equal(p, w.to(torch.bfloat16))


@pytest.mark.parametrize("fused", [None, False], ids=["fused_step", "two_pass_step"])
def test_clip_grad_norm_matches_torch(fused):
    torch.manual_seed(0)
    booster, model, opt = _boost(MixedPrecision("bf16", fused_master_step=fused))
    assert opt._fused is (fused is None)  # AdamW: the default takes the fused master step
    ref = H.make_mlp()
    x, y = H.global_batch(1)
    booster.backward(F.mse_loss(model(x).float(), y), opt)
    F.mse_loss(ref.to(torch.bfloat16)(x.bfloat16()).float(), y).backward()
    # Same BF16 gradients; the norm itself is taken in FP32 (torch would return a BF16 norm).
    expected = torch.cat([p.grad.float().reshape(-1) for p in ref.parameters()]).norm()
    total = booster.clip_grad_norm_(model, opt, 0.1)
    assert abs(float(total) - float(expected)) <= 1e-5 * float(expected)
    assert float(expected) > 0.2  # the clip really scales

    def clipped_norm() -> float:  # the gradients the step will use (the fused one scales late)
        return (torch.cat([g.float().reshape(-1) for g in opt._grad_shards]).norm()
                * opt._grad_mul).item()
    assert abs(clipped_norm() - 0.1) < 1e-4
    # A second, looser clip sees the clipped gradients: it returns their norm and changes nothing.
    again = booster.clip_grad_norm_(model, opt, 1.0)
    assert abs(float(again) - 0.1) < 1e-4 and abs(clipped_norm() - 0.1) < 1e-4
    # A tighter one scales further.
    booster.clip_grad_norm_(model, opt, 0.05)
    assert abs(clipped_norm() - 0.05) < 1e-4


def test_fp16_overflow_skips_step_and_backs_off():
    booster, model, opt = _boost(MixedPrecision("fp16"))
    scale = opt.loss_scaler.scale
    before = [m.clone() for m in opt.masters]
    x, y = H.global_batch(0)
    x[0, 0] = float("inf")  # inf input -> inf/nan gradients
    booster.backward(F.mse_loss(model(x).float(), y), opt)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, opt.masters))
    assert opt.loss_scaler.scale == scale / 2 and opt.loss_scaler.skipped_steps == 1
    H.train(booster, model, opt, 0, 1, 2)
    assert not all(torch.equal(a, b) for a, b in zip(before, opt.masters))


def test_no_sync_without_plugin_accumulates():
    b1, m1, o1 = _boost("fp32", optim=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    b2, m2, o2 = _boost("fp32", optim=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    l1 = H.train(b1, m1, o1, 0, 1, 2)
    l2 = H.train(b2, m2, o2, 0, 1, 2, micro=4)
    assert H.max_rel(l2, l1) < 1e-6


@pytest.mark.parametrize("make,match", [
    (lambda: LowLevelZeroPlugin(stage=3), "stage must be 1 or 2"),
    (lambda: LowLevelZeroPlugin(precision="fp8"), "use_fp8=True"),
    (lambda: LowLevelZeroPlugin(reduce_bucket_size_in_m=0), "reduce_bucket_size_in_m"),
    (lambda: LowLevelZeroPlugin(max_norm=-1.0), "max_norm"),
    (lambda: LowLevelZeroPlugin(fp8_param_gather="some"), "fp8_param_gather"),
    (lambda: LowLevelZeroPlugin(fp8_reduce_scatter=True), "needs fp8_communication=True"),
    (lambda: LowLevelZeroPlugin(growth_interval=0), "growth_interval"),
    (lambda: TorchDDPPlugin(precision="int8"), "precision"),
    (lambda: TorchDDPPlugin(bucket_cap_mb=0), "bucket_cap_mb"),
    (lambda: Booster(plugin=LowLevelZeroPlugin(), mixed_precision="bf16"), "precision=..."),
    (lambda: Booster(plugin=TorchDDPPlugin(precision="bf16"), mixed_precision="fp16"), "precision"),
    (lambda: Booster(mixed_precision="fp64"), "precision"),
])
def test_bad_arguments_raise_value_error(make, match, no_collectives):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make", [
    lambda: LowLevelZeroPlugin(use_fp8=1),
    lambda: LowLevelZeroPlugin(fp8_config={"backend": "emulated"}),
    lambda: LowLevelZeroPlugin(comm_config="fp8"),
    lambda: TorchDDPPlugin(fp8_config="tensorwise"),
    lambda: Booster(plugin="zero2"),
])
def test_bad_argument_types_raise_type_error(make, no_collectives):
    with pytest.raises(TypeError):
        make()


@pytest.mark.parametrize("plugin", [lambda: LowLevelZeroPlugin(),
                                    lambda: TorchDDPPlugin(precision="bf16"), lambda: None])
def test_bad_boost_arguments_raise_before_process_group(plugin, no_collectives):
    booster = Booster(plugin=plugin())
    model = H.make_mlp()
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 32)).sum().backward()
    stepped.step()
    other = torch.optim.SGD(H.make_mlp().parameters(), lr=0.1)
    cases = [((model, other), ValueError, "model.parameters"),
             ((model, "adam"), TypeError, "torch.optim.Optimizer"),
             ((model, None, None, [1, 2]), TypeError, "DataLoader"),
             (("model",), TypeError, "nn.Module")]
    if booster.plugin.__class__.__name__ != "LocalPlugin":  # FP32 without master copies is fine
        cases.append(((model, stepped), ValueError, "already has state"))
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            booster.boost(*args)
    if booster.plugin.__class__.__name__ != "LocalPlugin":  # the tripwire itself works
        with pytest.raises(AssertionError, match="collective was used"):
            booster.boost(H.make_mlp())


def test_boosted_model_forwards_attributes_and_refuses_reboost():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    booster = Booster(mixed_precision="bf16", device="cpu")
    model, *_ = booster.boost(LlamaForCausalLM(cfg))
    assert model.config is model.unwrap().config
    with pytest.raises(ValueError, match="already boosted"):
        booster.boost(model)


def test_use_fp8_that_converts_nothing_warns():
    from fp8boost.fp8 import backends

    from fp8boost import _state
    _state.reset()
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    # An explicit min_numel applies on every backend (the default one only on FP8 hardware).
    cfg = Fp8Config(backend="emulated", min_numel=2048)
    booster = Booster(mixed_precision=MixedPrecision("fp8", cfg), device="cpu")
    with pytest.warns(UserWarning, match="no linear layer was converted"):
        booster.boost(model)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
