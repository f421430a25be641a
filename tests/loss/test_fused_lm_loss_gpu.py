"""Issue 35 item 2(a) on a GPU: the fused lm_head + loss at Llama-3-8B's head shape (8192 tokens,
hidden 4096, vocabulary 128256, BF16) against ``F.cross_entropy(F.linear(...).float())``: the
same loss and gradients (BF16 tolerances), and a lower peak memory (the reference holds the
BF16 logits, their FP32 copy and its gradient: ~10 GB; the fused loss ~1.6 GB per chunk plus the
stored weight gradient)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8boost.loss import chunked_linear_cross_entropy
from tests.gpu_timing import least_ms

pytestmark = pytest.mark.gpu

N, H, V = 8192, 4096, 128256


def _peak_extra(fn, h, w) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    """Peak memory above what was allocated before ``fn`` ran its forward and backward (GiB)."""
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fn()
    loss.backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30, loss.detach(), [h.grad, w.grad]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_llama3_head_shape_bf16_matches_and_uses_less_memory():
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(N, H, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    y[:512] = -100  # a prompt

    fused_peak, fused, fused_g = _peak_extra(
        lambda: chunked_linear_cross_entropy(h, w, y), h, w)
    ref_peak, ref, ref_g = _peak_extra(
        lambda: F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100), h, w)
    print(f"peak above inputs: fused {fused_peak:.2f} GiB, reference {ref_peak:.2f} GiB")
    torch.testing.assert_close(fused, ref, rtol=1e-4, atol=0)
    assert _rel(fused_g[0], ref_g[0]) < 1e-2 and _rel(fused_g[1], ref_g[1]) < 1e-2
    assert fused_peak < 0.5 * ref_peak, (fused_peak, ref_peak)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_llama3_head_shape_fp8_head_is_close_and_faster(recipe):
    """Issue 35 item 2b: the FP8 head (logits and dL/dh GEMMs in FP8) at the Llama-3-8B head
    shape, against the BF16 fused head: loss and gradients within FP8 tolerance, and faster."""
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(N, H, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda", generator=g)

    def run(fp8_recipe):
        h.grad = w.grad = None
        loss = chunked_linear_cross_entropy(h, w, y, fp8_recipe=fp8_recipe)
        loss.backward()
        return loss.detach()

    bf16, bf16_g = run(None), [h.grad.clone(), w.grad.clone()]
    fp8 = run(recipe)
    assert abs(fp8.item() - bf16.item()) / bf16.item() < 1e-2
    assert _rel(h.grad, bf16_g[0]) < 0.1 and _rel(w.grad, bf16_g[1]) < 0.05
    assert fp8.item() != bf16.item()  # the FP8 GEMMs ran
    t_bf16, t_fp8 = least_ms([lambda: run(None), lambda: run(recipe)])
    print(f"fused head fwd+bwd at {N}x{H}x{V}: BF16 {t_bf16:.2f} ms, FP8 {recipe} "
          f"{t_fp8:.2f} ms ({t_bf16 / t_fp8:.2f}x)")
    assert t_fp8 < t_bf16, (t_fp8, t_bf16)
