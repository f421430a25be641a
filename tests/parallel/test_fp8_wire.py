"""Single-process tests of the FP8 wire format and its casts (no process group needed).

The torch cast path promises bit-exactness with the reference math of fp8boost.fp8.scaling
(``cast_to_fp8`` / ``dequantize``), with and without power-of-two scales.
"""
import pytest
import torch

from fp8boost.fp8.scaling import cast_to_fp8, dequantize, scale_from_amax
from fp8boost.parallel.comm.config import Fp8CommConfig
from fp8boost.parallel.comm.wire import (ALIGN, TRAILER, dequantize_rows, dequantize_sum_rows,
                                        num_stages, quantize_rows, read_inv_scales, row_amax,
                                        segment_bytes, stage_bounds, stage_scales)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _rows(dtype, rows=5, cols=301, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 4, rows)[:, None]
    x[0, :7] *= 1e-5  # values that land in the FP8 subnormal range
    x[1] = 0.0        # amax 0 -> scale 1
    return x.to(dtype)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pow2", [True, False])
def test_quantize_dequantize_bit_exact_vs_reference(fp8_dtype, dtype, pow2):
    x = _rows(dtype)
    rows, cols = x.shape
    x_strided = torch.cat([x, x], dim=1)[:, :cols]  # row stride 2*cols, unit column stride
    packed = torch.empty(rows, segment_bytes(cols), dtype=torch.uint8)
    quantize_rows(x, packed, fp8_dtype, power_of_2=pow2, impl="torch")
    for r in range(rows):
        scale = scale_from_amax(x[r].abs().max().float(), fp8_dtype, 0, pow2)
        ref = cast_to_fp8(x[r], scale, fp8_dtype)
        assert torch.equal(packed[r, :cols], ref.view(torch.uint8)), f"row {r}"
        assert read_inv_scales(packed, cols)[r].item() == scale.reciprocal().item()
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.empty(rows, cols, dtype=out_dtype)
        dequantize_rows(packed, cols, fp8_dtype, out, power_of_2=pow2, impl="torch")
        inv = read_inv_scales(packed, cols)
        ref = dequantize(packed[:, :cols].view(fp8_dtype), inv[:, None], out_dtype)
        assert torch.equal(out, ref), out_dtype
    packed2 = torch.empty_like(packed)
    quantize_rows(x_strided, packed2, fp8_dtype, power_of_2=pow2, impl="torch")
    assert torch.equal(packed2[:, :cols], packed[:, :cols])


def test_layout_alignment_trailer_and_specials():
    assert ALIGN == 16 and TRAILER == 16
    assert [segment_bytes(n) for n in (0, 1, 16, 17)] == [16, 32, 32, 48]
    x = torch.tensor([[1.0, float("nan"), 3.0], [0.0, 0.0, 0.0], [2.0, -8.0, 0.5]])
    packed = torch.empty(3, segment_bytes(3), dtype=torch.uint8)
    quantize_rows(x, packed, E4M3, power_of_2=True, impl="torch")
    inv = read_inv_scales(packed, 3)
    assert torch.isnan(inv[0]) and inv[1] == 1.0 and inv[2] == 8.0 / 256.0  # 448/8 -> 32
    out = torch.empty(3, 3)
    dequantize_rows(packed, 3, E4M3, out, power_of_2=True, impl="torch")
    assert torch.isnan(out[0]).all()  # a NaN poisons its chunk visibly, never silently
    assert torch.equal(out[1:], x[1:])
    assert torch.equal(row_amax(torch.empty(2, 0)), torch.zeros(2))


def test_dequantize_sum_matches_fp32_reference():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1000, generator=g) * torch.tensor([1.0, 10.0, 0.01, 3.0])[:, None]
    packed = torch.empty(3, segment_bytes(1000), dtype=torch.uint8)
    quantize_rows(x[1:], packed, E5M2, power_of_2=True, impl="torch")
    deq = torch.empty(3, 1000)
    dequantize_rows(packed, 1000, E5M2, deq, power_of_2=True, impl="torch")
    out = torch.empty(1000, dtype=torch.bfloat16)
    dequantize_sum_rows(packed, 1000, E5M2, out, local=x[0], post_scale=0.25, impl="torch")
    ref = (x[0].double() + deq.double().sum(0)) * 0.25
    # Only FP32 accumulation (4 terms, 2**-24 each) and the final BF16 rounding (2**-8).
    bound = 2.0**-8 * ref.abs() + 4 * 2.0**-24 * (x[0].abs() + deq.abs().sum(0)).double()
    assert ((out.double() - ref).abs() <= bound).all()


def test_config_validation():
    cfg = Fp8CommConfig()
    assert cfg.param_dtype == E4M3 and cfg.grad_dtype == E5M2 and cfg.min_payload_numel >= 0
    with pytest.raises(ValueError, match="param_dtype"):
        Fp8CommConfig(param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="min_payload_numel"):
        Fp8CommConfig(min_payload_numel=-1)
    with pytest.raises(TypeError, match="min_payload_numel"):
        Fp8CommConfig(min_payload_numel=1.5)
    with pytest.raises(ValueError, match="all_gather_scale"):
        Fp8CommConfig(all_gather_scale="global")
    with pytest.raises(ValueError, match="cast_impl"):
        Fp8CommConfig(cast_impl="cuda")
    with pytest.raises(TypeError, match="enabled"):
        Fp8CommConfig(enabled=1)
    assert cfg.replace(min_payload_numel=0).min_payload_numel == 0
    with pytest.raises(TypeError):
        Fp8CommConfig(True)  # keyword-only


def test_functions_refuse_without_process_group():
    import torch.distributed as dist
    from fp8boost.parallel.fp8_comm import all_gather_fp8
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ValueError, match="init_process_group"):
        all_gather_fp8(torch.randn(4))


def test_pipeline_stages():
    assert num_stages(10, 0, 8) == 1 and num_stages(10, 10, 8) == 1
    assert num_stages(33, 10, 8) == 4 and num_stages(10**9, 10, 8) == 8
    assert stage_bounds(0, 3) == [(0, 0)]
    assert stage_bounds(1000, 4) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert stage_bounds(100, 4) == [(0, 100)]  # stages are at least 128 wide
    x = torch.randn(3, 1000) * torch.tensor([[1.0], [100.0], [0.0]])
    bounds = stage_bounds(1000, 3)
    scales = stage_scales(x, bounds, E4M3, True)
    ref = torch.stack([torch.stack([scale_from_amax(x[r, lo:hi].abs().max(), E4M3, 0, True)
                                    for lo, hi in bounds]) for r in range(3)])
    assert torch.equal(scales, ref)
