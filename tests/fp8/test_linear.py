"""Fp8Linear (emulated backend) against exact references.

Tolerances:
* "tight": against an FP32 matmul of the *dequantized* FP8 operands (the exact math the backend
  promises): only FP32 summation order differs, so rel err < 1e-5.
* "loose": against the unquantized FP32 layer. e4m3 keeps 3 mantissa bits (relative rounding
  <= 2^-4 per element, ~2^-4/sqrt(3) RMS); the product of two rounded operands therefore errs by
  ~sqrt(2) * 0.036 ~ 0.05 RMS relative at worst; e5m2 gradients (2 bits, 2^-3) about twice that.
  We assert 0.06 for forward (e4m3 x e4m3) and 0.12 for dgrad/wgrad (e5m2 x e4m3).
"""
import pytest
import torch
from torch import nn

from fp8boost.fp8 import Fp8Config, Fp8Linear
from fp8boost.fp8.backends import EmulatedBackend
from fp8boost.fp8.scaling import E4M3, E5M2, quantize_tensorwise

EMU = Fp8Config(backend="emulated")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def make(k=96, n=48, bias=True, cfg=EMU, seed=0):
    torch.manual_seed(seed)
    layer = Fp8Linear(k, n, bias=bias, config=cfg)
    with torch.no_grad():
        layer.weight.normal_(0, 0.5)
        if bias:
            layer.bias.normal_()
    return layer


def test_forward_dgrad_wgrad_match_dequantized_fp32_matmul():
    layer = make()
    x = (torch.randn(4, 10, 96) * 3).requires_grad_()
    dy = torch.randn(4, 10, 48) * 0.1
    y = layer(x)
    y.backward(dy)
    xq = quantize_tensorwise(x.detach().reshape(-1, 96), E4M3)
    wq = quantize_tensorwise(layer.weight.detach(), E4M3)
    dyq = quantize_tensorwise(dy.reshape(-1, 48), E5M2)
    y_ref = xq.dequantize() @ wq.dequantize().t() + layer.bias.detach()
    dx_ref = dyq.dequantize() @ wq.dequantize()
    dw_ref = dyq.dequantize().t() @ xq.dequantize()
    assert rel(y.reshape(-1, 48), y_ref) < 1e-5
    assert rel(x.grad.reshape(-1, 96), dx_ref) < 1e-5
    assert rel(layer.weight.grad, dw_ref) < 1e-5
    torch.testing.assert_close(layer.bias.grad, dy.reshape(-1, 48).sum(0), rtol=1e-5, atol=1e-5)


def test_close_to_unquantized_fp32_layer():
    layer = make(k=256, n=128)
    ref = nn.Linear(256, 128)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(64, 256, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(64, 128)
    layer(x).backward(dy)
    ref(x2).backward(dy)
    assert rel(layer(x), ref(x2)) < 0.06
    assert rel(x.grad, x2.grad) < 0.12
    assert rel(layer.weight.grad, ref.weight.grad) < 0.12


def test_bf16_input_and_params_keep_dtype():
    layer = make().to(torch.bfloat16)
    x = torch.randn(3, 5, 96, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert layer.weight.grad.dtype == torch.bfloat16 and layer.bias.grad.dtype == torch.bfloat16


def test_leading_dims_no_bias_and_no_grad():
    layer = make(bias=False)
    x = torch.randn(2, 3, 4, 96)
    with torch.no_grad():
        y = layer(x)
    assert y.shape == (2, 3, 4, 48) and y.grad_fn is None
    with pytest.raises(ValueError, match="last dim"):
        layer(torch.randn(2, 95))


def test_frozen_weight_still_gives_input_grad():
    layer = make()
    layer.weight.requires_grad_(False)
    x = torch.randn(8, 96, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is None


class CountingBackend(EmulatedBackend):
    def __init__(self):
        self.shapes = []

    def quantize(self, x, dtype, **kw):
        self.shapes.append(tuple(x.shape))
        return super().quantize(x, dtype, **kw)


def test_weight_cast_is_cached_until_the_weight_changes():
    layer = make()
    backend = CountingBackend()
    layer.resolve_backend(torch.device("cpu"))
    layer.use_backend(backend, torch.device("cpu"))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(8, 96)
    layer(x).sum().backward()  # one forward of this weight: cast, nothing kept
    assert backend.shapes.count((48, 96)) == 1 and layer.operands.cache[1] is None
    for _ in range(4):  # more micro-batches, no step: cast once more, then cached
        layer(x).sum().backward()
    assert backend.shapes.count((48, 96)) == 2 and layer.operands.cache[1] is not None
    opt.step()  # in-place update bumps the version counter
    layer(x).sum().backward()
    assert backend.shapes.count((48, 96)) == 3 and layer.operands.cache[1] is None
    uncached = make(cfg=EMU.replace(cache_weight_cast=False))
    uncached.resolve_backend(torch.device("cpu"))
    uncached.use_backend(b2 := CountingBackend(), torch.device("cpu"))
    for _ in range(2):
        uncached(x).sum().backward()
    assert b2.shapes.count((48, 96)) == 2


def saved_bytes(module, x):
    """Bytes of tensors autograd saves for backward that are not parameters (i.e. activations)."""
    params = {p.data_ptr() for p in module.parameters()}
    total = []

    def pack(t):
        if t.data_ptr() not in params:
            total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(total)


def test_backward_saves_fp8_activations_not_bf16():
    m, k, n = 256, 512, 256
    fp8 = make(k=k, n=n).to(torch.bfloat16)
    ref = nn.Linear(k, n).to(torch.bfloat16)
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    ref_bytes = saved_bytes(ref, x)
    fp8_bytes = saved_bytes(fp8, x)
    assert ref_bytes == m * k * 2  # nn.Linear keeps the BF16 input
    # x^T in e4m3 (1 byte/elt) + the W^T cast for dgrad (n*k bytes) + scales.
    assert fp8_bytes <= m * k + n * k + 64
    assert fp8_bytes - n * k <= ref_bytes / 2 + 64


def test_delayed_matches_current_scaling_on_stationary_input_and_state_roundtrips():
    cur = make()
    dly = make(cfg=EMU.replace(recipe="delayed", amax_history_len=4))
    x = torch.randn(16, 96)
    for _ in range(4):
        a, b = cur(x), dly(x)
        assert torch.equal(a, b)  # same amax every step -> same scales
    # A growing input: delayed scaling uses the stale (smaller) amax and saturates, current does not.
    big = x * 4
    a, b = cur(big), dly(big)
    assert rel(b, a) > 1e-3
    assert dly.fp8_amax_history[0, 0].item() == pytest.approx(big.abs().max().item())
    sd = dly.state_dict()
    fresh = make(cfg=EMU.replace(recipe="delayed", amax_history_len=4), seed=1)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh(x), dly(x))


def test_delayed_grad_history_is_recorded_in_backward():
    dly = make(cfg=EMU.replace(recipe="delayed", amax_history_len=4))
    x = torch.randn(16, 96)
    for i in range(3):
        dy = torch.full((16, 48), float(i + 1))
        dly(x).backward(dy)
    assert dly.fp8_amax_history[2, :3].tolist() == [3.0, 2.0, 1.0]


def test_amax_reduce_hook_reaches_all_roles():
    dly = make(cfg=EMU.replace(recipe="delayed"))
    calls = []
    dly.set_amax_reduce_fn(lambda a: calls.append(a.item()))
    dly(torch.randn(4, 96, requires_grad=True)).sum().backward()
    assert len(calls) >= 3


def test_non_finite_input_gives_nan_output():
    layer = make()
    x = torch.randn(4, 96)
    x[0, 0] = float("inf")
    assert torch.isnan(layer(x)).all()


def test_zero_input_gives_bias_only():
    layer = make()
    y = layer(torch.zeros(4, 96))
    torch.testing.assert_close(y, layer.bias.detach().expand(4, 48))


@pytest.mark.parametrize("opt_kwargs", [{"foreach": True}, {"fused": True}])
def test_weight_cache_is_invalidated_by_any_optimizer_step(opt_kwargs):
    # fused AdamW updates parameters without bumping their version counter: the cache must
    # still notice the step.
    layer = make()
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1, **opt_kwargs)
    x = torch.randn(8, 96)
    layer(x).sum().backward()
    opt.step()
    fresh = make(seed=5)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(layer(x), fresh(x))


def test_weight_cache_after_data_writes_needs_explicit_invalidation():
    from fp8boost.fp8.linear import invalidate_weight_caches

    layer = make()
    x = torch.randn(8, 96)
    layer(x)
    before = layer(x)  # the second forward of this weight caches its cast
    with torch.no_grad():
        layer.weight.data.copy_(torch.randn_like(layer.weight) * 0.5)  # no version bump
    assert torch.equal(before, layer(x))  # documented limit: .data writes are invisible
    invalidate_weight_caches(layer)
    fresh = make(seed=5)
    fresh.load_state_dict(layer.state_dict())
    assert not torch.equal(before, layer(x))
    assert torch.equal(layer(x), fresh(x))
