"""Triton casts of the FP8 expert GEMMs (``fp8boost.fp8.kernels.moe_cast``) against the torch
reference (``fp8boost.fp8.moe.quantize``).

CPU (CI): the kernels run in Triton's interpreter in a child process (``tests/fp8/
interp_child.py``), on a real routing layout with uneven experts, an empty expert, padding and
tail rows holding garbage (random values and a NaN: they must get zero bytes and join no
amax), outliers x1000 and a NaN in an expert's row, bfloat16/float32/float16 inputs, e4m3/e5m2,
margins and power-of-2 scales. Bytes and scales must be identical (NaN compared as NaN).

GPU (``@pytest.mark.gpu``): the eager CUDA path that ``backend="scaled_grouped_mm"`` takes equals
the torch reference at Qwen3-30B-A3B / Mixtral shapes, with a timing print.
"""
from __future__ import annotations

import time

import pytest
import torch

from fp8boost.fp8.moe import quantize as Q
from fp8boost.fp8.moe.routing import route
from tests.fp8.interp_child import IN_CHILD, run_interpreter_suite

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (fp8 dtype, margin, power_of_2)
SCALINGS = [(E4M3, 0, False), (E5M2, 0, True), (E4M3, 2, True)]
GPU_BACKEND = "scaled_grouped_mm"


def _canon(q: torch.Tensor) -> torch.Tensor:
    u = q.view(torch.uint8).clone()
    u[q.float().isnan()] = 0x7F
    return u


def assert_same(got, ref, what: str) -> None:
    """Identical shapes, FP8 bytes (NaN as NaN) and FP32 scales (bit patterns, NaN as NaN)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, ref.shape)
    assert got.is_contiguous(), what
    got, ref = got.cpu(), ref.cpu()
    if ref.dtype == torch.float32:
        assert torch.equal(got.isnan(), ref.isnan()), f"{what}: NaN scales differ"
        a, b = got.nan_to_num(0.0), ref.nan_to_num(0.0)
        bad = (a.view(torch.int32) != b.view(torch.int32)).nonzero()
    else:
        bad = (_canon(got) != _canon(ref)).nonzero()
    assert bad.shape[0] == 0, f"{what}: {bad.shape[0]} differ, first at {bad[:4].tolist()}"


def routed_input(tokens: int, k: int, e: int, c: int, xdtype=torch.bfloat16, seed: int = 0,
                 device="cpu"):
    """Routing with uneven experts (expert 1 empty) and ``x [rows, C]``: real rows random
    (x3) with an outlier x1000 and a NaN; padding/tail rows garbage (random, one NaN)."""
    g = torch.Generator(device=device).manual_seed(seed)
    probs = torch.tensor([4.0, 0.0] + [1.0 + i for i in range(e - 2)], device=device)
    ids = torch.multinomial(probs.expand(tokens, e), k, generator=g)
    r = route(ids, e)
    x = torch.randn(r.rows, c, generator=g, device=device) * 3
    real = r.pos
    x[real[1], c // 3] *= 1000
    x[real[5], 2] = float("nan")
    pad = (r.group == e).nonzero().flatten()
    x[pad[len(pad) // 2], c // 2] = float("nan")  # garbage must not leak into any amax
    return r, x.to(xdtype)


def expert_weights(e: int, n: int, k: int, xdtype=torch.bfloat16, seed: int = 1, nan=True,
                   device="cpu") -> torch.Tensor:
    """``[E, N, K]`` weights (std 0.02) with an outlier, a zero expert row and column, a NaN."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(e, n, k, generator=g, device=device) * 0.02
    w[0, n // 2, k // 3] = 30.0
    w[e - 1, 1] = 0
    w[1, :, 3] = 0
    if nan:
        w[e - 1, n - 1, k - 2] = float("nan")
    return w.to(xdtype)


def test_interpreter_suite():
    """Runs ``TestInterpreter`` below in a fresh process with ``TRITON_INTERPRET=1``."""
    run_interpreter_suite(__file__)


@pytest.fixture(scope="class")
def mc():
    """The kernel module, imported with the interpreter on (child process only)."""
    if not IN_CHILD:
        pytest.skip("runs in a child process (see test_interpreter_suite)")
    from fp8boost.fp8.kernels import moe_cast

    return moe_cast


def _check_groups(mc, r, x, dtype, margin, p2, what):
    """Both kernel layouts (tiled: no offsets; segmented: the routing's offsets) against the
    reference, bit for bit; returns the segmented ``(data_t, inv_t)``."""
    so = Q.ScaleOptions(dtype, dtype, margin, p2)
    kw = dict(margin=margin, power_of_2=p2)
    assert mc.supports(x, dtype, group=r.group, **kw)
    ref_t, ref_it = Q.quantize_groups_t(x, r.group, r.num_experts, dtype, so)
    ref, ref_i = Q.quantize_tokens(x, dtype, so)
    for offsets in (None, r.offsets):
        how = "tiled" if offsets is None else "segmented"
        (data, inv), (data_t, inv_t) = mc.quantize_groups_t(
            x, r.group, r.num_experts, dtype, rows=True, offsets=offsets, **kw)
        for got, want, side in ((data_t, ref_t, "data_t"), (inv_t, ref_it, "inv_t"),
                                (data, ref, "rows"), (inv, ref_i, "rows inv")):
            assert_same(got, want, f"{what} {how} {side} {dtype} margin={margin} p2={p2}")
        _, (alone_t, alone_it) = mc.quantize_groups_t(x, r.group, r.num_experts, dtype,
                                                      offsets=offsets, **kw)
        assert torch.equal(_canon(alone_t), _canon(data_t)), (what, how)
    return data_t, inv_t


@pytest.mark.usefixtures("mc")
class TestInterpreter:
    @pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32, torch.float16])
    def test_groups_t_bit_exact(self, mc, xdtype):
        r, x = routed_input(40, 2, 5, 72, xdtype)
        e = r.num_experts
        for dtype, margin, p2 in SCALINGS:
            data_t, inv_t = _check_groups(mc, r, x, dtype, margin, p2, str(xdtype))
        nan = data_t.float().isnan()
        pad = r.group == e
        assert (data_t.view(torch.uint8)[:, pad] == 0).all()  # garbage rows: zero bytes
        assert (inv_t[1] == 1).all()  # the empty expert: amax 0, scale 1
        # The real NaN poisons its (expert, column) and nothing else; the padding NaN nothing.
        g5 = r.group[r.pos[5]]
        assert nan[2, r.group == g5].all() and nan.sum() == (r.group == g5).sum()
        assert inv_t.isnan().sum() == 1 and inv_t[g5, 2].isnan()

    def test_groups_t_unsorted_and_invalid_groups(self, mc):
        # The kernels never rely on sorted rows for correctness (only for speed).
        r, x = routed_input(24, 2, 4, 40, seed=3)
        perm = torch.randperm(r.rows, generator=torch.Generator().manual_seed(0))
        x, group = x[perm].contiguous(), r.group[perm].contiguous()
        so = Q.ScaleOptions()
        _, (data_t, inv_t) = mc.quantize_groups_t(x, group, 4, E4M3)
        ref_t, ref_it = Q.quantize_groups_t(x, group, 4, E4M3, so)
        assert_same(data_t, ref_t, "unsorted")
        assert_same(inv_t, ref_it, "unsorted inv")
        # A single row block spanning several experts and no-group rows, and a strided input.
        xs = torch.randn(40, 24, generator=torch.Generator().manual_seed(1)).t()  # [24, 40]
        gs = torch.tensor([0] * 5 + [3] * 7 + [2] * 1 + [4] * 3 + [1] * 8)
        _, (data_t, inv_t) = mc.quantize_groups_t(xs, gs, 4, E5M2, power_of_2=True)
        ref_t, ref_it = Q.quantize_groups_t(xs, gs, 4, E5M2, Q.ScaleOptions(E5M2, E5M2, 0, True))
        assert_same(data_t, ref_t, "strided")
        assert_same(inv_t, ref_it, "strided inv")

    def test_groups_t_inf_and_extremes(self, mc):
        # float32: the interpreter flushes bfloat16 subnormals when widening (the GPU does not).
        r, x = routed_input(30, 2, 3, 40, torch.float32, seed=4)
        x[r.pos[0], 7] = float("inf")
        x[r.pos[2], 9] = 3e38  # reciprocal of this amax is subnormal
        x[r.group < 3, 11] = 0
        x[r.pos[4], 11] = 1e-40  # only nonzero of its (expert, column): scale clamps at max
        for dtype, margin, p2 in SCALINGS:
            _check_groups(mc, r, x, dtype, margin, p2, "extremes")

    @pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32, torch.float16])
    def test_experts_bit_exact(self, mc, xdtype):
        w = expert_weights(3, 48, 40, xdtype)  # N, K not multiples of the tiles
        for dtype, margin, p2 in SCALINGS:
            so = Q.ScaleOptions(dtype, dtype, margin, p2)
            kw = dict(margin=margin, power_of_2=p2)
            assert mc.supports(w, dtype, **kw)
            rq, cq = mc.quantize_experts(w, dtype, rows=True, cols=True, **kw)
            what = f"{xdtype} {dtype} margin={margin} p2={p2}"
            for got, tr in ((rq, False), (cq, True)):
                ref = Q.quantize_experts(w, so, transpose=tr)
                assert_same(got[0], ref[0], f"experts transpose={tr} {what}")
                assert_same(got[1], ref[1], f"experts inv transpose={tr} {what}")
            alone_r, _ = mc.quantize_experts(w, dtype, rows=True, cols=False, **kw)
            _, alone_c = mc.quantize_experts(w, dtype, rows=False, cols=True, **kw)
            assert torch.equal(_canon(alone_r[0]), _canon(rq[0]))
            assert torch.equal(_canon(alone_c[0]), _canon(cq[0]))
        # The NaN poisons its expert row (rows operand) and its (e, k) column (transposed).
        assert rq[0].float().isnan().sum() == 40 and rq[0][2, 47].float().isnan().all()
        assert cq[0].float().isnan().sum() == 48 and cq[0][2, 38].float().isnan().all()

    @pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32, torch.float16])
    def test_weight_transposed_column_maxima_then_one_pass_bit_exact(self, mc, xdtype):
        # W^T alone (dgrad's operand): the column-maxima pass, then the tiled transposed cast;
        # the reference's bytes and scales. N, K: partial tiles both ways; N = 200: the rows
        # split into several slices whose maxima meet by atomic max.
        from fp8boost.fp8.kernels import moe_weight_cast as mwc

        w2 = expert_weights(2, 200, 24, xdtype, seed=4, nan=False)
        assert_same(mwc.colmax(w2), w2.abs().amax(dim=1).float(), "colmax, many slices")
        w = expert_weights(3, 44, 40, xdtype)
        for dtype, margin, p2 in SCALINGS:
            so = Q.ScaleOptions(dtype, dtype, margin, p2)
            kw = dict(margin=margin, power_of_2=p2)
            what = f"{xdtype} {dtype} margin={margin} p2={p2}"
            for x in (w, w2):
                rq, (data_t, inv_t) = mc.quantize_experts(x, dtype, rows=False, cols=True, **kw)
                ref_t = Q.quantize_experts(x, so, transpose=True)
                assert rq is None
                assert_same(data_t, ref_t[0], f"transposed {what}")
                assert_same(inv_t, ref_t[1], f"transposed inv {what}")
        # The NaN poisons its (e, k) column.
        data_t, inv_t = mwc.transposed(w, E4M3)
        assert inv_t[2, 38].isnan() and data_t[2, 38].float().isnan().all()
        assert data_t.float().isnan().sum() == 44

    def test_quantize_dispatch_takes_the_kernels(self, mc):
        # The interpreter lets CPU tensors through fused_kernels: the public functions under
        # the GPU backend run the kernels and give the reference's bytes.
        r, x = routed_input(24, 2, 4, 40, seed=7)
        w = expert_weights(4, 32, 40, seed=8)
        so = Q.ScaleOptions(power_of_2=True)
        from fp8boost.fp8.kernels import moe_cast_ops

        assert Q.fused_kernels(x, GPU_BACKEND, "tokens", E4M3, so) is moe_cast_ops
        assert Q.fused_kernels(x, "emulated", "tokens", E4M3, so) is None
        calls = [lambda b: Q.quantize_tokens(x, E4M3, so, backend=b),
                 lambda b: Q.quantize_experts(w, so, backend=b),
                 lambda b: Q.quantize_experts(w, so, transpose=True, backend=b),
                 lambda b: Q.quantize_groups_t(x, r.group, 4, E4M3, so, backend=b),
                 lambda b: Q.quantize_groups_t(x, r.group, 4, E4M3, so, backend=b,
                                               offsets=r.offsets),
                 lambda b: sum(Q.quantize_tokens_and_groups_t(x, r.group, 4, E4M3, so,
                                                              backend=b), ()),
                 lambda b: sum(Q.quantize_tokens_and_groups_t(x, r.group, 4, E4M3, so,
                                                              backend=b, offsets=r.offsets),
                               ())]
        for i, fn in enumerate(calls):
            for got, ref in zip(fn(GPU_BACKEND), fn(None), strict=True):
                assert_same(got, ref, f"dispatch {i}")
        # Inputs the kernels refuse take the torch ops, with one log line saying why.
        so7 = Q.ScaleOptions(power_of_2=True, margin=7)
        assert Q.fused_kernels(x, GPU_BACKEND, "tokens", E4M3, so7) is None
        from fp8boost import _state

        assert _state.was_logged("moe-cast-unsupported-tokens")
        for got, ref in zip(Q.quantize_groups_t(x, r.group, 4, E4M3, so7, backend=GPU_BACKEND),
                            Q.quantize_groups_t(x, r.group, 4, E4M3, so7)):
            assert_same(got, ref, "refused")

    def test_compiled_experts_call_the_cast_ops(self, mc, monkeypatch):
        """Compiled FP8 experts on the GPU backend's code path (fullgraph) call the Triton
        casts as ops, forward and backward, and give eager's bits (aot_eager: no codegen)."""
        import copy
        import dataclasses

        from fp8boost.fp8.moe import fp8_experts
        from tests.fp8 import test_moe_compile as tmc  # CPU kernels of the GEMM ops

        calls = _count_kernel_calls(monkeypatch)
        experts = fp8_experts(tmc._fp8_model("qwen3_moe"))[0].bfloat16()
        device, opts = experts._grouped_options
        experts._grouped_options = (device, dataclasses.replace(opts, backend=GPU_BACKEND))
        ref = copy.deepcopy(experts)
        torch._dynamo.reset()
        compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
        for step in range(2):
            x, idx, w = tmc._expert_inputs(step, 32)
            xs = [x.bfloat16().requires_grad_() for _ in range(2)]
            before = sum(calls.values())
            y = compiled(xs[0], idx, w.bfloat16())
            y.backward(torch.ones_like(y))
            # fprop: x (+ x^T) and W; backward: dy (+ dy^T) and W^T, per projection
            assert sum(calls.values()) - before == 8, calls
            y_ref = ref(xs[1], idx, w.bfloat16())
            y_ref.backward(torch.ones_like(y_ref))
            assert torch.equal(y, y_ref) and torch.equal(xs[0].grad, xs[1].grad), step
            for p, q in zip(experts.parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad) and q.grad.abs().max() > 0, step
                p.grad = q.grad = None
        torch._dynamo.reset()

    def test_experts_tile_spanning_experts(self, mc):
        # N = 20 < BLOCK_R: one row tile of the [E*N, K] view holds several experts.
        w = expert_weights(5, 20, 24, torch.float32, seed=2, nan=False)
        so = Q.ScaleOptions()
        _, cq = mc.quantize_experts(w, E4M3, rows=False, cols=True)
        ref = Q.quantize_experts(w, so, transpose=True)
        assert_same(cq[0], ref[0], "spanning")
        assert_same(cq[1], ref[1], "spanning inv")

    @pytest.mark.parametrize("per_sm", [1, 64])
    def test_segmented_row_slices(self, mc, per_sm, monkeypatch):
        # Many programs per SM split each segment's rows into slices whose column maxima meet
        # by atomic max: the same bytes as one program per segment (and as the reference).
        from fp8boost.fp8.kernels import moe_seg_cast

        monkeypatch.setattr(moe_seg_cast, "_INTERP_SEG", (16, 32, 1, per_sm))
        r, x = routed_input(60, 2, 3, 40, seed=9)
        for dtype, margin, p2 in SCALINGS[:2]:
            _check_groups(mc, r, x, dtype, margin, p2, f"per_sm={per_sm}")
        w = expert_weights(3, 50, 40, seed=10)
        so = Q.ScaleOptions()
        _, cq = mc.quantize_experts(w, E4M3, rows=False, cols=True)
        ref = Q.quantize_experts(w, so, transpose=True)
        assert_same(cq[0], ref[0], f"experts per_sm={per_sm}")
        assert_same(cq[1], ref[1], f"experts inv per_sm={per_sm}")

    def test_segmented_offsets_checked(self, mc):
        r, x = routed_input(16, 2, 4, 32, seed=11)
        with pytest.raises(ValueError, match="end offsets"):
            mc.quantize_groups_t(x, r.group, 4, E4M3, offsets=r.offsets[:3])


def test_supports_and_dispatch_on_cpu():
    """CPU tensors, the emulated backend and no backend take the torch ops (same results as
    calling the reference), and :func:`supports` refuses what the kernels cannot take."""
    r, x = routed_input(16, 2, 4, 32, seed=5)
    so = Q.ScaleOptions()
    for backend in (GPU_BACKEND, "emulated", None):
        assert Q.fused_kernels(x, backend, "tokens", E4M3, so) is None  # CPU tensor
        got = Q.quantize_groups_t(x, r.group, 4, E4M3, so, backend=backend)
        ref = Q.quantize_groups_t(x, r.group, 4, E4M3, so)
        for g, w in zip(got, ref):
            assert_same(g, w, f"cpu dispatch {backend}")
    if IN_CHILD:
        return
    pytest.importorskip("triton")
    from fp8boost.fp8.kernels import moe_cast as mc

    assert not mc.supports(torch.randn(0, 8), E4M3)
    assert not mc.supports(torch.randn(2, 3, 4, 5), E4M3)
    assert not mc.supports(torch.ones(4, 4, dtype=torch.int32), E4M3)
    assert not mc.supports(x, E4M3)  # CPU without the interpreter
    with pytest.raises(ValueError, match="torch reference"):
        mc.quantize_groups_t(x, r.group, 4, E4M3)


def test_reference_zeroes_rows_of_no_group():
    """The reference's contract the kernels follow: padding/tail rows (any content, NaN too)
    give zero bytes and leave every expert's scale as if they were zero."""
    r, x = routed_input(16, 2, 4, 32, seed=6)
    so = Q.ScaleOptions()
    data_t, inv_t = Q.quantize_groups_t(x, r.group, 4, E4M3, so)
    clean = x.masked_fill((r.group == 4).view(-1, 1), 0)
    ref_t, ref_it = Q.quantize_groups_t(clean, r.group, 4, E4M3, so)
    assert (data_t.view(torch.uint8)[:, r.group == 4] == 0).all()
    assert_same(data_t, ref_t, "padding")
    assert_same(inv_t, ref_it, "padding inv")


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------
def _median_ms(fn, n=10):
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[n // 2]


def _count_kernel_calls(monkeypatch) -> dict[str, int]:
    """Count calls into ``moe_cast``'s public casts (looked up on the module object that
    :func:`Q.fused_kernels` returns, so wrapping them there counts without changing what runs)."""
    from fp8boost.fp8.kernels import moe_cast as mc

    calls = {"quantize_rows": 0, "quantize_experts": 0, "quantize_groups_t": 0}
    depth = [0]  # outermost calls only: one cast may call another of the three inside

    def counting(name):
        fn = getattr(mc, name)

        def wrapper(*args, **kwargs):
            calls[name] += depth[0] == 0
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    for name in calls:
        monkeypatch.setattr(mc, name, counting(name))
    return calls


# (name, E, top-k, hidden, expert width, tokens)
GPU_SHAPES = [("qwen3_30b_a3b", 128, 8, 2048, 768, 4096), ("mixtral_8x7b", 8, 2, 4096, 14336, 4096)]


def _check_shape(e: int, k: int, h: int, i: int, t: int) -> tuple[int, int, int, int, int]:
    """The bit-exactness sweep's size for a model shape: its expert count and top-k (the
    segmentation the kernels must get right), a quarter of its tokens, widths cut to at most
    1024 / 2048 (many tiles each way still). The full shape is timed, in BF16 only: the sweep
    at full size spent over a minute per shape in the torch reference."""
    return e, k, min(h, 1024), min(i, 1024), t // 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: s[0])
def test_cuda_path_matches_reference(shape, monkeypatch):
    name, e_full, k_full, h_full, i_full, t_full = shape
    e, k, h, i, t = _check_shape(e_full, k_full, h_full, i_full, t_full)
    assert Q.fused_path_problem(torch.device("cuda")) is None
    calls = _count_kernel_calls(monkeypatch)
    for xdtype in (torch.bfloat16, torch.float32):
        r, x = routed_input(t, k, e, h, xdtype, device="cuda")
        w = expert_weights(e, 2 * i, h, xdtype, device="cuda")
        for dtype, margin, p2 in SCALINGS:
            so = Q.ScaleOptions(dtype, dtype, margin, p2)
            what = f"{name} {xdtype} {dtype} margin={margin} p2={p2}"
            pairs = [(lambda b: Q.quantize_tokens(x, dtype, so, backend=b), "tokens"),
                     (lambda b: Q.quantize_groups_t(x, r.group, e, dtype, so, backend=b),
                      "groups_t"),
                     (lambda b: Q.quantize_groups_t(x, r.group, e, dtype, so, backend=b,
                                                    offsets=r.offsets), "groups_t segmented"),
                     (lambda b: Q.quantize_experts(w, so, backend=b), "experts"),
                     (lambda b: Q.quantize_experts(w, so, transpose=True, backend=b),
                      "experts^T")]
            for fn, side in pairs:
                before = sum(calls.values())
                for got, ref in zip(fn(GPU_BACKEND), fn(None)):
                    assert_same(got, ref, f"{what} {side}")
                # The path taken, not only the numbers: one kernel call under the GPU backend,
                # none for the reference (backend=None).
                assert sum(calls.values()) == before + 1, (what, side, calls)
            for offsets in (None, r.offsets):
                both = Q.quantize_tokens_and_groups_t(x, r.group, e, dtype, so,
                                                      backend=GPU_BACKEND, offsets=offsets)
                for got, ref in zip(both[0] + both[1], pairs[0][0](None) + pairs[1][0](None)):
                    assert_same(got, ref, f"{what} tokens+groups_t offsets={offsets is not None}")
    e, k, h, i, t = e_full, k_full, h_full, i_full, t_full
    r, x = routed_input(t, k, e, h, device="cuda")
    w = expert_weights(e, 2 * i, h, device="cuda")
    so = Q.ScaleOptions(power_of_2=True)
    timed = {"tokens": lambda b: Q.quantize_tokens(x, E4M3, so, backend=b),
             "groups_t": lambda b: Q.quantize_groups_t(x, r.group, e, E4M3, so, backend=b),
             "experts": lambda b: Q.quantize_experts(w, so, backend=b),
             "experts^T": lambda b: Q.quantize_experts(w, so, transpose=True, backend=b),
             "groups_t segmented": lambda b: Q.quantize_groups_t(x, r.group, e, E4M3, so,
                                                                  backend=b, offsets=r.offsets),
             "tokens+groups_t": lambda b: Q.quantize_tokens_and_groups_t(x, r.group, e, E4M3, so,
                                                                         backend=b),
             "tokens+groups_t segmented": lambda b: Q.quantize_tokens_and_groups_t(
                 x, r.group, e, E4M3, so, backend=b, offsets=r.offsets)}
    for side, fn in timed.items():
        t_ref = _median_ms(lambda: fn(None))
        t_tri = _median_ms(lambda: fn(GPU_BACKEND))
        print(f"{name} T={t} {side}: torch {t_ref:.3f} ms, triton {t_tri:.3f} ms "
              f"({t_ref / t_tri:.1f}x)")
