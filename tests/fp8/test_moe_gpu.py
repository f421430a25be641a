"""FP8 experts on a GPU: ``torch._scaled_grouped_mm`` against the emulated path, and a speed print.

Run on the device machine: ``pytest -m gpu -s tests/fp8/test_moe_gpu.py``.

Tolerances: the CUDA path and the emulated path quantize to the same FP8 bytes and scales; they
differ only in accumulation (tensor cores, fast accumulation in fprop) and in the BF16 output
the kernel writes (8 mantissa bits: ~0.2% per element), so their relative (Frobenius) difference
is allowed 1e-2. Against the HF BF16 module, FP8 rounding: 0.12 as in tests/fp8/test_moe.py.
"""
import copy
import time
import warnings

import pytest
import torch

from fp8boost.fp8 import Fp8Config
from fp8boost.fp8.moe import Fp8Experts, GroupedOptions, find_expert_spec, grouped_linear, route
from fp8boost.fp8.moe.gemm import probe_problem, resolve_backend
from fp8boost.fp8.moe.quantize import ScaleOptions

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_scaled_grouped_mm_probe_passes():
    why = probe_problem(torch.device("cuda"))
    assert why is None, why
    assert resolve_backend(Fp8Config(), torch.device("cuda")) == "scaled_grouped_mm"


@pytest.mark.parametrize("e,t,k,h,n", [(4, 200, 2, 256, 512), (16, 64, 4, 128, 96),
                                       (8, 512, 2, 512, 1024)])
def test_cuda_grouped_linear_matches_emulated_forward_and_backward(e, t, k, h, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(0, e, (t, k), device="cuda", generator=g)
    idx[: t // 2, 0] = 1  # uneven groups; with e=16 and t*k=256 some experts are empty
    r = route(idx, e)
    x = torch.zeros(r.rows, h, device="cuda", dtype=torch.bfloat16)
    x[r.pos] = torch.randn(t * k, h, device="cuda", generator=g).bfloat16()
    x[r.pos[3], 7] = 40.0  # outlier
    w = (torch.randn(e, n, h, device="cuda", generator=g) * 0.05).bfloat16()
    dy = torch.zeros(r.rows, n, device="cuda", dtype=torch.bfloat16)
    dy[r.pos] = torch.randn(t * k, n, device="cuda", generator=g).bfloat16()
    out = {}
    for backend in ("scaled_grouped_mm", "emulated"):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_linear(xg, wg, r, GroupedOptions(ScaleOptions(power_of_2=True), backend))
        y.backward(dy)
        out[backend] = (y, xg.grad, wg.grad)
    for name, got, want in zip(("y", "dx", "dw"), out["scaled_grouped_mm"], out["emulated"]):
        assert torch.isfinite(got).all(), name
        assert rel(got, want) < 1e-2, (name, rel(got, want))
    empty = torch.bincount(idx.reshape(-1), minlength=e) == 0
    assert (out["scaled_grouped_mm"][2][empty] == 0).all()


def test_fp8_experts_on_cuda_match_hf_bf16_and_print_speed():
    cfg = transformers.Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768,
                                      num_experts=32, num_experts_per_tok=8)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    torch.manual_seed(0)
    cfg._experts_implementation = "grouped_mm"  # HF's fastest BF16 experts as the baseline
    hf = Qwen3MoeExperts(cfg).cuda().bfloat16()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02)
    ref = copy.deepcopy(hf)
    fp8 = Fp8Experts(hf, find_expert_spec(hf), Fp8Config(backend="auto"))
    t = 8192
    x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(32, device="cuda")[:8] for _ in range(t)])
    w = torch.rand(t, 8, device="cuda").softmax(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y_ref = ref(x, idx, w)
    y = fp8(x, idx, w)
    assert rel(y, y_ref) < 0.12

    def step(mod):
        xi = x.detach().requires_grad_()
        mod(xi, idx, w).sum().backward()

    times = {}
    for name, mod in (("bf16_grouped_mm", ref), ("fp8", fp8)):
        for _ in range(3):
            step(mod)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            step(mod)
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / 10 * 1e3
    print(f"\nQwen3-MoE experts (E 32, k 8, h 2048, i 768, T {t}) fwd+bwd ms: {times} "
          f"-> fp8 {times['bf16_grouped_mm'] / times['fp8']:.2f}x bf16")
