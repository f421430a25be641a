"""Reference FP8 math: casts bit-exact against torch's own casts, saturation, special values."""
import pytest
import torch

from fp8boost.fp8.scaling import (E4M3, E5M2, DelayedScalingState, amax, cast_to_fp8, dequantize,
                                  fp8_max, quantize_tensorwise, round_down_pow2, scale_from_amax)


def all_finite_bf16() -> torch.Tensor:
    bits = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    return x[torch.isfinite(x)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_cast_bit_exact_vs_torch_over_all_finite_bf16(dtype):
    x = all_finite_bf16()
    m = fp8_max(dtype)
    one = torch.ones(())
    ours = cast_to_fp8(x, one, dtype)
    in_range = x.float().abs() <= m
    # Inside the range our cast is torch's own round-to-nearest-even cast, bit for bit.
    torch.testing.assert_close(bits(ours[in_range]), bits(x[in_range].float().to(dtype)), rtol=0, atol=0)
    # Outside it saturates to +-max (torch's e5m2 cast would give +-inf there).
    big = x[~in_range]
    assert big.numel() > 0
    expected = torch.where(big > 0, torch.tensor(m), torch.tensor(-m)).to(dtype)
    torch.testing.assert_close(bits(ours[~in_range]), bits(expected), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_cast_with_scale_matches_torch_after_scaling(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=g) * 30).to(torch.bfloat16)
    scale = scale_from_amax(amax(x), dtype)
    ours = cast_to_fp8(x, scale, dtype)
    ref = (x.float() * scale).to(dtype)  # in range by construction of the scale
    torch.testing.assert_close(bits(ours), bits(ref), rtol=0, atol=0)
    # The largest element lands exactly on fp8_max.
    assert ours.float().abs().max().item() == fp8_max(dtype)


def test_special_values():
    x = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e6, -1e6, float("inf"), float("-inf")])
    q = cast_to_fp8(x, torch.ones(()), E4M3).float()
    assert q[0].item() == 0 and torch.signbit(q[1])
    assert q[2].item() == 0 and q[3].item() == 0  # underflow to (signed) zero
    assert q[4].item() == 448 and q[5].item() == -448  # saturation
    assert q[6].item() == 448 and q[7].item() == -448
    assert torch.isnan(cast_to_fp8(torch.tensor([float("nan")]), torch.ones(()), E5M2).float()).all()


def test_amax_zero_gives_unit_scale_and_exact_zeros():
    x = torch.zeros(16, 16, dtype=torch.bfloat16)
    q = quantize_tensorwise(x, E4M3)
    assert q.inv_scale.item() == 1.0
    assert torch.equal(q.dequantize(), torch.zeros(16, 16))
    assert amax(torch.empty(0)).item() == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_propagated_visibly(bad):
    x = torch.randn(8, 8)
    x[3, 4] = bad
    q = quantize_tensorwise(x, E4M3)
    assert torch.isnan(q.inv_scale).item()
    assert torch.isnan(q.dequantize()).all()  # never hidden: every element becomes NaN


def test_tiny_amax_does_not_overflow_scale():
    s = scale_from_amax(torch.tensor(1e-45), E4M3)
    assert torch.isfinite(s).item()


def test_power_of_2_rounding_is_exact():
    vals = torch.tensor([1.0, 1.5, 3.99, 4.0, 448 / 3.7, 7e-3, 2.0 ** -20 * 1.25])
    p = round_down_pow2(vals)
    assert torch.equal(p, torch.exp2(torch.floor(torch.log2(vals.double()))).float())
    s = scale_from_amax(torch.tensor(3.7), E4M3, power_of_2=True)
    assert s.item() == 64.0  # 448/3.7 = 121.08 -> 64


def test_margin_halves_scale():
    a = torch.tensor(2.0)
    assert scale_from_amax(a, E4M3, margin=1).item() == pytest.approx(448 / 2 / 2)


@pytest.mark.parametrize("dtype, rel", [(E4M3, 2 ** -4), (E5M2, 2 ** -3)])
def test_quantize_dequantize_error_bound(dtype, rel):
    """Round-to-nearest with m mantissa bits errs by <= 2^-(m+1) relative, for normal values."""
    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(1)) * 7
    q = quantize_tensorwise(x, dtype)
    err = (q.dequantize() - x).abs()
    tiny = fp8_max(dtype) * 2.0 ** -12 / (1 / q.inv_scale)  # below this we are near subnormals
    normal = x.abs() > tiny
    assert (err[normal] <= rel * x.abs()[normal] + 1e-12).all()
    assert torch.equal(dequantize(q.data, q.inv_scale), q.dequantize())


def test_delayed_scaling_lags_one_step_and_uses_history_max():
    st = DelayedScalingState(E4M3, history_len=3, algo="max")
    xs = [torch.full((4,), v) for v in (1.0, 2.0, 4.0, 0.5, 0.5, 0.5)]
    scales = []
    for x in xs:
        scales.append(st.scale.clone() if st.initialized else None)
        st.quantize(x)
    # step 0 is seeded from its own amax; afterwards the scale is 448 / max(history).
    assert st.history.tolist() == [0.5, 0.5, 0.5]
    assert scales[1].item() == pytest.approx(448 / 1.0)
    assert scales[2].item() == pytest.approx(448 / 2.0)
    assert scales[3].item() == pytest.approx(448 / 4.0)
    assert scales[5].item() == pytest.approx(448 / 4.0)  # 4.0 still in the 3-long history
    recent = DelayedScalingState(E4M3, history_len=3, algo="most_recent")
    for x in xs[:3]:
        recent.quantize(x)
    assert recent.scale.item() == pytest.approx(448 / 4.0)


def test_delayed_scaling_reduce_hook_is_applied():
    st = DelayedScalingState(E4M3, history_len=2)
    st.amax_reduce_fn = lambda a: a.mul_(2)  # stands in for all_reduce(MAX) over a group
    st.quantize(torch.full((4,), 3.0))
    assert st.history[0].item() == 6.0
