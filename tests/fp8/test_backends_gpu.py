"""GPU: the cuBLAS backend agrees with the emulated reference (run on the device machine)."""
import pytest
import torch

from fp8boost.fp8 import Fp8Config, Fp8Linear
from fp8boost.fp8.backends import get_backend
from fp8boost.fp8.scaling import E4M3, E5M2

pytestmark = pytest.mark.gpu


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("m, k, n", [(256, 512, 384), (200, 256, 128), (8192, 4096, 4096)])
def test_cublas_mm_matches_emulated(m, k, n):
    dev = torch.device("cuda")
    emu, cub = get_backend("emulated", dev), get_backend("cublas", dev)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 3
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    aq, _ = emu.quantize(a, E4M3)
    bq, _ = emu.quantize(b, E4M3)
    ref = emu.mm(aq.data, bq.data, aq.inv_scale, bq.inv_scale, out_dtype=torch.float32)
    for fast in (False, True):
        out = cub.mm(aq.data, bq.data, aq.inv_scale, bq.inv_scale, out_dtype=torch.float32,
                     use_fast_accum=fast)
        # Hopper FP8 MMA keeps partial sums in reduced (~22-bit) precision; cuBLAS promotes them
        # to FP32 every few K-blocks unless fast accumulation is on. Measured on an H200:
        # 1.3e-4 promoted at K=512; fast accumulation errs more as K grows.
        assert rel(out, ref) < (3e-3 if fast else 5e-4)
    out_bf16 = cub.mm(aq.data, bq.data, aq.inv_scale, bq.inv_scale, out_dtype=torch.bfloat16)
    assert rel(out_bf16, ref) < 8e-3  # bf16 output rounding (2^-9 relative)


def test_cublas_e5m2_times_e4m3_and_bias():
    dev = torch.device("cuda")
    emu, cub = get_backend("emulated", dev), get_backend("cublas", dev)
    dy = torch.randn(128, 64, device=dev)
    w = torch.randn(96, 64, device=dev)
    bias = torch.randn(96, device=dev, dtype=torch.bfloat16)
    dq, _ = emu.quantize(dy, E5M2)
    wq, _ = emu.quantize(w, E4M3)
    ref = emu.mm(dq.data, wq.data, dq.inv_scale, wq.inv_scale, bias=bias, out_dtype=torch.float32)
    out = cub.mm(dq.data, wq.data, dq.inv_scale, wq.inv_scale, bias=bias, out_dtype=torch.bfloat16)
    assert rel(out, ref) < 8e-3


@pytest.mark.parametrize("backend", ["cublas", "triton"])
def test_fp8_linear_gpu_backends_match_emulated(backend):
    torch.manual_seed(0)
    ref = Fp8Linear(1024, 512, config=Fp8Config(backend="emulated")).cuda().bfloat16()
    fast = Fp8Linear(1024, 512, config=Fp8Config(backend=backend, fast_accum_fprop=False)).cuda().bfloat16()
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(4, 300, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(4, 300, 512, device="cuda", dtype=torch.bfloat16)
    ref(x).backward(dy)
    fast(x2).backward(dy)
    assert rel(fast(x2), ref(x)) < 1e-2
    assert rel(x2.grad, x.grad) < 1e-2
    assert rel(fast.weight.grad, ref.weight.grad) < 1e-2
