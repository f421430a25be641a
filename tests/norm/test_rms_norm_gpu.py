"""The fused RMSNorm on a GPU at Llama-3-8B's activation shape (8192 tokens x 4096, BF16): as
close to the FP64 result as HF's, and faster forward + backward than HF's eager ops (the reason
for installing it)."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fp8boost.norm import install_fused_rms_norms
from tests.gpu_timing import least_ms

pytestmark = pytest.mark.gpu

M, H = 8192, 4096


def test_fused_norm_is_as_exact_and_faster_than_hfs():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, H, device="cuda", generator=g)
    x[:, ::7] *= 50.0
    x = x.bfloat16()
    dy = torch.randn(M, H, device="cuda", generator=g).bfloat16()
    hf, fused = (LlamaRMSNorm(H, eps=1e-5).cuda().bfloat16() for _ in range(2))
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5, generator=g)
        fused.weight.copy_(hf.weight)
    assert install_fused_rms_norms(fused).fused == ("",)

    def step(norm):
        xx = x.detach().requires_grad_()
        norm.weight.grad = None
        y = norm(xx)
        y.backward(dy)
        return y.detach(), xx.grad, norm.weight.grad

    (y0, dx0, dw0), (y1, dx1, dw1) = step(hf), step(fused)
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * hf.weight.double()
    ulp = exact.abs() * 2.0 ** -7
    assert ((y1.double() - exact).abs() <= ulp).all() and ((y0.double() - exact).abs() <= ulp).all()
    for a, b in ((dx1, dx0), (dw1, dw0)):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2
    t_hf, t_fused = least_ms([lambda: step(hf), lambda: step(fused)])
    print(f"RMSNorm fwd+bwd at {M}x{H} BF16: HF {t_hf:.3f} ms, fused {t_fused:.3f} ms "
          f"({t_hf / t_fused:.2f}x)")
    assert t_fused < t_hf, (t_fused, t_hf)
