"""The Triton grouped FP8 GEMMs of the experts, M-grouped (``fp8boost.fp8.kernels.grouped_mm``:
forward and input gradient) and K-grouped (``grouped_wgrad``: weight gradient), against the
emulated grouped GEMMs (FP32 products of the dequantized operands).

CPU (CI): the kernel runs in Triton's interpreter in a child process, on a real routing layout
(uneven experts, an empty one, padding rows of zero bytes as the casts write them), distinct
per-(expert, row) scales, e4m3/e5m2 operands, fast and promoted accumulation, shapes that are
not multiples of the tiles; relative difference 1e-2 (accumulation order, BF16 output).

GPU (``@pytest.mark.gpu``): every config against torch's ``_scaled_grouped_mm`` at a Qwen3-like
shape (relative difference 1e-2: accumulation order and BF16 output), and the tuned dispatch.
"""
from __future__ import annotations

import pytest
import torch

from fp8boost.fp8.moe.gemm import emulated_mm, emulated_mm_wgrad
from fp8boost.fp8.moe.routing import route
from tests.fp8.interp_child import IN_CHILD, run_interpreter_suite

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def operands(tokens: int, k: int, e: int, m: int, n: int, dtypes=(E4M3, E4M3), seed: int = 0,
             device="cpu"):
    """``a [m, rows]``, ``b [n, rows]`` FP8 with zero bytes on rows of no expert, scales
    ``[E, m]`` / ``[E, n]``, and the routing (expert 1 gets no rows)."""
    g = torch.Generator(device=device).manual_seed(seed)
    probs = torch.tensor([3.0, 0.0] + [1.0 + i for i in range(e - 2)], device=device)
    r = route(torch.multinomial(probs.expand(tokens, e), k, generator=g), e)
    keep = (r.group < e).view(1, -1)

    def fp8(rows_of, dtype):
        x = torch.randn(rows_of, r.rows, generator=g, device=device) * 4
        return torch.where(keep, x, 0).to(dtype)

    a, b = fp8(m, dtypes[0]), fp8(n, dtypes[1])
    a_inv = torch.rand(e, m, generator=g, device=device) + 0.25
    b_inv = torch.rand(e, n, generator=g, device=device) + 0.25
    return r, a, a_inv, b, b_inv


def test_interpreter_suite():
    """Runs ``TestInterpreter`` below in a fresh process with ``TRITON_INTERPRET=1``."""
    run_interpreter_suite(__file__)


def mm_operands(tokens: int, k: int, e: int, n: int, kdim: int, dtypes=(E4M3, E4M3),
                seed: int = 0, device="cpu"):
    """``a [rows, K]`` (zero bytes on rows of no expert), ``b [E, N, K]``, scales ``[rows]`` /
    ``[E, N]``, and the routing (expert 1 gets no rows)."""
    g = torch.Generator(device=device).manual_seed(seed)
    probs = torch.tensor([3.0, 0.0] + [1.0 + i for i in range(e - 2)], device=device)
    r = route(torch.multinomial(probs.expand(tokens, e), k, generator=g), e)
    a = torch.randn(r.rows, kdim, generator=g, device=device) * 4
    a = torch.where((r.group < e).view(-1, 1), a, 0).to(dtypes[0])
    b = (torch.randn(e, n, kdim, generator=g, device=device) * 4).to(dtypes[1])
    a_inv = torch.rand(r.rows, generator=g, device=device) + 0.25
    b_inv = torch.rand(e, n, generator=g, device=device) + 0.25
    return r, a, a_inv, b, b_inv


def valid_rows(out, r):
    return out[r.group < r.num_experts]


@pytest.fixture(scope="class")
def gm():
    if not IN_CHILD:
        pytest.skip("runs in a child process (see test_interpreter_suite)")
    from fp8boost.fp8.kernels import grouped_mm

    return grouped_mm


@pytest.fixture(scope="class")
def gw():
    if not IN_CHILD:
        pytest.skip("runs in a child process (see test_interpreter_suite)")
    from fp8boost.fp8.kernels import grouped_wgrad

    return grouped_wgrad


@pytest.mark.usefixtures("gw", "gm")
class TestInterpreter:
    @pytest.mark.parametrize("fast", [True, False])
    @pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)])
    def test_mm_matches_emulated(self, gm, fast, dtypes):
        r, a, a_inv, b, b_inv = mm_operands(70, 2, 5, 40, 48, dtypes)
        assert gm.supports(a, a_inv, b, b_inv, r.offsets)
        got = gm.triton_mm(a, a_inv, b, b_inv, r.offsets, fast, gm.INTERP_CONFIG)
        want = emulated_mm(a, a_inv, b, b_inv, r.offsets, r.group, r.local)
        assert got.shape == want.shape == (r.rows, 40) and got.dtype == torch.bfloat16
        got, want = valid_rows(got, r), valid_rows(want, r)
        assert rel(got, want) < 1e-2
        assert (got.float() - want).abs().max() < 1e-2 * want.abs().max()

    def test_mm_dispatch_runs_the_kernel_in_the_interpreter(self, gm):
        r, a, a_inv, b, b_inv = mm_operands(40, 2, 4, 32, 32, seed=1)

        def torch_mm():
            raise AssertionError("the interpreter runs the Triton kernel")

        got = gm.grouped_mm(a, a_inv, b, b_inv, r.offsets, False, torch_mm)
        want = emulated_mm(a, a_inv, b, b_inv, r.offsets, r.group, r.local)
        assert rel(valid_rows(got, r), valid_rows(want, r)) < 1e-2

    @pytest.mark.parametrize("fast", [True, False])
    @pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)])
    def test_matches_emulated(self, gw, fast, dtypes):
        r, a, a_inv, b, b_inv = operands(70, 2, 5, 40, 56, dtypes)
        assert gw.supports(a, b, a_inv, b_inv, r.offsets)
        got = gw.triton_wgrad(a, a_inv, b, b_inv, r.offsets, fast, gw.INTERP_CONFIG)
        want = emulated_mm_wgrad(a, a_inv, b, b_inv, r.offsets, r.group, r.local)
        assert got.shape == want.shape == (5, 40, 56) and got.dtype == torch.bfloat16
        assert (got[1] == 0).all()  # the empty expert
        # Accumulation order and the BF16 output: 1e-2 as for every grouped GEMM test, and
        # no element off by more than 1% of the largest.
        assert rel(got, want) < 1e-2
        assert (got.float() - want).abs().max() < 1e-2 * want.abs().max()

    @pytest.mark.parametrize("probs", [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0],
                                       [5.0, 1.0, 0.0, 0.0, 3.0]],
                             ids=["first-empty", "last-empty", "one-expert", "two-empty"])
    @pytest.mark.parametrize("slices", ["one", "two", "each"])
    def test_streams_every_routing_layout(self, gw, probs, slices):
        """The kernel streams its slice of the experts' rows in one loop and stores each
        expert's tile at its last chunk: empty experts first, last and side by side, one
        expert, and experts of several chunks (150 tokens over 32-row chunks) all give the
        reference, with the experts in one slice, two uneven ones, or one slice each."""
        e = len(probs)
        split = {"one": 1, "two": min(2, e), "each": e}[slices]
        g = torch.Generator().manual_seed(7)
        idx = torch.multinomial(torch.tensor(probs).expand(150, e), 1, generator=g)
        r = route(idx, e)
        keep = (r.group < e).view(1, -1)
        a = torch.where(keep, torch.randn(24, r.rows, generator=g) * 4, 0).to(E4M3)
        b = torch.where(keep, torch.randn(40, r.rows, generator=g) * 4, 0).to(E4M3)
        a_inv = torch.rand(e, 24, generator=g) + 0.25
        b_inv = torch.rand(e, 40, generator=g) + 0.25
        got = gw.triton_wgrad(a, a_inv, b, b_inv, r.offsets, False, gw.INTERP_CONFIG, split)
        want = emulated_mm_wgrad(a, a_inv, b, b_inv, r.offsets, r.group, r.local)
        for ex, p in enumerate(probs):
            if p == 0:
                assert (got[ex] == 0).all(), ex
        assert rel(got, want) < 1e-2

    def test_dispatch_runs_the_kernel_in_the_interpreter(self, gw):
        r, a, a_inv, b, b_inv = operands(40, 2, 4, 32, 48, seed=1)

        def torch_wgrad():
            raise AssertionError("the interpreter runs the Triton kernel")

        got = gw.grouped_wgrad(a, a_inv, b, b_inv, r.offsets, False, torch_wgrad)
        want = emulated_mm_wgrad(a, a_inv, b, b_inv, r.offsets, r.group, r.local)
        assert rel(got, want) < 1e-2


def test_supports_refuses_what_the_kernel_cannot_take():
    pytest.importorskip("triton")
    from fp8boost.fp8.kernels import grouped_wgrad as gw

    r, a, a_inv, b, b_inv = operands(40, 2, 4, 32, 48, seed=2)
    assert not gw.supports(a, b, a_inv, b_inv, r.offsets)  # CPU without the interpreter
    assert not gw.supports(a.float(), b, a_inv, b_inv, r.offsets)
    assert not gw.supports(a, b, a_inv, b_inv, r.offsets.long())
    assert not gw.supports(a, b[:, :16], a_inv, b_inv, r.offsets)
    assert not gw.supports(a, b, a_inv[:, :8], b_inv, r.offsets)
    with pytest.raises(ValueError, match="_scaled_grouped_mm"):
        gw.triton_wgrad(a, a_inv, b, b_inv, r.offsets, False)
    assert gw.expert_split(96, 128, torch.device("cpu")) == 1
    calls = []
    from fp8boost import _state

    assert gw.grouped_wgrad(a, a_inv, b, b_inv, r.offsets, False,
                            lambda: calls.append(1) or "torch") == "torch" and calls == [1]
    assert _state.was_logged(("grouped-torch-only", "grouped_wgrad"))  # said, not silent


def test_mm_supports_refuses_what_the_kernel_cannot_take():
    pytest.importorskip("triton")
    from fp8boost.fp8.kernels import grouped_mm as gm

    r, a, a_inv, b, b_inv = mm_operands(40, 2, 4, 32, 48, seed=2)
    assert not gm.supports(a, a_inv, b, b_inv, r.offsets)  # CPU without the interpreter
    assert not gm.supports(a.float(), a_inv, b, b_inv, r.offsets)
    assert not gm.supports(a, a_inv, b[..., :40], b_inv, r.offsets)
    assert not gm.supports(a, a_inv, b, b_inv[:, :8], r.offsets)
    with pytest.raises(ValueError, match="_scaled_grouped_mm"):
        gm.triton_mm(a, a_inv, b, b_inv, r.offsets, False)
    assert gm.grouped_mm(a, a_inv, b, b_inv, r.offsets, False, lambda: "torch") == "torch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fast", [False, True])
def test_cuda_mm_configs_match_torch(fast):
    from fp8boost.fp8.kernels import grouped_mm as gm
    from fp8boost.fp8.moe.gemm import scaled_mm

    r, a, a_inv, b, b_inv = mm_operands(4096, 8, 32, 1024, 768, seed=4, device="cuda")
    want = valid_rows(emulated_mm(a, a_inv, b, b_inv, r.offsets, r.group, r.local), r)
    torch_out = torch._scaled_grouped_mm(a, b.transpose(-2, -1), a_inv, b_inv, offs=r.offsets,
                                         out_dtype=torch.bfloat16, use_fast_accum=fast)
    assert rel(valid_rows(torch_out, r), want) < 1e-2
    for cfg in gm.CONFIGS:
        got = gm.triton_mm(a, a_inv, b, b_inv, r.offsets, fast, cfg)
        assert rel(valid_rows(got, r), want) < 1e-2, (cfg, rel(valid_rows(got, r), want))
    # The op the experts call: whichever kernel was timed fastest, the same result.
    assert rel(valid_rows(scaled_mm(a, a_inv, b, b_inv, r.offsets, fast), r), want) < 1e-2
    print("moe-mm timings (ms):", gm._CACHE.timings)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fast", [False, True])
def test_cuda_configs_match_torch(fast):
    from fp8boost.fp8.kernels import grouped_wgrad as gw
    from fp8boost.fp8.moe.gemm import scaled_mm_wgrad

    r, a, a_inv, b, b_inv = operands(2048, 8, 32, 768, 1024, seed=3, device="cuda")
    want = emulated_mm_wgrad(a, a_inv, b, b_inv, r.offsets, r.group, r.local)
    torch_out = torch._scaled_grouped_mm(a, b.t(), a_inv.reshape(-1), b_inv.reshape(-1),
                                         offs=r.offsets, out_dtype=torch.bfloat16,
                                         use_fast_accum=fast)
    assert rel(torch_out[r.offsets.diff(prepend=r.offsets[:1] * 0) > 0],
               want[r.offsets.diff(prepend=r.offsets[:1] * 0) > 0]) < 1e-2
    for cfg in gw.CONFIGS:
        for split in (None, 1, 5, 32):  # the SM-filling default, none, uneven, one per expert
            got = gw.triton_wgrad(a, a_inv, b, b_inv, r.offsets, fast, cfg, split)
            assert (got[1] == 0).all(), (cfg, split)
            assert rel(got, want) < 1e-2, (cfg, split, rel(got, want))
    # The op the experts call: whichever kernel was timed fastest, the same result.
    assert rel(scaled_mm_wgrad(a, a_inv, b, b_inv, r.offsets, fast), want) < 1e-2
    print("moe-wgrad timings (ms):", gw._CACHE.timings)
