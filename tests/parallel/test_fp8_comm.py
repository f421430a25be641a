"""FP8 collectives vs the exact FP32 collectives on gloo (2 and 4 CPU ranks).

Error bound (stated once, used by every check). With a power-of-two scale s derived from the
chunk's amax A (so fp8_max / (2A) < s <= fp8_max / A), one FP8 round trip of x errs by at most

    u * |x| + h / s  <=  u * |x| + h * 2A / fp8_max

u = 2**-4 for e4m3 (3 mantissa bits), 2**-3 for e5m2 (2 bits): round-to-nearest of a normal
number; h = half the subnormal spacing (2**-10 e4m3, 2**-17 e5m2): absolute error of values
that fall below the smallest normal. A sum over ranks adds one such term per quantized addend
(the receiver's own chunk is exact), plus FP32 accumulation (2**-24 per term) and one rounding
to the output dtype (2**-8 BF16, 2**-11 FP16, 2**-24 FP32). all_reduce adds one more FP8
round trip of the reduced value. Every check also asserts the error is non-zero, i.e. the data
really went through FP8.
"""
import logging
import os

import pytest
import torch

from fp8boost._state import was_logged
import torch.distributed as dist

from tests.dist_utils import run_distributed

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U = {E4M3: 2.0**-4, E5M2: 2.0**-3}
H = {E4M3: 2.0**-10, E5M2: 2.0**-17}
FMAX = {E4M3: 448.0, E5M2: 57344.0}
OUT_U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def qbound(x: torch.Tensor, dt) -> torch.Tensor:
    """Max error of one FP8 round trip of chunk ``x`` scaled by its own amax (see docstring)."""
    x = x.double()
    amax = x.abs().max() if x.numel() else torch.zeros((), dtype=torch.float64)
    return U[dt] * x.abs() + H[dt] * 2 * amax / FMAX[dt]


def make(rank: int, shape, dtype, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input, reproducible on every rank: magnitudes differ per rank and row."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(shape, generator=g) * (4.0 ** (rank - 1))
    flat = x.view(-1)
    flat[::7] *= 1e-4  # some values deep in the FP8 subnormal range
    if flat.numel() > 3:
        flat[3] = 50.0 * (rank + 1)  # an outlier sets the scale
    return x.to(dtype)


def check(err: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    worst = (err - bound).max().item() if err.numel() else 0.0
    assert worst <= 0.0, f"{what}: error exceeds the FP8 bound by {worst:.3g}"
    assert err.numel() == 0 or err.max().item() > 0.0, f"{what}: exact result, FP8 unused?"


# ----------------------------------------------------------------------------- per-op checks


def _check_all_gather(rank, ws, fc, cfg):
    for dtype in DTYPES:
        for mode in ("per_rank", "shared"):
            c = cfg.replace(all_gather_scale=mode)
            xs = [make(r, (6, 40), dtype, seed=1) for r in range(ws)]
            src = torch.stack([xs[rank], xs[rank]], -1)[..., 0]  # non-contiguous view of x
            out = fc.all_gather_fp8(src, config=c)
            assert out.dtype == dtype and out.shape == (6 * ws, 40)
            ref = torch.cat(xs).double()
            if mode == "shared":
                shared = ref.abs().max()
                bound = U[E4M3] * ref.abs() + H[E4M3] * 2 * shared / FMAX[E4M3]
            else:
                bound = torch.cat([qbound(x, E4M3) for x in xs])
            bound = bound + OUT_U[dtype] * ref.abs()
            check((out.double() - ref).abs(), bound, f"all_gather {dtype} {mode}")
            work = fc.all_gather_fp8(src, config=c, async_op=True)
            assert torch.equal(work.wait(), out) and work.is_completed()
    # all_gather_into_tensor into a different, non-contiguous output dtype; empty shards
    x = make(rank, (8,), torch.bfloat16, seed=2)
    out = torch.empty(8 * ws, 2, dtype=torch.float32)[:, 0]  # strided, other dtype
    fc.all_gather_into_tensor_fp8(out, x, config=cfg)
    ref = torch.cat([make(r, (8,), torch.bfloat16, seed=2) for r in range(ws)]).double()
    bound = torch.cat([qbound(make(r, (8,), torch.bfloat16, seed=2), E4M3) for r in range(ws)])
    check((out.reshape(-1).double() - ref).abs(), bound, "all_gather_into_tensor")
    assert fc.all_gather_fp8(torch.empty(0, 3), config=cfg).shape == (0, 3)


def _rs_bound(xs, rank, ws, dt, out_dtype, m, avg):
    """Bound on this rank's reduce-scatter chunk (its own chunk is exact)."""
    chunks = [x.reshape(ws, m)[rank].double() for x in xs]
    ref = sum(chunks)
    bound = sum(qbound(c, dt) for r, c in enumerate(chunks) if r != rank)
    bound = bound + ws * 2.0**-24 * sum(c.abs() for c in chunks)
    if avg:
        ref, bound = ref / ws, bound / ws
    return ref, bound + OUT_U[out_dtype] * (ref.abs() + bound)


def _check_reduce_scatter(rank, ws, fc, cfg):
    for dtype in DTYPES:
        for op in ("sum", "avg"):
            xs = [make(r, (4 * ws, 33), dtype, seed=3) for r in range(ws)]
            out = fc.reduce_scatter_fp8(xs[rank].t().contiguous().t(), op=op, config=cfg)
            assert out.dtype == dtype and out.shape == (4, 33)
            ref, bound = _rs_bound(xs, rank, ws, E5M2, dtype, 4 * 33, op == "avg")
            check((out.double().reshape(-1) - ref).abs(), bound, f"reduce_scatter {dtype} {op}")
            work = fc.reduce_scatter_fp8(xs[rank], op=op, config=cfg, async_op=True)
            assert torch.equal(work.wait(), out)
    # e4m3 wire, reduce_scatter_tensor with a flat uneven-shaped input and strided output
    xs = [make(r, (ws * 10 + 0,), torch.float32, seed=4) for r in range(ws)]
    out = torch.empty(20).view(10, 2)[:, 0]
    fc.reduce_scatter_tensor_fp8(out, xs[rank], op=dist.ReduceOp.AVG, fp8_dtype=E4M3, config=cfg)
    ref, bound = _rs_bound(xs, rank, ws, E4M3, torch.float32, 10, True)
    check((out.double() - ref).abs(), bound, "reduce_scatter_tensor e4m3")
    with pytest.raises(ValueError, match="divisible"):
        fc.reduce_scatter_fp8(torch.randn(ws + 1, 2), config=cfg)
    with pytest.raises(ValueError, match="op must be"):
        fc.reduce_scatter_fp8(torch.randn(ws, 2), op="max", config=cfg)


def _check_all_reduce(rank, ws, fc, cfg):
    for dtype in DTYPES:
        for shape in ((ws * 64,), (7, 143)):  # even, and numel not divisible by the world size
            xs = [make(r, shape, dtype, seed=5) for r in range(ws)]
            # 2-D: reduce transposed (non-contiguous) views; flat order is their logical order
            xs = [x.t() if x.dim() == 2 else x for x in xs]
            t = xs[rank].clone()  # clone keeps the transposed strides
            fc.all_reduce_fp8(t, op="avg", config=cfg)
            n = t.numel()
            m = -(-n // ws)
            padded = [torch.cat([x.reshape(-1).double(), torch.zeros(ws * m - n)]) for x in xs]
            ref = sum(padded) / ws
            bound = torch.zeros(ws * m, dtype=torch.float64)
            for k in range(ws):  # chunk k is reduced on rank k, then all-gathered
                sl = slice(k * m, (k + 1) * m)
                _, b1 = _rs_bound(padded, k, ws, E5M2, torch.float32, m, True)
                c_abs = ref[sl].abs() + b1
                bound[sl] = b1 + U[E5M2] * c_abs + H[E5M2] * 2 * c_abs.max() / FMAX[E5M2]
            bound = bound + OUT_U[dtype] * (ref.abs() + bound)
            err = (t.reshape(-1).double() - ref[:n]).abs()
            check(err, bound[:n], f"all_reduce {dtype} {shape}")
            gathered = [torch.empty_like(t) for _ in range(ws)]
            dist.all_gather(gathered, t.contiguous())
            assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks disagree"
            t2 = xs[rank].clone()
            work = fc.all_reduce_fp8(t2, op="avg", config=cfg, async_op=True)
            assert work.wait() is t2 and torch.equal(t2, t)


def _check_all_to_all(rank, ws, fc, cfg):
    # uneven splits, including empty chunks; split[i][j] = rows rank i sends to rank j
    split = [[(i + 2 * j) % 3 for j in range(ws)] for i in range(ws)]
    for dtype in DTYPES:
        xs = [make(i, (sum(split[i]), 3, 4), dtype, seed=6) for i in range(ws)]
        outs = [split[i][rank] for i in range(ws)]
        out = torch.empty(sum(outs), 3, 4, dtype=dtype)
        fc.all_to_all_fp8(out, xs[rank], outs, split[rank], config=cfg)
        ref_parts, bound_parts = [], []
        for i in range(ws):
            start = sum(split[i][:rank])
            part = xs[i][start:start + split[i][rank]].double()
            ref_parts.append(part)
            bound_parts.append(torch.zeros_like(part) if i == rank else qbound(part, E4M3))
        ref, bound = torch.cat(ref_parts), torch.cat(bound_parts)
        check((out.double() - ref).abs(), bound + OUT_U[dtype] * ref.abs(), f"all_to_all {dtype}")
        out2 = torch.empty_like(out)
        fc.all_to_all_fp8(out2, xs[rank], outs, split[rank], config=cfg, async_op=True).wait()
        assert torch.equal(out, out2)
    even_in = make(rank, (2 * ws, 5), torch.float32, seed=7)
    even_out = torch.empty(2 * ws, 5)
    fc.all_to_all_fp8(even_out, even_in, config=cfg)
    ref = torch.cat([make(i, (2 * ws, 5), torch.float32, seed=7)[2 * rank:2 * rank + 2]
                     for i in range(ws)]).double()
    assert (even_out.double() - ref).abs().max() > 0
    with pytest.raises(ValueError, match="split"):
        fc.all_to_all_fp8(even_out, even_in, [1] * ws, None, config=cfg)
    # No split sizes and dim 0 that does not divide (Colossal-AI's (1, 8, 16) on 4 ranks): the
    # flat even split of dist.all_to_all_single, bytes as it moves them (plain all-to-all as
    # the reference), into a non-contiguous output too, sync and async.
    odd = make(rank, (1, 2 * ws, 4), torch.bfloat16, seed=8)
    ref = torch.empty_like(odd)
    dist.all_to_all_single(ref, odd)
    for async_op in (False, True):
        for out in (torch.empty_like(odd), torch.empty(4, 2 * ws, 1, dtype=odd.dtype)
                    .transpose(0, 2)):
            work = fc.all_to_all_fp8(out, odd, config=cfg, async_op=async_op)
            if async_op:
                work.wait()
            mine = ref.view(ws, -1)[rank]  # the part a rank keeps travels in full precision
            assert torch.equal(out.reshape(ws, -1)[rank], mine)
            check((out.double() - ref.double()).abs(),
                  qbound(ref.double(), E4M3) + OUT_U[torch.bfloat16] * ref.double().abs(),
                  f"all_to_all flat async={async_op}")
    with pytest.raises(ValueError, match="numel"):
        fc.all_to_all_fp8(torch.empty(1, 3), torch.empty(1, 3), config=cfg)


def _check_p2p(rank, ws, fc, cfg):
    if ws % 2:
        return
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    for dtype in DTYPES:
        x = make(min(rank, peer), (9, 11), dtype, seed=8)
        for dt in (E4M3, E5M2):
            if rank % 2 == 0:
                fc.send_fp8(x, peer, fp8_dtype=dt, config=cfg)
                fc.isend_fp8(x.t(), peer, fp8_dtype=dt, config=cfg).wait()
            else:
                got = fc.recv_fp8(torch.empty(9, 11, dtype=dtype), peer, fp8_dtype=dt, config=cfg)
                check((got.double() - x.double()).abs(),
                      qbound(x, dt) + OUT_U[dtype] * x.double().abs(), f"send/recv {dtype}")
                buf = torch.empty(22, 9, dtype=dtype)[::2]  # non-contiguous destination
                work = fc.irecv_fp8(buf, peer, fp8_dtype=dt, config=cfg)
                assert work.wait() is buf
                check((buf.double() - x.t().double()).abs(),
                      qbound(x, dt).t() + OUT_U[dtype] * x.t().double().abs(), "irecv")


def _check_fallbacks_and_errors(rank, ws, fc, cfg):
    from fp8boost.parallel.comm.config import Fp8CommConfig
    x = make(rank, (4, 8), torch.bfloat16, seed=9)
    big = Fp8CommConfig(min_payload_numel=10**9)
    exact = torch.cat([make(r, (4, 8), torch.bfloat16, seed=9) for r in range(ws)])
    assert torch.equal(fc.all_gather_fp8(x, config=big), exact)  # plain collective: exact
    assert was_logged(("fp8_comm", "all_gather", "small"))
    assert torch.equal(fc.all_gather_fp8(x, config=cfg.replace(enabled=False)), exact)
    ints = torch.arange(6, dtype=torch.int32) + rank
    fc.all_reduce_fp8(ints, config=cfg)
    assert torch.equal(ints, torch.arange(6, dtype=torch.int32) * ws + sum(range(ws)))
    with pytest.raises(TypeError, match="already"):
        fc.all_gather_fp8(x.to(E4M3), config=cfg)
    with pytest.raises(TypeError, match="Fp8CommConfig"):
        fc.all_gather_fp8(x, config={"min_numel": 0})
    with pytest.raises(ValueError, match="fp8_dtype"):
        fc.all_gather_fp8(x, fp8_dtype=torch.bfloat16, config=cfg)
    with pytest.raises(ValueError, match="world_size"):
        fc.all_gather_into_tensor_fp8(torch.empty(3), x, config=cfg)
    # world size 1 (a subgroup per rank): exact local math, no communication
    solo, _ = dist.new_subgroups(group_size=1)
    y = x.float()
    assert torch.equal(fc.all_gather_fp8(y, solo, config=cfg), y)
    assert torch.equal(fc.reduce_scatter_fp8(y, solo, op="avg", config=cfg), y)
    z = y.clone()
    fc.all_reduce_fp8(z, solo, op="sum", config=cfg)
    assert torch.equal(z, y) and was_logged(("fp8_comm", "all_reduce", "ws1"))


def _check_wire_bytes(rank, ws, fc, cfg):
    """Record every payload collective: FP8 data crosses as uint8, ~1 byte per element."""
    log = []
    names = ("all_to_all_single", "all_gather_single", "all_gather_into_tensor", "send",
             "isend", "recv", "irecv", "all_reduce", "reduce_scatter_single",
             "reduce_scatter_tensor")
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def spy(name, orig):
        def wrapped(*args, **kwargs):
            t = args[1] if name.startswith(("all_to_all", "all_gather", "reduce_scatter")) \
                else args[0]
            log.append((name, t.dtype, t.numel()))
            return orig(*args, **kwargs)
        return wrapped

    try:
        for n, f in saved.items():
            setattr(dist, n, spy(n, f))
        n_el = 4096 * ws
        x = make(rank, (n_el,), torch.float32, seed=10)
        fc.all_gather_fp8(x[:4096], config=cfg)
        fc.reduce_scatter_fp8(x, config=cfg)
        fc.all_reduce_fp8(x.clone(), config=cfg)
        fc.all_to_all_fp8(torch.empty_like(x), x, config=cfg)
        if ws % 2 == 0:
            if rank % 2 == 0:
                fc.send_fp8(x, rank + 1, config=cfg)
            else:
                fc.recv_fp8(torch.empty_like(x), rank - 1, config=cfg)
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    assert log and all(dt == torch.uint8 for _, dt, _ in log), log
    seg = 4096 + 16  # 4096 FP8 bytes + the 16-byte scale trailer
    expected = [("all_gather", seg), ("all_to_all", (ws - 1) * seg),   # all_gather, rs
                ("all_to_all", (ws - 1) * seg), ("all_gather", seg),  # all_reduce
                ("all_to_all", (ws - 1) * seg)]                       # all_to_all
    if ws % 2 == 0:
        expected.append(("send" if rank % 2 == 0 else "recv", n_el + 16))
    got = [(name.split("_single")[0].replace("_into_tensor", ""), k) for name, _, k in log]
    assert got == expected, (got, expected)
    payload = sum(k for _, k in expected)
    elements = 4096 + 3 * (ws - 1) * 4096 + 4096 + (n_el if ws % 2 == 0 else 0)
    assert payload <= elements * 1.01, "more than ~1 byte per element on the wire"


def _worker(rank, ws, with_extras):
    from fp8boost.parallel.comm import collectives as fc
    from fp8boost.parallel.comm.config import Fp8CommConfig
    cfg = Fp8CommConfig(min_payload_numel=0, cast_impl="torch")
    # pipeline_bytes=64: these small payloads run in 2-4 stages, each with its own scales
    for c in (cfg, cfg.replace(pipeline_bytes=64)):
        _check_all_gather(rank, ws, fc, c)
        _check_reduce_scatter(rank, ws, fc, c)
        _check_all_reduce(rank, ws, fc, c)
    _check_all_to_all(rank, ws, fc, cfg)
    _check_p2p(rank, ws, fc, cfg)
    _check_wire_bytes(rank, ws, fc, cfg)
    if with_extras:
        _check_fallbacks_and_errors(rank, ws, fc, cfg)
        _check_triton_interpreter(rank, ws, fc)
        _check_bench_smoke()
    return True


def _exact_fp8_values(rank, n, dt, seed):
    """Values an FP8 cast represents exactly (amax = fp8_max * 2**-3: scale 8, no rounding)."""
    g = torch.Generator().manual_seed(seed + rank)
    q = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dt).float()
    q = torch.where(torch.isfinite(q), q, torch.zeros_like(q))
    q[0] = FMAX[dt]
    return q / 8.0


def _check_triton_interpreter(rank, ws, fc):
    """The Triton casts (run by the interpreter) give the torch path's bytes on exact values."""
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported in this process
    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.parallel.comm._utils import triton_selftest
    ok, why = triton_selftest(torch.device("cpu"))  # runs every kernel; the interpreter's own
    assert isinstance(ok, bool) and (ok or why)      # FP8 rounding may fail the byte check
    tri = Fp8CommConfig(min_payload_numel=0, cast_impl="triton")
    ref = Fp8CommConfig(min_payload_numel=0, cast_impl="torch")
    for dt in (E4M3, E5M2):
        x = _exact_fp8_values(rank, 300, dt, seed=11)
        a = fc.all_gather_fp8(x, fp8_dtype=dt, config=tri)
        assert torch.equal(a, fc.all_gather_fp8(x, fp8_dtype=dt, config=ref)), "all_gather"
        xs = [_exact_fp8_values(r, 300 * ws, dt, seed=12) for r in range(ws)]
        b = fc.reduce_scatter_fp8(xs[rank], op="avg", fp8_dtype=dt, config=tri)
        c = fc.reduce_scatter_fp8(xs[rank], op="avg", fp8_dtype=dt, config=ref)
        assert torch.allclose(b, c, rtol=2.0**-22, atol=0.0), "reduce_scatter"
        # (all_reduce re-quantizes sums, which need rounding: not comparable under the
        # interpreter.) all_to_all exercises the per-chunk cast and decode with strided rows.
        o1, o2 = torch.empty(300 * ws), torch.empty(300 * ws)
        fc.all_to_all_fp8(o1, xs[rank], fp8_dtype=dt, config=tri)
        fc.all_to_all_fp8(o2, xs[rank], fp8_dtype=dt, config=ref)
        assert torch.equal(o1, o2), "all_to_all"
    _check_fused_row_quantize(fc, tri)


def _check_fused_row_quantize(fc, tri):
    """Triton impl, one stage: each quantize is ``wire_triton.quantize_rows`` (2 launches: row
    amax partials, then scale + cast + trailer), with no separate scale math; its bytes,
    trailers included, equal the torch path's (exact values, an all-zero row, pow2 or not)."""
    from fp8boost.parallel.comm import pipeline, wire, wire_triton

    for dt in (E4M3, E5M2):
        x = torch.stack([_exact_fp8_values(r, 5000, dt, seed=13) for r in range(3)])
        x[1] *= 0.5
        x[2] = 0.0
        for pow2 in (True, False):
            a = torch.zeros(3, wire.segment_bytes(5000) + 8, dtype=torch.uint8)
            b = a.clone()
            wire.quantize_rows(x, a, dt, power_of_2=pow2, impl="triton")
            wire.quantize_rows(x, b, dt, power_of_2=pow2, impl="torch")
            assert torch.equal(a, b), (dt, pow2)
    calls = []
    real_q, real_s = wire_triton.quantize_rows, pipeline.stage_scales

    def count(*a, **k):
        calls.append(a[0].shape)
        return real_q(*a, **k)

    def no_scale_math(*a, **k):
        raise AssertionError("separate scale math on the fused path")

    wire_triton.quantize_rows, pipeline.stage_scales = count, no_scale_math
    try:
        ws = dist.get_world_size()
        fc.all_gather_fp8(_exact_fp8_values(0, 300, E4M3, 3), config=tri)
        assert len(calls) == 1, calls  # the shard: one fused quantize
        fc.reduce_scatter_fp8(_exact_fp8_values(0, 300 * ws, E5M2, 4), config=tri)
        assert 2 <= len(calls) <= 3, calls  # the other ranks' chunks: rows before/after own
    finally:
        wire_triton.quantize_rows, pipeline.stage_scales = real_q, real_s


def _check_bench_smoke():
    import importlib.util
    import tempfile
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                        "bench", "comm.py")
    spec = importlib.util.spec_from_file_location("bench_comm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        report = mod.main(["--backend", "gloo", "--device", "cpu", "--min-mb", "0.0625",
                           "--max-mb", "0.125", "--warmup", "1", "--iters", "2", "--out", out])
        if dist.get_rank() == 0:
            assert os.path.exists(out)
    assert not [r for r in report["results"] if "error" in r], report["results"]
    assert {r["op"] for r in report["results"]} >= {"all_gather", "reduce_scatter",
                                                     "all_reduce", "all_to_all"}


def test_fp8_collectives_2_ranks():
    assert run_distributed(_worker, 2, True) == [True, True]


def test_fp8_collectives_4_ranks():
    assert run_distributed(_worker, 4, False) == [True] * 4


def test_fallback_logging_names_the_reason(caplog):
    """The once-only fallback message is emitted through logging, naming the reason."""
    from fp8boost.parallel.comm import _utils as fc
    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost import _state
    _state.forget_logged(("fp8_comm", "unit", "small"))
    with caplog.at_level(logging.WARNING, logger="fp8boost.parallel.fp8_comm"):
        cfg = Fp8CommConfig(min_payload_numel=10)
        plan = fc.plan_collective("unit", (torch.zeros(3),), 3, 2, cfg)
        fc.plan_collective("unit", (torch.zeros(3),), 3, 2, cfg)
    assert plan == "plain"
    msgs = [r.getMessage() for r in caplog.records if "unit" in r.getMessage()]
    assert len(msgs) == 1 and "min_payload_numel" in msgs[0]
