"""Issue 35 item 2(a): ``chunked_linear_cross_entropy`` against ``F.cross_entropy(F.linear(...))``.

FP32: the loss and the hidden/weight/bias gradients to rtol 1e-5 (only the summation order
differs). BF16: the reference is HF's path (BF16 GEMM, FP32 loss, BF16 gradient GEMMs); the
weight gradient is accumulated per chunk in BF16, so it gets BF16 tolerances. Nothing of size
``[N, V]`` may be saved for backward; compiled (aot_eager, inductor) equals eager.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8boost.loss import auto_chunk_size, chunked_linear_cross_entropy

N, H, V = 45, 24, 80


def _data(dtype=torch.float32, seed=0, ignore_every=4):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    h[3, 5] = 40.0  # activation outliers: the log-sum-exp must stay exact
    h[17] *= 8.0
    w = torch.randn(V, H, generator=g) * 0.3
    b = torch.randn(V, generator=g)
    y = torch.randint(0, V, (N,), generator=g)
    y[::ignore_every] = -100
    leaves = [t.to(dtype).requires_grad_() for t in (h, w, b)]
    return (*leaves, y)


def _reference(h, w, b, y, reduction="mean", scale=1.0, softcap=None, num_items=None):
    z = F.linear(h, w, b).float() * scale  # HF: the logits in the model dtype, loss in FP32
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, y, ignore_index=-100, reduction=reduction)
    return loss / num_items if num_items is not None else loss


def _grads(fn, h, w, b):
    for t in (h, w, b):
        t.grad = None
    loss = fn()
    (loss * 1.5).backward()  # a grad_output other than 1 must scale the stored gradients
    return loss.detach(), [t.grad.clone() for t in (h, w, b)]


@pytest.mark.parametrize("chunk", [None, 8, 7, 45, 64])  # 7 and 8 do not divide N = 45
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp32_matches_the_reference(chunk, reduction):
    h, w, b, y = _data()
    got, got_g = _grads(lambda: chunked_linear_cross_entropy(
        h, w, y, bias=b, chunk_size=chunk, reduction=reduction), h, w, b)
    want, want_g = _grads(lambda: _reference(h, w, b, y, reduction), h, w, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for g, r in zip(got_g, want_g):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale,softcap", [(0.25, None), (1.0, 3.0), (2.0, 5.0)])
def test_logit_scale_and_softcap(scale, softcap):
    h, w, b, y = _data(seed=1)
    got, got_g = _grads(lambda: chunked_linear_cross_entropy(
        h, w, y, bias=b, chunk_size=16, logit_scale=scale, softcap=softcap), h, w, b)
    want, want_g = _grads(lambda: _reference(h, w, b, y, scale=scale, softcap=softcap), h, w, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for g, r in zip(got_g, want_g):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_num_items_in_batch_divides_the_sum():
    h, w, b, y = _data(seed=2)
    for items in (torch.tensor(123), 7):
        got, got_g = _grads(lambda: chunked_linear_cross_entropy(
            h, w, y, bias=b, chunk_size=10, reduction="sum", num_items_in_batch=items), h, w, b)
        want, want_g = _grads(lambda: _reference(h, w, b, y, "sum", num_items=items), h, w, b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        for g, r in zip(got_g, want_g):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="reduction='sum'"):
        chunked_linear_cross_entropy(h, w, y, num_items_in_batch=3)


def test_bf16_close_to_hf_path():
    h, w, b, y = _data(torch.bfloat16, seed=3)
    got, got_g = _grads(lambda: chunked_linear_cross_entropy(h, w, y, bias=b, chunk_size=8),
                        h, w, b)
    want, want_g = _grads(lambda: _reference(h, w, b, y), h, w, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)  # same BF16 logits, FP32 loss
    # dgrad: the same BF16 GEMM per row, from a softmax gradient rounded to BF16 after another
    # FP32 formula (a BF16 ulp here and there); weight/bias: BF16 sums over 6 chunks.
    for g, r in zip(got_g, want_g):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2,
                                   atol=4e-3 * r.float().abs().max().item())


def test_all_ignored_batch_matches_f_cross_entropy():
    h, w, b, y = _data(seed=4)
    y[:] = -100
    got, got_g = _grads(lambda: chunked_linear_cross_entropy(h, w, y, bias=b, chunk_size=8),
                        h, w, b)
    want, want_g = _grads(lambda: _reference(h, w, b, y), h, w, b)
    assert torch.isnan(got) and torch.isnan(want)  # HF (F.cross_entropy mean over 0 tokens)
    for g, r in zip(got_g, want_g):
        assert torch.equal(g, torch.zeros_like(g)) and torch.equal(r, torch.zeros_like(r))
    loss = chunked_linear_cross_entropy(h, w, y, reduction="sum")
    assert loss.item() == 0.0


def test_nothing_of_size_n_by_v_is_saved_for_backward():
    h, w, b, y = _data(seed=5)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        loss = chunked_linear_cross_entropy(h, w, y, bias=b, chunk_size=8)
    assert saved and all(s.numel() < N * V for s in saved), saved
    assert sorted(map(tuple, saved)) == sorted([(N, H), (V, H), (V,)])
    loss.backward()
    saved.clear()  # the hook sees the reference's [N, V] logits: the check can fail
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        _reference(h, w, b, y)
    assert any(s.numel() >= N * V for s in saved)


def test_no_gradient_wanted_computes_only_the_loss():
    h, w, b, y = _data(seed=6)
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(h, w, y, bias=b, chunk_size=8)
        torch.testing.assert_close(loss, _reference(h, w, b, y), rtol=1e-5, atol=0)
    h2 = h.detach().requires_grad_()
    chunked_linear_cross_entropy(h2, w.detach(), y, chunk_size=8).backward()
    assert h2.grad is not None


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend):
    torch._dynamo.reset()
    h, w, b, y = _data(seed=7)

    def fn(h, w, b, y):  # two chunks, the second partial: fewer kernels for inductor to build
        return chunked_linear_cross_entropy(h, w, y, bias=b, chunk_size=32)

    compiled = torch.compile(fn, backend=backend, fullgraph=True)  # raises on a graph break
    got, got_g = _grads(lambda: compiled(h, w, b, y), h, w, b)
    want, want_g = _grads(lambda: fn(h, w, b, y), h, w, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for g, r in zip(got_g, want_g):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_bad_arguments_raise():
    h, w, b, y = _data()
    with pytest.raises(ValueError, match="reduction"):
        chunked_linear_cross_entropy(h, w, y, reduction="none")
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_linear_cross_entropy(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="labels"):
        chunked_linear_cross_entropy(h, w, y[:-1])
    with pytest.raises(ValueError, match="weight"):
        chunked_linear_cross_entropy(h, w.t(), y)


def test_auto_chunk_size():
    assert auto_chunk_size(8192, 128256) == 1024
    assert auto_chunk_size(8192, 32000) == 4096
    assert auto_chunk_size(50, 80) == 50
