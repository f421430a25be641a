"""CPU tests of bench/moe_step.py (issue 34's one-GPU MoE step table) and its profile split.

One CPU run takes the tiny Mixtral through two real cells (one process each); the kernel
classifier of bench/_moe_profile.py is checked on hand-built op chains (the GPU runs it on
torch.profiler's events).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.bench.helpers import on_bench_path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def bench_mods():
    with on_bench_path():
        import _moe_cell
        import _moe_profile
        import moe_step
        yield SimpleNamespace(cell=_moe_cell, profile=_moe_profile, step=moe_step)


def _ev(name, parent=None, shapes=None):
    return SimpleNamespace(name=name, cpu_parent=parent, input_shapes=shapes or [])


def test_kernel_classes_follow_the_launching_op(bench_mods):
    classify, chain = bench_mods.profile.classify, bench_mods.profile._chain
    fwd = _ev("CompiledFunction")
    bwd = _ev("CompiledFunctionBackward")
    cutlass = "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversal"
    assert classify(cutlass, chain(_ev("aten::_scaled_grouped_mm",
                                       _ev("fp8boost::moe_scaled_mm", fwd)))) == "expert_fprop"
    assert classify(cutlass, chain(_ev("aten::_scaled_grouped_mm",
                                       _ev("fp8boost::moe_scaled_mm", bwd)))) == "expert_dgrad"
    assert classify(cutlass, chain(_ev("fp8boost::moe_scaled_mm_wgrad", bwd))) == "expert_wgrad"
    # BF16 experts (transformers' grouped_mm): backward's 2-D x 2-D product is the wgrad.
    assert classify(cutlass, chain(_ev("aten::_grouped_mm", fwd, [[8, 4], [2, 4, 6]]))) \
        == "expert_fprop"
    assert classify(cutlass, chain(_ev("aten::_grouped_mm", bwd, [[6, 8], [8, 4]]))) \
        == "expert_wgrad"
    assert classify(cutlass, chain(_ev("aten::_grouped_mm", bwd, [[8, 6], [2, 6, 4]]))) \
        == "expert_dgrad"
    assert classify("_group_cast_kernel", chain(_ev("fp8boost::moe_cast_groups_t", bwd))) \
        == "fp8_cast"
    assert classify("triton_red_fused_abs_amax_clamp_3", chain(fwd)) == "fp8_cast"
    assert classify("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", chain(fwd)) == "dense_gemm"
    assert classify("void at::native::_scatter_gather_elementwise_kernel",
                    chain(_ev("aten::index_copy", fwd))) == "permutation"
    assert classify("triton_poi_fused_index_put_masked_fill_6", chain(fwd)) == "permutation"
    assert classify("void at::native::_scatter_gather_elementwise_kernel",
                    chain(_ev("aten::scatter_reduce_", bwd))) == "fp8_cast"
    assert classify("multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata",
                    chain(_ev("aten::_fused_adamw_"))) == "optimizer"
    assert classify("triton_poi_fused_mul_silu_2", chain(fwd)) == "rest"


def test_tiny_cells_on_cpu(bench_mods, tmp_path):
    out = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, str(BENCH / "moe_step.py"), "--shapes", "tiny",
                           "--modes", "bf16_eager,fp8_eager_fp8head", "--warmup", "1",
                           "--steps", "1",
                           "--output", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cells = json.loads(out.read_text())["cells"]
    assert [c["status"] for c in cells] == ["ok", "ok"], cells
    bf16, fp8 = cells
    assert bf16["experts_implementation"] == "grouped_mm" and "fp8_coverage" not in bf16
    cov = fp8["fp8_coverage"]
    assert cov["experts"] == 2 and cov["linears"] == 8 and cov["bf16_linears"] == ["lm_head"]
    # Same data, same init: the first losses agree to FP8's error, and both are finite.
    assert abs(bf16["losses"][0] - fp8["losses"][0]) < 0.02 * bf16["losses"][0]
    assert bf16["tokens_per_s"] > 0 and fp8["tokens_per_s"] > 0
    # _fp8head: fp8boost's fused lm_head + loss with a rowwise FP8 head (lm_head itself stays
    # out of layer conversion); HF's loss has none of it
    assert fp8["lm_head"] == {"loss": "fused", "fp8_recipe": "rowwise"} and "lm_head" not in bf16
    assert "| tiny | fp8_eager_fp8head |" in proc.stdout


def test_mode_names_split_into_precision_compile_and_head(bench_mods):
    cell = bench_mods.cell
    assert cell.split_mode("fp8hpw_compiled_fp8head") == ("fp8hpw_compiled", "fp8head")
    assert cell.split_mode("bf16_compiled_fusedloss") == ("bf16_compiled", "fusedloss")
    assert cell.split_mode("bf16_compiled") == ("bf16_compiled", "")
    assert cell.is_compiled("bf16_compiled_fusedloss") and not cell.is_compiled("fp8_eager_fp8head")
    assert {"bf16_compiled_fusedloss", "fp8hpw_compiled_fp8head"} <= set(cell.MODES)


def test_unknown_shape_or_mode_is_refused(bench_mods):
    with pytest.raises(SystemExit, match="unknown shape/mode"):
        bench_mods.step.parse_args(["--modes", "fp16_compiled"])
