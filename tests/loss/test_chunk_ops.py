"""The fused loss's per-chunk elementwise functions (fp8boost.loss.chunk_ops): the same values as
the op-by-op reference, traceable in one graph, and a compile failure that warns and falls back."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from fp8boost import _state
from fp8boost.loss import chunk_ops

C, V = 12, 40


def _chunk(scale=1.0, softcap=None, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(C, V, generator=g) * 4).to(dtype)
    z[2, 7] = 60.0  # a dominant logit: the log-sum-exp must not overflow
    target = torch.randint(0, V, (C,), generator=g)
    on_slice = torch.ones(C, dtype=torch.bool)
    on_slice[5] = False  # an ignored token
    w = torch.full((C,), 1.0 / 11) * on_slice
    return z, target, on_slice, w, scale, softcap


def _reference(z, target, on_slice, w, scale, softcap):
    x = z.float() * scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    x = x.detach().requires_grad_()
    loss = (F.cross_entropy(x, target, reduction="none") * w).sum()
    loss.backward()
    lse = torch.logsumexp(x.detach(), dim=1)
    picked = torch.where(on_slice, x.detach().gather(1, target[:, None])[:, 0], 0.0)
    return lse, picked, x.grad


@pytest.mark.parametrize("scale,softcap", [(1.0, None), (0.5, None), (1.0, 30.0), (2.0, 5.0)])
def test_stats_and_grad_match_autograd(scale, softcap):
    z, target, on_slice, w, scale, softcap = _chunk(scale, softcap)
    lse, picked = chunk_ops.chunk_stats(z, target, on_slice, scale, softcap)
    g = chunk_ops.chunk_grad(z, lse, target, on_slice, w, scale, softcap, torch.float32)
    r_lse, r_picked, r_dx = _reference(z, target, on_slice, w, scale, softcap)
    torch.testing.assert_close(lse, r_lse)
    torch.testing.assert_close(picked, r_picked)
    # chain rule through the transform: d loss / d z = d loss / d x * d x / d z
    x = z.float().requires_grad_()
    y = x * scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    (y * r_dx).sum().backward()
    torch.testing.assert_close(g, x.grad, rtol=1e-5, atol=1e-7)
    assert g[5].abs().max() == 0  # ignored token: no gradient


def test_both_trace_as_one_graph():
    z, target, on_slice, w, scale, softcap = _chunk(1.0, 30.0)
    eager_stats = chunk_ops.chunk_stats(z, target, on_slice, scale, softcap)
    stats = torch.compile(chunk_ops.chunk_stats, backend="aot_eager", fullgraph=True)(
        z, target, on_slice, scale, softcap)
    grad = torch.compile(chunk_ops.chunk_grad, backend="aot_eager", fullgraph=True)(
        z, stats[0], target, on_slice, w, scale, softcap, torch.bfloat16)
    torch.testing.assert_close(stats, eager_stats)
    torch.testing.assert_close(grad, chunk_ops.chunk_grad(
        z, eager_stats[0], target, on_slice, w, scale, softcap, torch.bfloat16))


def test_a_compile_failure_warns_once_and_runs_the_plain_function(monkeypatch):
    _state.reset()
    calls = []

    def broken(fn):
        def call(*args):
            calls.append(fn.__name__)
            raise RuntimeError("no backend here")
        return call

    monkeypatch.setattr(chunk_ops, "_wants_compile", lambda z: True)
    monkeypatch.setattr(chunk_ops, "_compiled", broken)
    z, target, on_slice, w, scale, softcap = _chunk()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = chunk_ops.run(chunk_ops.chunk_stats, z, target, on_slice, scale, softcap)
        again = chunk_ops.run(chunk_ops.chunk_stats, z, target, on_slice, scale, softcap)
    torch.testing.assert_close(first, chunk_ops.chunk_stats(z, target, on_slice, scale, softcap))
    torch.testing.assert_close(again, first)
    assert calls == ["chunk_stats"]  # tried once, then the plain function
    msgs = [str(w.message) for w in seen if "could not be compiled" in str(w.message)]
    assert len(msgs) == 1 and "no backend here" in msgs[0]
    _state.reset()
