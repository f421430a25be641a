"""Triton rowwise/blockwise casts (``fp8boost.fp8.kernels.granular_cast``) against the torch
reference (``fp8boost.fp8.granular.quantize``).

CPU (CI): the kernels run in Triton's interpreter in a child process (as in
``test_triton_kernels.py``: the interpreter must be on before triton is imported), at shapes
with full and partial tiles, outliers x1000, zero tiles/rows/columns and a NaN. Bytes and
scales must be identical; NaN bytes and NaN scales are compared as "NaN" (their sign bit comes
from whichever NaN the hardware propagated, which the reference itself does not fix).

GPU (``@pytest.mark.gpu``): the CUDA path that ``quantize_operands(..., backend="triton")``
takes equals the reference, with a timing print.
"""
from __future__ import annotations

import time

import pytest
import torch

from fp8boost.fp8.granular import quantize as Q
from tests.fp8.interp_child import IN_CHILD, run_interpreter_suite

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_CHILD = IN_CHILD
# (recipe, weight, rows, cols): every layout quantize_operands makes.
LAYOUTS = [("blockwise", False, True, True), ("blockwise", True, True, True),
           ("rowwise", False, True, False), ("rowwise", False, True, True),
           ("rowwise", False, False, True)]
SHAPES = [(128, 256), (200, 300), (7, 130)]
# (fp8 dtype, margin, power_of_2)
SCALINGS = [(E4M3, 0, False), (E5M2, 0, True), (E4M3, 2, True)]


def _canon(q: torch.Tensor) -> torch.Tensor:
    u = q.view(torch.uint8).clone()
    u[q.float().isnan()] = 0x7F
    return u


def assert_same(got, ref, what) -> None:
    """Two ``GranularFp8`` (or None) with identical layout, bytes and scales (NaN as NaN)."""
    if ref is None or got is None:
        assert got is None and ref is None, what
        return
    assert (got.kind, got.block) == (ref.kind, ref.block), what
    assert got.data.shape == ref.data.shape and got.data.dtype == ref.data.dtype, what
    assert got.inv_scale.shape == ref.inv_scale.shape, (what, got.inv_scale.shape)
    assert got.data.is_contiguous() and got.inv_scale.is_contiguous(), what
    a, b = _canon(got.data.cpu()), _canon(ref.data.cpu())
    bad = (a != b).nonzero()
    assert bad.shape[0] == 0, f"{what}: {bad.shape[0]} bytes differ, first at {bad[:4].tolist()}"
    sa, sb = got.inv_scale.cpu().clone(), ref.inv_scale.cpu().clone()
    assert torch.equal(sa.isnan(), sb.isnan()), what
    sa[sa.isnan()] = 0
    sb[sb.isnan()] = 0
    assert torch.equal(sa.view(torch.int32), sb.view(torch.int32)), f"{what}: scales differ"


def make_input(shape, xdtype=torch.bfloat16, seed=0, nan=True) -> torch.Tensor:
    """Random values with an outlier x1000, a zero tile, a zero row and column, and a NaN."""
    r, c = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=g) * 3
    x[r // 3, c // 4] *= 1000
    x[: min(r, 128), 128:256] = 0  # a whole zero tile/block where the shape has one
    x[r - 1] = 0
    x[:, c - 1] = 0
    if nan:
        x[r // 2, 3] = float("nan")
    return x.to(xdtype)


def test_interpreter_suite():
    """Runs ``TestInterpreter`` below in a fresh process with ``TRITON_INTERPRET=1``."""
    run_interpreter_suite(__file__)


@pytest.fixture(scope="class")
def gc():
    """The kernel module, imported with the interpreter on (child process only)."""
    if not _CHILD:
        pytest.skip("runs in a child process (see test_interpreter_suite)")
    from fp8boost.fp8.kernels import granular_cast

    return granular_cast


def _check(gc, x, dtype, layout, margin=0, power_of_2=False, what=""):
    recipe, weight, rows, cols = layout
    kw = dict(weight=weight, rows=rows, cols=cols, margin=margin, power_of_2=power_of_2)
    assert gc.supports(x, dtype, recipe, margin=margin, power_of_2=power_of_2)
    got = gc.quantize_operands(x, dtype, recipe, **kw)
    ref = Q.quantize_operands(x, dtype, recipe, **kw)
    for g, r, side in zip(got, ref, ("rows", "cols")):
        assert_same(g, r, f"{what} {layout} {side} {dtype} margin={margin} p2={power_of_2}")
    return got


@pytest.mark.usefixtures("gc")
class TestInterpreter:
    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
    @pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "-".join(map(str, l)))
    def test_bit_exact(self, gc, shape, layout):
        x = make_input(shape)
        for dtype, margin, p2 in SCALINGS:
            got = _check(gc, x, dtype, layout, margin, p2, what=str(shape))
        # The NaN poisons its own row / tile / block, and nothing else.
        r, c = shape
        recipe, weight = layout[:2]
        rows_q, cols_q = got
        if rows_q is not None:
            nan = rows_q.data.float().isnan()
            if recipe == "rowwise":
                assert nan[r // 2].all() and nan.sum() == c
            elif not weight:
                assert nan[r // 2, :128].all() and nan.sum() == min(c, 128)
            else:
                assert nan[:min(r, 128), :128].all() and nan.sum() == min(r, 128) * min(c, 128)
        if cols_q is not None and recipe != "blockwise":
            nan = cols_q.data.float().isnan()
            assert nan[3].all() and nan.sum() == r

    def test_one_sided_and_input_dtypes(self, gc):
        for xdtype in (torch.float32, torch.float16):
            x = make_input((200, 300), xdtype, seed=1)
            for weight in (False, True):
                for rows, cols in ((True, False), (False, True)):
                    _check(gc, x, E4M3, ("blockwise", weight, rows, cols), what=str(xdtype))
            _check(gc, x, E5M2, ("rowwise", False, True, True), what=str(xdtype))

    def test_strided_input_and_block_size(self, gc):
        x = make_input((130, 200), seed=2).t()  # a transposed view: strides (1, 200)
        for layout in LAYOUTS:
            _check(gc, x, E4M3, layout, what="strided")
        x = make_input((70, 90), seed=3, nan=False)
        for weight in (False, True):
            recipe_kw = dict(weight=weight, rows=True, cols=True, block=32)
            got = gc.quantize_operands(x, E4M3, "blockwise", **recipe_kw)
            ref = Q.quantize_operands(x, E4M3, "blockwise", **recipe_kw)
            for g, r in zip(got, ref):
                assert_same(g, r, f"block 32 weight={weight}")

    def test_rows_in_registers(self, gc):
        # The rows-only kernel's one-read path (BLOCK_C >= C): the GPU picks it for C <= 8192.
        for shape in ((200, 300), (7, 512)):
            x = make_input(shape, seed=6)
            for dtype, margin, p2 in SCALINGS:
                ref, _ = Q.quantize_operands(x, dtype, "rowwise", weight=False, margin=margin,
                                             power_of_2=p2)
                for cfg in ((4, 512, 1), (1, 512, 1)):
                    got = gc.rows_only(x, dtype, margin=margin, power_of_2=p2, config=cfg)
                    assert_same(got, ref, f"one pass {shape} {cfg} {dtype} {margin} {p2}")

    def test_rows_over_tiles(self, gc):
        # The wide-rows path (an amax pass, then a cast pass over tiles): partial tiles in both
        # directions, several column tiles per row (their atomic maxima meet), a NaN, strides.
        x = make_input((200, 300), seed=8)
        for xin in (x, x.t().contiguous().t()):
            for dtype, margin, p2 in SCALINGS:
                ref, _ = Q.quantize_operands(xin, dtype, "rowwise", weight=False,
                                             margin=margin, power_of_2=p2)
                for cfg in (("tiles", 32, 64, 1), ("tiles", 16, 128, 1)):
                    got = gc.rows_only(xin, dtype, margin=margin, power_of_2=p2, config=cfg)
                    assert_same(got, ref, f"tiles {cfg} {dtype} {margin} {p2}")
        from fp8boost.fp8.kernels.granular_configs import WIDE_ROWS_TILE_CONFIGS

        assert WIDE_ROWS_TILE_CONFIGS[0] in gc.rows_configs(128256)
        assert not any(cfg[0] == "tiles" for cfg in gc.rows_configs(4096))

    def test_colmax_split_and_row_blocks(self, gc):
        # Candidates given explicitly: rowwise rows cast with the column amaxes by persistent
        # programs (several row blocks a program; without rows, only the amaxes), then data^T;
        # blockwise activation tiles with data^T as two launches (re-read or register
        # transpose), and without data^T with fewer rows a program. float32 input (the
        # transposed re-read), a strided view, NaN rows and columns, partial tiles.
        x = make_input((70, 150), seed=9)
        for xin, scalings in ((x, SCALINGS[:2]), (x.float().t().contiguous().t(), SCALINGS[2:])):
            for dtype, margin, p2 in scalings:
                kw = dict(margin=margin, power_of_2=p2)
                what = f"{xin.dtype} {dtype} {margin} {p2}"
                ref = Q.quantize_operands(xin, dtype, "rowwise", weight=False, cols=True, **kw)
                for cfg in (("colmax", 2, 1, 2, 32, 64, 1), ("colmax", 1, 1, 1, 64, 32, 1)):
                    for rows in (True, False):
                        got = gc.quantize_operands(xin, dtype, "rowwise", weight=False,
                                                   rows=rows, cols=True, config=cfg, **kw)
                        assert (got[0] is None) == (not rows)
                        if rows:
                            assert_same(got[0], ref[0], f"{cfg} rows {what}")
                        assert_same(got[1], ref[1], f"{cfg} cols rows={rows} {what}")
                for rows in (True, False):
                    blk = dict(weight=False, rows=rows, cols=True, block=32)
                    ref = Q.quantize_operands(xin, dtype, "blockwise", **blk, **kw)
                    for cfg in (("split", 16, 1, 16, 1, True), ("split", 8, 1, 32, 1, False)):
                        got = gc.quantize_operands(xin, dtype, "blockwise", config=cfg, **blk,
                                                   **kw)
                        for g, r in zip(got, ref):
                            assert (g is None) == (r is None)
                            if r is not None:
                                assert_same(g, r, f"{cfg} rows={rows} {what}")
                ref, _ = Q.quantize_operands(xin, dtype, "blockwise", weight=False, block=64, **kw)
                got, _ = gc.quantize_operands(xin, dtype, "blockwise", weight=False, block=64,
                                              config=("rows", 16, 1), **kw)
                assert_same(got, ref, f"rows tiles {what}")
        assert ("split", 64, 8, 64, 4, True) in gc.tile_configs(128, False, True, True)
        assert not any(isinstance(c, tuple) for c in gc.tile_configs(128, True, True, True))
        assert gc.rows_cols_configs(4096)[-1][0] == "colmax"
        assert (1, 16384, 16) in gc.rows_configs(14336)
        assert not any(c[0] == "colmax" for c in gc.rows_cols_configs(20000))

    def test_inf_and_extremes(self, gc):
        # float32: the interpreter flushes bfloat16 subnormals to zero when widening them (the
        # GPU does not; test_cuda_path_matches_reference covers bfloat16 extremes).
        x = extremes_input(torch.float32)
        for layout in LAYOUTS:
            for dtype, margin, p2 in SCALINGS:
                _check(gc, x, dtype, layout, margin, p2, what="extremes")


def extremes_input(xdtype) -> torch.Tensor:
    """Inf, -Inf, an amax whose reciprocal is subnormal, a subnormal-only column and tile."""
    x = make_input((64, 160), torch.float32, nan=False, seed=4)
    x[5, 7] = float("inf")
    x[9, 140] = -float("inf")
    x[20, 20] = 3e38  # reciprocal of this amax is subnormal
    x[:, 150] = 0
    x[30, 150] = 1e-40  # the only nonzero of its column and tile: scale clamps at FP32 max
    return x.to(xdtype)


def test_supports_and_dispatch_on_cpu():
    """Without CUDA, and for inputs the kernels refuse, the torch reference answers."""
    x = torch.randn(8, 16)
    assert Q.fused_kernels(x, "triton") is None  # CPU tensor
    assert Q.fused_kernels(x, "emulated") is None
    assert Q.fused_kernels(x, None) is None
    got = Q.quantize_operands(x, E4M3, "rowwise", weight=False, cols=True, backend="triton")
    ref = Q.quantize_operands(x, E4M3, "rowwise", weight=False, cols=True)
    for g, r in zip(got, ref):
        assert_same(g, r, "cpu dispatch")
    if _CHILD:
        return
    pytest.importorskip("triton")
    from fp8boost.fp8.kernels import granular_cast as gc

    assert not gc.supports(torch.randn(0, 8), E4M3, "rowwise")
    assert not gc.supports(torch.randn(2, 3, 4), E4M3, "rowwise")
    assert not gc.supports(torch.ones(4, 4, dtype=torch.int32), E4M3, "rowwise")
    assert not gc.supports(x, E4M3, "rowwise")  # CPU without the interpreter
    with pytest.raises(ValueError, match="torch reference"):
        gc.quantize_operands(x, E4M3, "blockwise", weight=False)


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------
def _median_ms(fn, n=50):
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[n // 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_path_matches_reference():
    assert Q.fused_kernels(torch.ones(1, device="cuda"), "triton") is not None
    # Sizes that exercise the code paths (whole and partial 128-tiles, many row/col blocks, a
    # sliver), not throughput: the timing below uses 8192 x 4096.
    inputs = [make_input(shape, seed=5) for shape in ((1024, 1536), (1000, 3000), (7, 130))]
    inputs += [extremes_input(torch.bfloat16), extremes_input(torch.float32),
               make_input((300, 200), torch.float16).t()]
    for x in inputs:
        x, shape = x.cuda(), tuple(x.shape)
        for layout in LAYOUTS:
            recipe, weight, rows, cols = layout
            for dtype, margin, p2 in SCALINGS:
                kw = dict(weight=weight, rows=rows, cols=cols, margin=margin, power_of_2=p2)
                got = Q.quantize_operands(x, dtype, recipe, backend="triton", **kw)
                ref = Q.quantize_operands(x, dtype, recipe, **kw)
                for g, r, side in zip(got, ref, ("rows", "cols")):
                    assert_same(g, r, f"cuda {shape} {layout} {side} {dtype} {margin} {p2}")
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    for layout in LAYOUTS:
        recipe, weight, rows, cols = layout
        kw = dict(weight=weight, rows=rows, cols=cols)
        t_ref = _median_ms(lambda: Q.quantize_operands(x, E4M3, recipe, **kw))
        t_tri = _median_ms(lambda: Q.quantize_operands(x, E4M3, recipe, backend="triton", **kw))
        print(f"8192x4096 bf16 {layout}: torch eager {t_ref:.3f} ms, triton {t_tri:.3f} ms "
              f"({t_ref / t_tri:.1f}x)")


def _candidate_inputs():
    """A 2048 x 4096 input, aligned as the 8192 x 4096 one that test_cuda_path_matches_reference
    tunes on (so Triton reuses the kernels compiled there: compiles are most of this file's
    GPU time), and a 1000 x 3000 one with partial tiles; each with a NaN and an outlier."""
    out = []
    for shape in ((2048, 4096), (1000, 3000)):
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
        x[3, 5] = float("nan")
        x[100, 7] *= 1000
        out.append(x)
    return out


def _first_of_each_kind(configs):
    """The first config of each kind (plain tuples/ints, and each ``("name", ...)`` family)."""
    seen = {}
    for cfg in configs:
        seen.setdefault(cfg[0] if isinstance(cfg, tuple) and isinstance(cfg[0], str)
                        else "plain", cfg)
    return tuple(seen.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_rowwise_candidate_matches():
    """Each config the rowwise kernels may be tuned to gives the reference's bytes (the timed
    pick is whichever is fastest on the machine, so every candidate must be right): every
    config on the aligned input, the first of each kind on the partial-tile one."""
    from fp8boost.fp8.kernels import granular_cast as gc
    from fp8boost.fp8.kernels.granular_configs import ROWS_LOOP_CONFIGS, WIDE_ROWS_TILE_CONFIGS

    for i, x in enumerate(_candidate_inputs()):
        pick = (lambda cfgs: cfgs) if i == 0 else _first_of_each_kind
        ref_rows, ref_cols = Q.quantize_operands(x, E4M3, "rowwise", weight=False, cols=True)
        # the wide-rows tile configs too, whatever x's width: they are right for any width
        rows_cfgs = tuple(dict.fromkeys(gc.rows_configs(x.shape[1]) + WIDE_ROWS_TILE_CONFIGS))
        for cfg in dict.fromkeys(pick(rows_cfgs) + ROWS_LOOP_CONFIGS[:1]):  # + a two-sweep one
            assert_same(gc.rows_only(x, E4M3, config=cfg), ref_rows, f"rows {cfg}")
        configs = gc.rows_cols_configs(x.shape[1])
        for cfg in pick(configs):
            # without rows: the first tile config and every colmax one (other code paths)
            for rows in (True, False) if cfg == configs[0] or cfg[0] == "colmax" else (True,):
                got = gc.quantize_operands(x, E4M3, "rowwise", weight=False, rows=rows,
                                           cols=True, config=cfg)
                assert (got[0] is None) == (not rows)
                for g, r, side in zip(got, (ref_rows, ref_cols), ("rows", "cols")):
                    if g is not None:
                        assert_same(g, r, f"rows+cols {tuple(x.shape)} {cfg} {side}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_blockwise_candidate_matches():
    """As above for the blockwise candidates, at blocks 128 and 64."""
    from fp8boost.fp8.kernels import granular_cast as gc

    for i, x in enumerate(_candidate_inputs()):
        pick = (lambda cfgs: cfgs) if i == 0 else _first_of_each_kind
        for weight, rows, cols in ((False, True, True), (True, True, True), (False, True, False),
                                   (True, True, False), (False, False, True)):
            for block in (128, 64):
                kw = dict(weight=weight, rows=rows, cols=cols, block=block)
                ref = Q.quantize_operands(x, E4M3, "blockwise", **kw)
                for cfg in pick(gc.tile_configs(block, weight, rows, cols)):
                    got = gc.quantize_operands(x, E4M3, "blockwise", config=cfg, **kw)
                    for g, r in zip(got, ref):
                        assert (g is None) == (r is None)
                        if r is not None:
                            assert_same(g, r, f"blockwise {tuple(x.shape)} {kw} {cfg}")
