"""CPU checks of bench/gemm_overhead.py (the host cost per FP8 GEMM call; its figures come from
the GPU): the smoke run writes its rows, bad options fail before any work."""
from __future__ import annotations

import json

import pytest

from tests.bench.helpers import on_bench_path


def test_cpu_smoke_run_writes_the_op_rows(tmp_path):
    with on_bench_path():
        import gemm_overhead
        out = tmp_path / "o.json"
        assert gemm_overhead.main(["--device", "cpu", "--size", "16", "--calls", "3",
                                   "--repeats", "1", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "gemm_overhead" and result["size"] == 16
    assert "--calls 3" in result["command"]
    assert [r["variant"] for r in result["rows"]] == ["op", "op_fast"]  # CUDA adds mm, scaled_mm
    assert all(r["us_per_call"] > 0 for r in result["rows"])


def test_bad_size_is_refused():
    with on_bench_path():
        import gemm_overhead
        with pytest.raises(ValueError, match="multiple of 16"):
            gemm_overhead.main(["--device", "cpu", "--size", "24"])


def test_compiled_rows_need_cuda():
    with on_bench_path():
        import gemm_overhead
        with pytest.raises(ValueError, match="needs --device cuda"):
            gemm_overhead.main(["--device", "cpu", "--compiled"])
