"""Triton FP8 kernels: casts, GEMM, custom ops, TritonBackend.

CPU (CI): the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``) at small, ragged
shapes. The interpreter's own FP32->FP8 conversion is unfaithful, so the cast kernel rounds to
the FP8 grid itself when interpreting; that makes the casts comparable *bit for bit* with
``fp8boost.fp8.scaling`` even here. GEMM outputs in BF16 are truncated by the interpreter's
stores, so those are compared with a tolerance of one BF16 ulp (2**-7 relative).

GPU (``@pytest.mark.gpu``, run on the device machine): bit-exact casts against
``scaling.cast_to_fp8`` and GEMM accuracy against an FP32 matmul of the dequantized operands,
with cuBLAS (``torch._scaled_mm``) error as the yardstick; torch.compile (inductor) fwd+bwd.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch

from fp8boost.fp8 import scaling
from fp8boost.fp8.backends import CublasBackend
from fp8boost.fp8.config import Fp8Config
from fp8boost.fp8.linear import Fp8Linear
from tests.fp8.interp_child import IN_CHILD, run_interpreter_suite

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _ref_quantize(x, dtype, scale=None, margin=0, power_of_2=False):
    a = scaling.amax(x)
    s = scaling.scale_from_amax(a, dtype, margin, power_of_2) if scale is None else scale.float()
    return scaling.cast_to_fp8(x, s, dtype), s, a


def _assert_cast_exact(r, x, dtype, scale=None, margin=0, power_of_2=False, with_t=True):
    q, s, a = _ref_quantize(x, dtype, scale, margin, power_of_2)
    assert torch.equal(r.amax.cpu(), a.cpu()), (r.amax, a)
    assert torch.equal(r.scale.cpu(), s.reshape(()).cpu()), (r.scale, s)
    assert torch.equal(r.inv_scale.cpu(), s.reciprocal().reshape(()).cpu())
    assert torch.equal(_bits(r.data), _bits(q)), _diff("row-major payload", r.data, q)
    if with_t:
        qt = q.t().contiguous()
        assert torch.equal(_bits(r.data_t), _bits(qt)), _diff("transposed copy", r.data_t, qt)
    else:
        assert r.data_t is None


def _diff(what, got, want) -> str:
    bad = (_bits(got) != _bits(want)).nonzero()
    i = tuple(bad[0].tolist())
    return (f"{what} differs from the reference at {bad.shape[0]} of {got.numel()} elements "
            f"of {tuple(got.shape)}; first at {i}: {got[i].float().item()} vs "
            f"{want[i].float().item()}; rows {sorted(set(bad[:, 0].tolist()))[:8]}")


def _gemm_ref(a, b, sa, sb, bias):
    out = (a.float() * sa.float()) @ (b.float() * sb.float()).t()
    return out + bias.float() if bias is not None else out


def _rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


# --------------------------------------------------------------------------------------------
# CPU: Triton interpreter
# --------------------------------------------------------------------------------------------
# The interpreter must be on before anything imports triton (triton's own tl.* library
# functions are decorated at import time), and the full test run imports triton early
# (torch.compile). So the interpreter tests run in a child process that sets the variable first.
_CHILD = IN_CHILD


def test_interpreter_suite():
    """Runs ``TestInterpreter`` below in a fresh process with ``TRITON_INTERPRET=1``."""
    run_interpreter_suite(__file__)


@pytest.fixture(scope="class")
def interp():
    """The kernel modules, imported with the interpreter on (child process only)."""
    if not _CHILD:
        pytest.skip("runs in a child process (see test_interpreter_suite)")
    from fp8boost.fp8.kernels import cast, gemm

    return cast, gemm


@pytest.mark.usefixtures("interp")
class TestInterpreter:
    @pytest.mark.parametrize("dtype", [E4M3, E5M2])
    @pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32, torch.float16])
    def test_cast_current_bit_exact(self, interp, dtype, xdtype):
        cast = interp[0]
        g = torch.Generator().manual_seed(1)
        x = (torch.randn(37, 70, generator=g) * 5).to(xdtype)
        x[3, 5] = 300.0  # one outlier sets the scale; most values land in subnormals/low bins
        x[0, 0] = -0.0
        for with_t in (False, True):
            r = cast.quantize(x, dtype, with_transpose=with_t)
            _assert_cast_exact(r, x, dtype, with_t=with_t)
        # Non-contiguous input (a transposed view) and margin / power-of-2 scales.
        xt = x.t()
        r = cast.quantize(xt, dtype, margin=2, power_of_2=True, with_transpose=True)
        _assert_cast_exact(r, xt, dtype, margin=2, power_of_2=True)

    @pytest.mark.parametrize("dtype", [E4M3, E5M2])
    def test_cast_given_scale_fuses_amax(self, interp, dtype):
        cast = interp[0]
        g = torch.Generator().manual_seed(2)
        x = torch.randn(50, 33, generator=g).to(torch.bfloat16) * 40
        # A stale (delayed) scale that overflows the range: values must saturate, not wrap/inf.
        scale = scaling.scale_from_amax(scaling.amax(x) / 8, dtype)
        r = cast.quantize(x, dtype, scale=scale, with_transpose=True)
        _assert_cast_exact(r, x, dtype, scale=scale)
        assert _bits(r.data).eq(_bits(torch.tensor(scaling.fp8_max(dtype)).to(dtype))).any()

    def test_transpose_bytes_ragged(self, interp):
        from fp8boost.fp8.kernels.transpose import transpose_bytes

        g = torch.Generator().manual_seed(3)
        for shape in ((100, 70), (64, 128), (1, 5)):
            x = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
            assert torch.equal(transpose_bytes(x), x.t().contiguous()), shape
        f8 = torch.randn(65, 33, generator=g).to(E4M3)
        assert torch.equal(_bits(transpose_bytes(f8.view(torch.uint8))), _bits(f8.t().contiguous()))

    def test_cast_edge_values(self, interp):
        cast = interp[0]
        zeros = torch.zeros(9, 17, dtype=torch.bfloat16)
        r = cast.quantize(zeros, E4M3, with_transpose=True)
        _assert_cast_exact(r, zeros, E4M3)
        assert r.scale.item() == 1.0
        tiny = torch.full((4, 4), 1e-45)  # reciprocal overflows: scale clamps to FP32 max
        r = cast.quantize(tiny, E5M2)
        _assert_cast_exact(r, tiny, E5M2, with_t=False)
        for bad in (float("nan"), float("inf"), -float("inf")):
            x = torch.randn(20, 24)
            x[7, 3] = bad
            r = cast.quantize(x, E4M3, with_transpose=True)
            assert math.isnan(r.scale.item()) and math.isnan(r.inv_scale.item())
            if bad != bad:
                assert math.isnan(r.amax.item())
            else:
                assert r.amax.item() == float("inf")
            assert torch.isnan(r.data.float()).all() and torch.isnan(r.data_t.float()).all()
        empty = torch.empty(0, 16)
        r = cast.quantize(empty, E4M3, with_transpose=True)
        assert r.data.shape == (0, 16) and r.data_t.shape == (16, 0) and r.amax.item() == 0
        x = torch.randn(33, 20)
        assert torch.equal(cast.amax_only(x), scaling.amax(x))

    def test_cast_rejects_bad_input(self, interp):
        cast = interp[0]
        with pytest.raises(ValueError, match="2-D"):
            cast.quantize(torch.randn(2, 3, 4), E4M3)
        with pytest.raises(TypeError, match="float32/bfloat16/float16"):
            cast.quantize(torch.ones(4, 4, dtype=torch.int32), E4M3)
        with pytest.raises(TypeError, match="float8"):
            cast.quantize(torch.randn(4, 4), torch.float16)
        with pytest.raises(ValueError, match="1-element"):
            cast.quantize(torch.randn(4, 4), E4M3, scale=torch.ones(2))

    @pytest.mark.parametrize("pointer", [False, True, "lagged"], ids=["tma", "pointer", "lagged"])
    def test_gemm_matches_fp32_reference(self, interp, pointer, monkeypatch):
        gemm = interp[1]
        if pointer == "lagged":  # TMA kernel, promoted accumulation one K-block behind
            monkeypatch.setattr(gemm, "_INTERP_CONFIG", gemm._INTERP_CONFIG._replace(lagged=True))
            pointer = False
        g = torch.Generator().manual_seed(3)
        # (M, N, K): ragged M, K not a multiple of BLOCK_K; TMA-eligible strides unless pointer.
        shapes = [(37, 48, 80), (64, 40, 48)] + ([(33, 20, 50)] if pointer else [])
        for (m, n, k) in shapes:
            a = torch.randn(m, k, generator=g).to(E4M3)
            b = (torch.randn(n, k, generator=g) * 4).to(E5M2)
            sa, sb = torch.tensor(0.37), torch.tensor(2.5)
            bias = torch.randn(n, generator=g).to(torch.bfloat16)
            for fast, with_bias, out_dtype in [(True, False, torch.bfloat16),
                                               (False, True, torch.float32),
                                               (True, True, torch.float32),
                                               (False, False, torch.bfloat16)]:
                bb = bias if with_bias else None
                out = gemm.mm(a, b, sa, sb, bb, out_dtype, fast, force_pointer=pointer)
                ref = _gemm_ref(a, b, sa, sb, bb)
                assert out.shape == (m, n) and out.dtype == out_dtype
                if out_dtype == torch.float32:  # exact products, FP32 sums: only order differs
                    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
                else:  # interpreter truncates BF16 stores: within one BF16 ulp
                    assert ((out.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-3).all()

    def test_gemm_rejects_bad_input(self, interp):
        gemm = interp[1]
        a = torch.randn(8, 16).to(E4M3)
        one = torch.tensor(1.0)
        with pytest.raises(ValueError, match="K-major"):
            gemm.mm(a, torch.randn(16, 8).to(E4M3), one, one)
        with pytest.raises(TypeError, match="float8"):
            gemm.mm(a, torch.randn(4, 16), one, one)
        with pytest.raises(ValueError, match="1-element"):
            gemm.mm(a, a, torch.ones(8), one)
        with pytest.raises(ValueError, match="bias"):
            gemm.mm(a, a, one, one, bias=torch.ones(3))
        with pytest.raises(TypeError, match="out_dtype"):
            gemm.mm(a, a, one, one, out_dtype=torch.int8)


# --------------------------------------------------------------------------------------------
# CPU: custom ops and torch.compile through TritonBackend
# --------------------------------------------------------------------------------------------
# test_schema compares outputs with arithmetic that torch does not implement for float8.
_OPCHECKS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def test_custom_ops_opcheck():
    from fp8boost.fp8.kernels import ops  # noqa: F401 (registers torch.ops.fp8boost.*)

    x = torch.randn(24, 40)
    for args in [(x, E4M3, None, 0, False, True), (x, E5M2, torch.tensor(3.0), 0, False, False)]:
        torch.library.opcheck(torch.ops.fp8boost.quantize.default, args, test_utils=_OPCHECKS)
    a, b = torch.randn(16, 32).to(E4M3), torch.randn(8, 32).to(E4M3)
    s = torch.tensor(0.5)
    for bias in (None, torch.randn(8)):
        torch.library.opcheck(torch.ops.fp8boost.scaled_mm.default,
                              (a, b, s, s, bias, torch.bfloat16, True, False),
                              test_utils=_OPCHECKS)


def _with_triton_backend(layer: Fp8Linear, device) -> Fp8Linear:
    from fp8boost.fp8.kernels.backend import TritonBackend

    layer.use_backend(TritonBackend(), torch.device(device))
    return layer


@pytest.mark.parametrize("casts", ["kernel", "inductor"])
def test_compile_fwd_bwd_through_custom_ops(casts):
    """Fp8Linear on TritonBackend under torch.compile(aot_eager) on CPU: the graph holds the
    fp8boost GEMM op (and, with ``compiled_casts="kernel"``, the cast op; with "inductor" the
    casts are plain torch ops), and fwd+bwd equal the emulated backend bit for bit."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = Fp8Config(backend="emulated")
    ref = Fp8Linear(64, 48, config=cfg)
    layer = Fp8Linear(64, 48, config=cfg.replace(compiled_casts=casts))
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(4, 8, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=_capture(graphs), bw_compiler=_capture(graphs))(
            gm, example_inputs)

    compiled = torch.compile(_with_triton_backend(layer, "cpu"), backend=backend, fullgraph=True)
    y1 = compiled(x1)
    (y1.float().square().sum()).backward()
    y2 = ref(x2)
    (y2.float().square().sum()).backward()
    assert torch.equal(y1, y2)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(layer.weight.grad, ref.weight.grad)
    # Static shapes: dynamo's graph holds the trace-time-dispatched GEMM (gemm_direct), which
    # AOT decomposes (here, on CPU, into the reference arithmetic; on CUDA into the chosen
    # kernel); the cast op stays an opaque node.
    assert "fp8boost.scaled_mm_direct" in graphs[0].print_readable(print_output=False)
    code = "\n".join(g.code for g in graphs[1:])
    assert "fp8boost.scaled_mm" not in code
    assert ("fp8boost.quantize" in code) == (casts == "kernel")


def test_compile_dynamic_shapes_keep_the_dispatching_gemm_op(caplog):
    """A symbolic token count cannot key the tuner: the graph keeps fp8boost::scaled_mm (the
    run-time dispatching op), says so once at INFO, and still matches the emulated backend."""
    from fp8boost import _state

    _state.forget_logged("gemm-compiled-symbolic")
    caplog.set_level(logging.INFO, logger="fp8boost.fp8.kernels")
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = Fp8Config(backend="emulated")
    ref = Fp8Linear(64, 48, config=cfg)
    layer = Fp8Linear(64, 48, config=cfg.replace(compiled_casts="kernel"))
    layer.load_state_dict(ref.state_dict())
    graphs = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=_capture(graphs), bw_compiler=_capture(graphs))(
            gm, example_inputs)

    compiled = torch.compile(_with_triton_backend(layer, "cpu"), backend=backend,
                             dynamic=True, fullgraph=True)
    x = torch.randn(3, 8, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y = compiled(x)
    y.float().square().sum().backward()
    y2 = ref(x2)
    y2.float().square().sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    aot = "\n".join(g.code for g in graphs)  # the AOT graphs (dynamo's is not kept here)
    assert aot.count("fp8boost.scaled_mm.default") == 3 and "scaled_mm_direct" not in aot
    said = [r.getMessage() for r in caplog.records if "symbolic sizes" in r.getMessage()]
    assert len(said) == 1 and "dynamic=False" in said[0]


@pytest.mark.parametrize("dynamic", [True, False, None], ids=["dynamic", "static", "auto"])
def test_static_shapes_tells_symbolic_sizes_while_dynamo_traces(dynamic):
    """compiled_mm asks static_shapes while dynamo traces, where type() of a symbolic size
    answers int: a symbolic size must still read as such (it would reach the trace-time plan,
    which takes constants only: an error on the GPU). Automatic dynamic: static first, then
    symbolic once dynamo marks the size dynamic."""
    from fp8boost.fp8.kernels.gemm_direct import static_shapes

    torch._dynamo.reset()
    f = torch.compile(lambda x: x * (2 if static_shapes(x) else 3), dynamic=dynamic,
                      fullgraph=True, backend="eager")
    seen = [f(torch.ones(n, 16))[0, 0].item() for n in (32, 48, 64)]
    want = {True: [3.0] * 3, False: [2.0] * 3, None: [2.0, 3.0, 3.0]}[dynamic]
    assert seen == want
    assert static_shapes(torch.ones(4, 16), None)  # eager: plain ints


def test_trace_time_plan_reads_the_tuner_decision(monkeypatch):
    """gemm_direct._plan (a constant of dynamo's trace): the cached decision for the GEMM's
    layout decides whether the graph launches the Triton TMA kernel itself ("tma", the SM
    count, the config) or leaves it to scaled_mm_direct ("other": cuBLAS, no TMA layout)."""
    from fp8boost.fp8.kernels import gemm, gemm_direct

    monkeypatch.setattr(gemm, "num_sms", lambda device: 132)
    monkeypatch.setattr(gemm, "_CACHE", gemm.ConfigCache("test-plan"))

    def plan(k_stride):
        return gemm_direct._plan((256, 128), (k_stride, 1), (64, 128), (128, 1), E4M3,
                                 E4M3, torch.bfloat16, False, True, True, 0)

    def key(k_stride):
        a = torch.empty(0, dtype=E4M3, device="meta").as_strided((256, 128), (k_stride, 1))
        b = torch.empty(64, 128, dtype=E4M3, device="meta")
        return gemm.candidates(a, b, None, torch.bfloat16, True, gemm.tma_layout_ok(
            a, b, torch.bfloat16), True, 0)[0]

    gemm._CACHE.best[key(128)] = gemm.FAST_CONFIGS[1]
    assert plan(128) == ("tma", 132, *gemm.FAST_CONFIGS[1])
    gemm._CACHE.best[key(128)] = gemm.CUBLAS
    assert plan(128) == ("other",)
    gemm._CACHE.best[key(136)] = gemm.FAST_CONFIGS[0]  # rows 136 bytes apart: not 16-aligned
    assert key(136)[0] is False and plan(136) == ("other",)


def test_direct_gemm_op_matches_reference_and_opcheck():
    """fp8boost::scaled_mm_direct on CPU: the reference arithmetic, fake/AOT registrations."""
    from fp8boost.fp8.kernels import gemm_direct, ops

    a, b = torch.randn(16, 32).to(E4M3), torch.randn(8, 32).to(E4M3)
    s = torch.tensor(0.5)
    for bias in (None, torch.randn(8)):
        got = gemm_direct.scaled_mm_direct(a, b, s, s, bias, torch.bfloat16, True, False)
        assert torch.equal(got, ops.reference_scaled_mm(a, b, s, s, bias, torch.bfloat16))
        torch.library.opcheck(torch.ops.fp8boost.scaled_mm_direct.default,
                              (a, b, s, s, bias, torch.bfloat16, True, False),
                              test_utils=_OPCHECKS)
    assert gemm_direct.static_shapes(a, b, None)


def _capture(graphs):
    from functorch.compile import make_boxed_func

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return compiler


# --------------------------------------------------------------------------------------------
# GPU (device machine)
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
class TestGpu:
    @pytest.fixture(autouse=True)
    def _fast_tuning(self):
        from fp8boost.fp8.kernels import tuning

        tuning.set_autotune(False)  # accuracy does not depend on the config; keep tests quick
        yield
        tuning.set_autotune(True)

    @pytest.mark.parametrize("dtype", [E4M3, E5M2])
    @pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32, torch.float16])
    def test_cast_bit_exact(self, dtype, xdtype):
        from fp8boost.fp8.kernels import cast

        g = torch.Generator(device="cuda").manual_seed(4)
        for (rows, cols) in [(1000, 3000), (8192, 4096), (17, 4104)]:
            x = (torch.randn(rows, cols, device="cuda", generator=g) *
                 torch.logspace(-6, 3, cols, device="cuda")).to(xdtype)
            for with_t in (False, True):
                _assert_cast_exact(cast.quantize(x, dtype, with_transpose=with_t), x, dtype,
                                   with_t=with_t)
            r = cast.quantize(x.t(), dtype, margin=1, power_of_2=True, with_transpose=True)
            _assert_cast_exact(r, x.t(), dtype, margin=1, power_of_2=True)
            scale = scaling.scale_from_amax(scaling.amax(x) / 4, dtype)  # saturating
            _assert_cast_exact(cast.quantize(x, dtype, scale=scale, with_transpose=True), x,
                               dtype, scale=scale)

    def test_cast_scale_math_bit_exact(self):
        """The in-kernel scale_from_amax equals the torch reference over many amax values."""
        from fp8boost.fp8.kernels import cast

        vals = torch.cat([torch.logspace(-44, 38, 3000, dtype=torch.float64).float(),
                          torch.rand(2000) * 1000, torch.tensor([0.0, 1e-45, 3.4e38])])
        for v in vals.tolist():
            x = torch.full((2, 3), v, device="cuda")
            for dtype, margin, p2 in [(E4M3, 0, False), (E5M2, 3, True)]:
                r = cast.quantize(x, dtype, margin=margin, power_of_2=p2)
                s = scaling.scale_from_amax(scaling.amax(x), dtype, margin, p2)
                assert torch.equal(r.scale, s), (v, r.scale, s)
                assert torch.equal(r.inv_scale, s.reciprocal())
        x = torch.randn(300, 500, device="cuda")
        x[1, 2] = float("nan")
        r = cast.quantize(x, E5M2, with_transpose=True)
        assert torch.isnan(r.amax) and torch.isnan(r.scale)
        assert torch.isnan(r.data.float()).all() and torch.isnan(r.data_t.float()).all()

    @pytest.mark.parametrize("fast", [True, False], ids=["fast", "promoted"])
    def test_gemm_accuracy(self, fast):
        from fp8boost.fp8.kernels import gemm

        g = torch.Generator(device="cuda").manual_seed(5)
        for (m, n, k, pointer) in [(1000, 768, 512, False), (8191, 4096, 4096, False),
                                   (2048, 1024, 16384, False), (999, 250, 333, True),
                                   (512, 512, 1024, True)]:
            # fast: fprop-like e4m3 x e4m3; promoted: dgrad-like e5m2 x e4m3.
            a = (torch.randn(m, k, device="cuda", generator=g) * 8).to(E4M3 if fast else E5M2)
            b = torch.randn(n, k, device="cuda", generator=g).to(E4M3)
            sa = torch.tensor(0.25, device="cuda")
            sb = torch.tensor(0.125, device="cuda")
            bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
            ref = _gemm_ref(a, b, sa, sb, bias)
            for out_dtype in (torch.float32, torch.bfloat16):
                out = gemm.mm(a, b, sa, sb, bias, out_dtype, fast, force_pointer=pointer)
                err = _rel_err(out, ref)
                # Yardstick: cuBLAS on the same operands (padded to 16 where needed).
                cub = CublasBackend().mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype,
                                         use_fast_accum=fast)
                cerr = _rel_err(cub, ref)
                print(f"gemm {m}x{n}x{k} fast={fast} {out_dtype} ptr={pointer}: "
                      f"triton {err:.2e} cublas {cerr:.2e}")
                assert err <= 1.5 * cerr + 1e-6, (err, cerr)
                assert err < (8e-3 if out_dtype == torch.bfloat16 else 4e-3)

    def test_gemm_every_config(self):
        """Each tuning candidate (the tuner may pick any of them) is accurate, ragged M too."""
        import triton

        from fp8boost.fp8.kernels import gemm

        g = torch.Generator(device="cuda").manual_seed(6)
        m, n, k = 1000, 768, 640
        for fast, cfgs in ((True, gemm.FAST_CONFIGS), (False, gemm.PRECISE_CONFIGS)):
            a = (torch.randn(m, k, device="cuda", generator=g) * 8).to(E4M3 if fast else E5M2)
            b = torch.randn(n, k, device="cuda", generator=g).to(E4M3)
            sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")
            ref = _gemm_ref(a, b, sa, sb, None)
            cerr = _rel_err(torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                             out_dtype=torch.float32, use_fast_accum=fast), ref)
            for use_tma in (True, False):
                launch = gemm.launcher(a, b, sa, sb, None, torch.float32, fast, use_tma)
                for cfg in cfgs:
                    if cfg.lagged and not use_tma:
                        continue
                    try:
                        out = launch(cfg)
                    except triton.runtime.errors.OutOfResources:
                        continue  # the tuner skips such configs the same way

                    err = _rel_err(out, ref)
                    assert not torch.isnan(out).any()
                    assert err <= 1.5 * cerr + 1e-6, (cfg, use_tma, err, cerr)

    def test_linear_and_compile_fwd_bwd(self):
        torch.manual_seed(0)
        x = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16)
        layers = {}
        for name in ("emulated", "triton"):
            layers[name] = Fp8Linear(1024, 768, config=Fp8Config(backend=name),
                                     device="cuda", dtype=torch.bfloat16)
        layers["triton"].load_state_dict(layers["emulated"].state_dict())
        outs = {}
        for name, layer in layers.items():
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.float().square().mean().backward()
            outs[name] = (y, xi.grad, layer.weight.grad.clone())
            layer.weight.grad = None
        for t, e in zip(outs["triton"], outs["emulated"]):
            assert _rel_err(t, e.float()) < 2e-2
        # torch.compile (inductor) through the custom ops: same as eager triton.
        layer = layers["triton"]
        compiled = torch.compile(layer)
        xi = x.clone().requires_grad_()
        y = compiled(xi)
        y.float().square().mean().backward()
        for t, e in zip((y, xi.grad, layer.weight.grad), outs["triton"]):
            assert _rel_err(t, e.float()) < 1e-2

    def test_compiled_gemm_with_dynamic_sizes_keeps_the_run_time_op(self):
        """A symbolic token count under torch.compile(dynamic=True) cannot take the traced
        launch (its plan needs constants): the graph calls the run-time op, and the result
        equals the eager GEMM's."""
        from torch._inductor.utils import run_and_get_code

        from fp8boost.fp8.kernels import gemm
        from fp8boost.fp8.kernels.backend import TritonBackend

        be = TritonBackend(allow_cublas=True)
        g = torch.Generator(device="cuda").manual_seed(3)
        b = torch.randn(1024, 768, device="cuda", generator=g).to(E4M3)
        sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")
        torch._dynamo.reset()
        f = torch.compile(lambda a: be.mm(a, b, sa, sb, out_dtype=torch.bfloat16,
                                          use_fast_accum=True), dynamic=True, fullgraph=True)
        for m in (1536, 1024):  # the second size runs the same (symbolic) graph
            a = (torch.randn(m, 768, device="cuda", generator=g) * 8).to(E4M3)
            with torch._inductor.config.patch(force_disable_caches=True):
                out, codes = run_and_get_code(f, a)
            if m == 1536:
                code = "\n".join(codes)
                assert "fp8boost.scaled_mm.default" in code and "_gemm_tma_kernel" not in code
            assert torch.equal(out, gemm.mm(a, b, sa, sb, None, torch.bfloat16, True,
                                            allow_cublas=True))

    @pytest.mark.parametrize("fast", [True, False], ids=["fast", "promoted"])
    def test_compiled_gemm_is_dispatched_at_trace_time(self, fast, monkeypatch, tmp_path):
        """Under torch.compile the GEMM's kernel is chosen at trace time (tuned there, on
        stand-in operands): where cuBLAS won, the generated code calls aten._scaled_mm; where
        the Triton kernel won, inductor launches that kernel itself. No fp8boost op either
        way; both bit-identical to the eager call."""
        from torch._inductor.utils import run_and_get_code

        from fp8boost.fp8.kernels import gemm, tuning
        from fp8boost.fp8.kernels.backend import TritonBackend

        tuning.set_autotune(True)  # the trace-time tuning on stand-ins is under test
        # An empty decisions directory: a decision an earlier run stored on this machine would
        # be loaded instead of timed (the GPU suite ran it twice on one warm machine).
        monkeypatch.setenv("FP8BOOST_CACHE_DIR", str(tmp_path))
        be = TritonBackend(allow_cublas=True)
        g = torch.Generator(device="cuda").manual_seed(9)
        m, n, k = 1536, 1024, 768
        a = (torch.randn(m, k, device="cuda", generator=g) * 8).to(E4M3 if fast else E5M2)
        b = torch.randn(n, k, device="cuda", generator=g).to(E4M3)
        sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")
        key, cands = gemm.candidates(a, b, None, torch.bfloat16, fast, True, True)
        gemm._CACHE.best.pop(key, None)

        def f(a, b, sa, sb):
            return be.mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)

        def compiled_code():  # the generated code's calls, without its comments
            torch._dynamo.reset()
            # The decision is not in dynamo's graph (scaled_mm_direct's arguments), so a cached
            # AOT/FX artifact of an earlier trace would bring that trace's choice back.
            with torch._inductor.config.patch(force_disable_caches=True):
                out, codes = run_and_get_code(torch.compile(f, fullgraph=True), a, b, sa, sb)
            return out, "\n".join(ln for c in codes for ln in c.splitlines()
                                  if not ln.strip().startswith("#"))

        out, code = compiled_code()
        chosen = gemm._CACHE.best[key]  # decided while tracing, on stand-ins
        assert chosen in cands and key in gemm._CACHE.timings
        # Triton won: inductor launches the kernel itself (dynamo traced the launch); cuBLAS
        # won: aten._scaled_mm. Never the run-time dispatching op.
        assert "scaled_mm_direct" not in code and "fp8boost.scaled_mm" not in code
        assert ("_gemm_tma_kernel" in code) == (chosen != gemm.CUBLAS)
        assert ("extern_kernels._scaled_mm(" in code) == (chosen == gemm.CUBLAS)
        assert torch.equal(out, gemm.launcher(a, b, sa, sb, None, torch.bfloat16, fast,
                                              True)(chosen))
        # The other branch, forced through the cache: cuBLAS <-> the Triton kernel.
        other = cands[0] if chosen == gemm.CUBLAS else gemm.CUBLAS
        gemm._CACHE.best[key] = other
        try:
            out2, code2 = compiled_code()
            assert "fp8boost.scaled_mm" not in code2
            assert ("_gemm_tma_kernel" in code2) == (other != gemm.CUBLAS)
            assert ("extern_kernels._scaled_mm(" in code2) == (other == gemm.CUBLAS)
            assert torch.equal(out2, gemm.launcher(a, b, sa, sb, None, torch.bfloat16, fast,
                                                   True)(other))
        finally:
            gemm._CACHE.best[key] = chosen
