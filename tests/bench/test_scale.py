"""CPU tests of bench/scale.py (issue 15's 8-GPU matrix) and its suite (bench/suite.py 8gpu).

The matrix, the dp/tp/pp derivation and the presets' shapes are checked without a process
group (meta-device models); one 2-rank gloo run takes tensor-parallel and pipeline configs
through the same code path the GPU run uses (``--no-isolate``: one torchrun for both).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.helpers import on_bench_path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def scale():
    with on_bench_path():
        import scale as mod
        yield mod


def test_matrix_layouts_for_2_and_8_gpus(scale):
    lay8 = {c: scale.layout_of(c, 8) for c in scale.MATRIX_7B + scale.MATRIX_35B}
    assert len(scale.MATRIX_7B) == 15 and lay8["fsdp2_bf16_eager"]["dp"] == 8
    assert (lay8["zero2_fp8"]["dp"], lay8["gemini_fp8_comm"]["plugin"]) == (8, "gemini")
    assert {k: lay8["tp2_fp8"][k] for k in ("tp", "pp", "dp", "sp")} == dict(tp=2, pp=1, dp=4,
                                                                             sp=False)
    assert {k: lay8["pp2_fp8_comm"][k] for k in ("tp", "pp", "dp", "plugin", "variant")} == \
        dict(tp=1, pp=2, dp=4, plugin="pipeline", variant="fp8_comm")
    assert (lay8["tp8sp_fp8"]["dp"], lay8["tp4sp_bf16"]["dp"], lay8["tp4sp_bf16"]["sp"]) == \
        (1, 2, True)
    lay2 = {c: scale.layout_of(c, 2) for c in scale.MATRIX_7B + ["tp2sp_fp8"]}
    assert (lay2["tp2_bf16"]["dp"], lay2["pp2_bf16"]["dp"], lay2["zero2_bf16"]["dp"]) == (1, 1, 2)
    for bad, match in (("tp8sp_fp8", "divide the world size"), ("zero3_bf16", "unknown config"),
                       ("pp1_bf16", "pp >= 2"), ("tp2_fp16", "unknown config")):
        with pytest.raises(ValueError, match=match):
            scale.layout_of(bad, 2)
    args = scale.parse_args(["--preset", "command-r-35b", "--configs", "fsdp2_bf16"])
    assert args.build_dtype == "bf16" and args.vocab_size == 256000
    with pytest.raises(ValueError, match="build-dtype fp32"):
        scale.validate(args, 8)
    with pytest.raises(ValueError, match="must divide the replica batch"):
        scale.validate(scale.parse_args(["--configs", "pp2_bf16", "--microbatches", "3"]), 8)
    argv = scale.child_argv(scale.parse_args(["--compile", "--replica-batch", "2"]),
                            "fsdp2_bf16_eager", "x.json")
    assert "--compile" not in argv and argv[argv.index("--replica-batch") + 1] == "2"


@pytest.mark.parametrize("part", ["smoke 2", "smoke 8", "7b", "13b", "35b", "NPROC=4 7b"])
def test_run_8gpu_parts_pass_validation(scale, part, tmp_path):
    """--dry-run prints each part's commands; their arguments must pass scale.py's checks at
    the world size each command launches (8, NPROC, or N for smoke N)."""
    env = dict(os.environ, OUT=str(tmp_path))
    if part.startswith("NPROC="):
        nproc, part = part.split(" ", 1)
        env["NPROC"] = nproc.split("=")[1]
    out = subprocess.run([sys.executable, str(BENCH / "suite.py"), "--dry-run", "8gpu",
                          *part.split()], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [ln.split() for ln in out.stdout.splitlines() if "bench/scale.py" in ln]
    checked = []
    for words in lines:
        argv = words[words.index("bench/scale.py") + 1:]
        if "--merge" in argv:
            continue
        launch = [w for w in words if w.startswith("--nproc_per_node=")]
        world = int(launch[0].split("=")[1]) if launch else int(argv[argv.index("--nproc") + 1])
        args = scale.parse_args(argv)
        layouts = scale.validate(args, world)
        checked += [(lay["config"], world, lay["dp"]) for lay in layouts]
    names = {c for c, _, _ in checked}
    expected = dict(smoke=set(scale.MATRIX_7B) | {"zero2_bf16", "zero2_fp8"},
                    **{"7b": set(scale.MATRIX_7B), "13b": {"zero2_bf16", "zero2_fp8"},
                       "35b": set(scale.MATRIX_35B)})[part.split()[0]]
    assert expected <= names, (part, names)
    if part == "7b" and env.get("NPROC") == "4":
        assert ("tp2_fp8", 4, 2) in checked and ("pp2_fp8_comm", 4, 2) in checked
        assert "scale_4gpu_7b_tp.json" in out.stdout
    elif part == "7b":
        assert ("tp2_fp8", 8, 4) in checked and ("pp2_fp8_comm", 8, 4) in checked
    if part == "smoke 2":
        assert ("tp2_fp8", 2, 1) in checked and ("pp2_bf16", 2, 1) in checked
        assert ("tp2sp_fp8", 2, 1) in checked and all(w == 2 for _, w, _ in checked)
    if part == "smoke 8":
        assert ("tp8sp_fp8", 8, 1) in checked and ("tp2_fp8", 8, 4) in checked


def test_presets_shapes_and_parameter_counts(scale):
    info = {p: scale.model_info(scale.parse_args(["--preset", p]))
            for p in ("llama2-7b", "llama2-13b", "command-r-35b")}
    i7, i13, i35 = info["llama2-7b"], info["llama2-13b"], info["command-r-35b"]
    assert (i7["hidden"], i7["layers"], i7["ffn"], i7["heads"], i7["vocab"]) == \
        (4096, 32, 11008, 32, 32000)
    assert 6.70e9 < i7["params"] < 6.78e9 and i7["arch"] == "llama"   # LLaMA2-7B: 6.74B
    assert (i13["hidden"], i13["layers"], i13["ffn"], i13["heads"]) == (5120, 40, 13824, 40)
    assert 12.95e9 < i13["params"] < 13.1e9                           # LLaMA2-13B: 13.02B
    assert (i35["arch"], i35["hidden"], i35["layers"], i35["ffn"], i35["heads"],
            i35["kv_heads"], i35["vocab"], i35["tied_embeddings"]) == \
        ("cohere", 8192, 40, 22528, 64, 64, 256000, True)
    assert 34.9e9 < i35["params"] < 35.1e9                            # Command-R: 35B
    # PaLM accounting: 6N + 12 * layers * hidden * seq
    assert i7["flops_per_token"] == 6 * i7["matmul_params"] + 12 * 32 * 4096 * 4096


def test_report_speedups_best_config_and_merge(scale, tmp_path):
    rep = scale.rep
    assert rep.dense_bf16_peak("NVIDIA H200") == rep.dense_bf16_peak("NVIDIA H100 80GB HBM3") \
        == 989.0 and rep.dense_bf16_peak("cpu (x86_64)") is None
    rows = [dict(config=c, status="ok", tokens_per_s_per_gpu=s, tflops_per_gpu=s / 100,
                 mfu=s / 98900, peak_mem_gib=1.0, finite=True, tp=1, pp=1, dp=8)
            for c, s in (("fsdp2_bf16_eager", 100.0), ("fsdp2_bf16", 120.0),
                         ("torchao_fsdp2", 150.0), ("zero2_bf16", 125.0), ("zero2_fp8", 170.0))]
    rows.append(dict(config="pp2_fp8", status="not_available", error="NotImplementedError: pp"))
    base = dict(device="NVIDIA H200", world_size=8, model=dict(preset="llama2-7b"), seq_len=4096,
                steps=10, warmup=4, peak_bf16_tflops=989.0)
    (tmp_path / "a.json").write_text(json.dumps(dict(base, results=rows[:3])))
    (tmp_path / "b.json").write_text(json.dumps(dict(base, results=rows[3:])))
    merged = rep.merge([str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                        str(tmp_path / "missing.json")], "7b")
    z = {r["config"]: r for r in merged["results"]}["zero2_fp8"]
    assert z["vs_fsdp2_bf16_eager"] == pytest.approx(1.7) and z["vs_own_bf16"] == pytest.approx(1.36)
    assert z["vs_torchao"] == pytest.approx(170 / 150)
    t = merged["targets"]
    assert merged["missing"] == [str(tmp_path / "missing.json")]
    assert t["best_config"] == "zero2_fp8" and t["vs_own_bf16"]["met"] is True
    assert t["vs_fsdp2_bf16_eager"]["met"] is False and t["vs_torchao"]["target"] == 1.05
    table = rep.format_table(merged)
    assert "not_available" in table and "1.36" in table and "989 TFLOP/s" in table
    assert "target vs_fsdp2_bf16_eager: 1.70x (target 1.94x) MISSED" in table
    pair, why = rep.best_pair([str(tmp_path / "b.json")])
    assert pair == ["zero2_bf16", "zero2_fp8"] and "zero2_fp8" in why
    assert rep.best_pair([str(tmp_path / "a.json")])[0] == ["zero2_bf16", "zero2_fp8"]  # fallback


def test_cpu_gloo_hybrid_and_pipeline_configs(tmp_path):
    """tp2 x dp1 and pp2 x dp1 (FP8 + FP8 comm) on 2 gloo ranks in one torchrun, as the GPU
    smoke runs them; pp is ok, or not_available while the pipeline is not implemented."""
    out = tmp_path / "scale.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(BENCH / "scale.py"), "--device", "cpu", "--preset", "tiny", "--vocab-size", "256",
           "--seq-len", "64", "--warmup", "0", "--steps", "1", "--fp8-min-numel", "0",
           "--configs", "tp2sp_fp8_comm,pp2_fp8_comm", "--no-isolate", "--output", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:]
    report = json.loads(out.read_text())
    res = {r["config"]: r for r in report["results"]}
    tp, pp = res["tp2sp_fp8_comm"], res["pp2_fp8_comm"]
    assert tp["status"] == "ok" and tp["finite"] and (tp["tp"], tp["dp"], tp["sp"]) == (2, 1, True)
    assert tp["fp8_layers"]["converted"] == 4 * 7 and tp["mfu"] is None  # no CPU peak
    assert tp["tokens_per_gpu_step"] == 2 * 64 and tp["replica_batch"] == 4
    assert pp["status"] in ("ok", "not_available"), pp
    if pp["status"] == "ok":
        assert (pp["pp"], pp["dp"], pp["microbatches"]) == (2, 1, 4) and pp["finite"]
    assert report["model"]["arch"] == "llama" and "tp2sp_fp8_comm" in proc.stdout


def test_not_implemented_is_recorded_as_not_available(scale, monkeypatch):
    """A config the library cannot run yet (pp before it lands) is a row, not a crash."""
    def no_pp(*_a, **_k):
        raise NotImplementedError("pp_size=2: pipeline parallelism is not implemented yet")
    monkeypatch.setattr(scale, "measure", no_pp)
    args = scale.parse_args(["--configs", "pp2_bf16", "--device", "cpu"])
    row = scale.run_config("pp2_bf16", args, scale.torch.device("cpu"), 0, 1,
                           dict(flops_per_token=1))
    assert row["status"] == "not_available" and "not implemented" in row["error"]


def test_profile_overlap_splits_compute_from_exposed_nccl():
    """bench/_profile.py's overlap: busy = union of non-NCCL kernels, idle = span - busy,
    nccl_exposed = NCCL time no compute kernel covers (per step, ms from us)."""
    with on_bench_path():
        import _profile
    kernels = [("gemm_bf16", 0, 10_000), ("nccl", 5_000, 20_000), ("inductor_fused", 15_000, 18_000),
               ("nccl", 19_000, 21_000), ("fp8_cast", 30_000, 40_000)]
    got = _profile.overlap(kernels, steps=2)
    # busy 10 + 3 + 10 ms; NCCL 5-21 (16 ms) minus compute 5-10 and 15-18: 10-15 and 18-21
    assert got == dict(span=20.0, busy=11.5, idle=8.5, nccl=8.0, nccl_exposed=4.0)
    assert _profile.overlap([], steps=1) == {}
    assert _profile.categorize("ncclDevKernel_AllGather_RING_LL(x)") == "nccl"


def test_profile_flags_reach_the_isolated_child(scale):
    args = scale.parse_args(["--configs", "zero2_fp8,gemini_fp8", "--profile-steps", "1",
                             "--profile-trace", "/tmp/tr", "--profile-cpu"])
    argv = scale.child_argv(args, "zero2_fp8", "/tmp/o.json")
    assert argv[argv.index("--profile-steps") + 1] == "1"
    assert argv[argv.index("--profile-trace") + 1] == "/tmp/tr" and "--profile-cpu" in argv
    plain = scale.child_argv(scale.parse_args(["--configs", "zero2_fp8,gemini_fp8"]), "x", "o")
    assert "--profile-cpu" not in plain and "--profile-trace" not in plain


def test_fp8_options_and_fused_loss_reach_the_child_and_the_config(scale):
    args = scale.parse_args(["--configs", "zero2_fp8,gemini_fp8", "--fp8-min-numel", "0",
                             "--fp8-options", "backend=cublas", "--fused-lm-loss", "off"])
    argv = scale.child_argv(args, "gemini_fp8", "/tmp/o.json")
    assert argv[argv.index("--fp8-options") + 1] == "backend=cublas"
    assert argv[argv.index("--fused-lm-loss") + 1] == "off"
    cfg = scale.train.fp8_config_of(args)
    assert cfg.backend == "cublas" and cfg.min_numel == 0
    assert scale.train.fp8_config_of(scale.parse_args([])) is None  # the library default
