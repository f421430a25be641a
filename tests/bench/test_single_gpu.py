"""CPU tests of bench/single_gpu.py (issue 11's one-GPU table) and its bench/train.py options.

The shape and mode tables, the command lines and the table logic are checked without spawning;
one CPU run takes the tiny shape through real cells (one bench/train.py process each), with
torchao's cell skipped when torchao is not installed (CI) and no compiled cell (too slow here).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.bench.helpers import on_bench_path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def sg():
    with on_bench_path():
        import single_gpu as mod
        import train
        mod.train = train  # the test's handle on bench/train.py (single_gpu never imports it)
        yield mod


def test_shapes_modes_and_command_lines(sg, capsys):
    assert (sg.SHAPES["8b-4l"]["kv_heads"], sg.SHAPES["8b-4l"]["heads"]) == (8, 32)
    assert (sg.SHAPES["1b"]["layers"], sg.SHAPES["1b"]["batch_size"]) == (16, 8)
    args = sg.parse_args([])
    assert args.shapes == ["1b", "7b-4l", "8b-4l"] and "tiny" not in args.shapes
    assert args.modes == ["bf16_eager", "bf16_compiled", "torchao_compiled", "fp8_eager_default",
                          "fp8_eager_all", "fp8_compiled_all"]
    # 6 default + 4 optional + 5 ablations + 7 of issue 26's recipes + 2 of their eager
    # ablations (no shared input casts) + 3 fused-norm eager rows + 6 of issue 35's heads
    assert len(sg.parse_args(["--modes", "all"]).modes) == 33
    targs = sg.train.parse_args(sg.cell_argv(args, "8b-4l", "bf16_eager_fusednorm",
                                             "x.json")[2:])
    assert (targs.configs, targs.fused_norm, targs.compile) == (["single_bf16"], True, False)
    for recipe in ("rowwise", "blockwise"):
        targs = sg.train.parse_args(sg.cell_argv(args, "8b-4l", f"fp8_{recipe}_eager_noshare",
                                                 "x.json")[2:])
        assert (targs.fp8_options, targs.compile) == (
            f"named={recipe},share_input_casts=False", False)
    with pytest.raises(ValueError, match="unknown shape"):
        sg.parse_args(["--shapes", "1b,70b"])
    with pytest.raises(ValueError, match="unknown mode"):
        sg.parse_args(["--modes", "fp8_compiled"])
    assert sg.main(["--modes", "nope"]) == 2 and "unknown mode" in capsys.readouterr().err

    # Each cell's command is a valid bench/train.py command line with the shape's model.
    argv = sg.cell_argv(args, "8b-4l", "fp8_compiled_all", "x.json")
    assert argv[1] == str(BENCH / "train.py") and "--no-isolate" in argv
    targs = sg.train.parse_args(argv[2:])
    assert (targs.configs, targs.fp8_min_numel, targs.compile, targs.fused_adamw) == (
        ["single_fp8"], 0, True, True)
    assert (targs.batch_size, targs.seq_len, targs.warmup, targs.steps) == (4, 4096, 3, 10)
    info = sg.train.model_info(targs)  # meta device
    assert (info["kv_heads"], info["heads"], info["ffn"], info["layers"]) == (8, 32, 14336, 4)
    targs = sg.train.parse_args(sg.cell_argv(args, "1b", "torchao_compiled", "x.json")[2:])
    assert targs.configs == ["single_torchao"] and targs.fp8_min_numel is None
    targs = sg.train.parse_args(sg.cell_argv(args, "8b-4l", "torchao_rowwise_compiled",
                                             "x.json")[2:])
    assert targs.torchao_recipe == "rowwise"
    targs = sg.train.parse_args(sg.cell_argv(args, "8b-4l", "fp8_blockwise_compiled",
                                             "x.json")[2:])
    assert targs.fp8_options == "named=blockwise" and targs.fp8_min_numel == 0
    # --isolate passes the new flags on to each torchrun.
    child = sg.train._child_argv(sg.train.parse_args(["--heads", "32", "--kv-heads", "8",
                                                      "--fused-adamw"]), "single_bf16", "o.json")
    assert child[child.index("--kv-heads") + 1] == "8" and "--fused-adamw" in child
    # The two-pass master step is an explicit choice that reaches the child; default: library's.
    targs = sg.train.parse_args(sg.cell_argv(args, "7b-4l", "fp8_compiled_twopass", "x.json")[2:])
    assert targs.master_step == "two-pass" and targs.fp8_min_numel == 0
    child = sg.train._child_argv(targs, "single_fp8", "o.json")
    assert child[child.index("--master-step") + 1] == "two-pass"
    assert sg.train.parse_args(argv[2:]).master_step is None

    assert sg.main(["--dry-run", "--output", "unused.json"]) == 0
    out = capsys.readouterr().out
    assert out.count("bench/train.py") == 18 and not Path("unused.json").exists()


def test_peak_table_ratios_and_compile_check(sg):
    import _scale_report  # the one peak table (bench/_single.py's MFU reads it too)

    peak = _scale_report.dense_bf16_peak
    assert peak("NVIDIA H100 80GB HBM3") == peak("NVIDIA H200") == peak("NVIDIA H800") == 989.0
    assert peak("NVIDIA H100 PCIe") == 756.0 and peak("cpu") is None

    def ok(tok, **kw):
        return dict(status="ok", tokens_per_s_per_gpu=tok, peak_mem_gib=1.0, first_step_s=9.0,
                    warmup_s=12.0, mfu=0.4, **kw)
    cells = dict(bf16_eager=ok(100.0), bf16_compiled=ok(125.0, compile=dict(unique_graphs=2,
                                                                            graph_breaks=0)),
                 torchao_compiled=ok(150.0, compile=dict(unique_graphs=2, graph_breaks=0)),
                 fp8_compiled_all=ok(180.0, compile=dict(unique_graphs=3, graph_breaks=2)),
                 fp8_eager_all=dict(status="oom"))
    cells["fp8_compiled_default"] = ok(170.0, compile=dict(unique_graphs=0, graph_breaks=0))
    for mode, cell in cells.items():
        sg.check_compiled(mode, cell)
    assert cells["fp8_compiled_default"]["status"] == "not_compiled"
    assert cells["fp8_compiled_all"]["compile_ok"] is False and cells["bf16_compiled"]["compile_ok"]
    sg.add_ratios(cells)
    fp8 = cells["fp8_compiled_all"]
    assert fp8["vs_bf16_compiled"] == pytest.approx(1.44) and fp8["vs_bf16_eager"] == 1.8
    assert fp8["vs_torchao_compiled"] == pytest.approx(1.2)
    assert "vs_torchao_compiled" not in cells["bf16_eager"]
    assert "vs_torchao_compiled_hfloss" not in fp8  # that cell was not run: no key
    report = dict(device="NVIDIA H100 80GB HBM3", optimizer="AdamW (fused)", steps=10, warmup=3,
                  peak_bf16_tflops=989.4, modes=list(cells), shapes={"1b": dict(cells=cells)})
    table = sg.format_table(report)
    assert "| 1b | 100 (0.80x) | 125 (1.00x) | 150 (1.20x) | 180 (1.44x) !2br | oom |" in table
    assert "not_compiled" in table and "1b MFU: bf16_eager 40.0%" in table
    assert "1b warm-up s (first step / all 3): bf16_eager 9.0/12.0" in table


ISSUE35 = {  # mode: (config, --fused-lm-loss, --torchao-recipe, --fp8-options)
    "bf16_compiled_hfloss": ("single_bf16", "off", None, None),
    "torchao_compiled_hfloss": ("single_torchao", "off", None, None),
    "torchao_rowwise_compiled_hfloss": ("single_torchao", "off", "rowwise", None),
    "fp8_compiled_all_fp8head": ("single_fp8", "fp8-rowwise", None, None),
    "fp8_rowwise_compiled_fp8head": ("single_fp8", "fp8-rowwise", None, "named=rowwise"),
    "bf16_compiled_fp8head": ("single_bf16", "fp8-rowwise", None, None),
}


def test_issue35_shape_modes_and_flag(sg):
    """llama3-8b-4l and the lm_head modes: real train.py command lines, appended after the
    defaults; --fused-lm-loss defaults to the library's "on" and reaches isolated children."""
    assert "llama3-8b-4l" not in sg.DEFAULT_SHAPES and list(sg.MODES)[-6:] == list(ISSUE35)
    args = sg.parse_args(["--shapes", "llama3-8b-4l", "--modes", ",".join(ISSUE35)])
    for mode, (config, flag, recipe, options) in ISSUE35.items():
        targs = sg.train.parse_args(sg.cell_argv(args, "llama3-8b-4l", mode, "x.json")[2:])
        assert (targs.configs, targs.fused_lm_loss, targs.torchao_recipe, targs.fp8_options,
                targs.compile) == ([config], flag, recipe, options, True), mode
        assert targs.fp8_min_numel == (0 if config == "single_fp8" else None), mode
    assert (targs.batch_size, targs.seq_len, targs.vocab_size) == (2, 4096, 128256)
    info = sg.train.model_info(targs)  # meta device
    assert (info["vocab"], info["hidden"], info["ffn"], info["layers"], info["heads"],
            info["kv_heads"]) == (128256, 4096, 14336, 4, 32, 8)
    old = sg.train.parse_args(sg.cell_argv(args, "llama3-8b-4l", "fp8_compiled_all", "x")[2:])
    assert old.fused_lm_loss == "on"  # every earlier mode: the library default
    child = sg.train._child_argv(targs, "single_bf16", "o.json")
    assert child[child.index("--fused-lm-loss") + 1] == "fp8-rowwise"
    with pytest.raises(SystemExit):
        sg.train.parse_args(["--fused-lm-loss", "fp8"])


def test_fused_lm_loss_flag_reaches_the_booster(sg, monkeypatch):
    """The flag's mapping, on a real single_* Booster (CPU, tiny model: the head is fused or
    not, with the FP8 recipe asked for) and in the keywords of every plugin config."""
    from fp8boost.loss import FusedLmLossConfig

    train = sg.train
    assert [train.fused_lm_loss_setting(c) for c in (None, "on", "off")] == [True, True, False]
    assert train.fused_lm_loss_setting("fp8-blockwise") == FusedLmLossConfig(
        fp8_recipe="blockwise")
    cpu = torch.device("cpu")
    for config, flag, recipe, status in (
            ("single_bf16", "off", None, "fused_lm_loss=False"),
            ("single_bf16", "on", None, "fused"),
            ("single_fp8", "fp8-rowwise", "rowwise", "fused")):
        args = train.parse_args(["--configs", config, "--preset", "tiny", "--vocab-size", "64",
                                 "--layers", "1", "--device", "cpu", "--fused-lm-loss", flag])
        model = train.build_model(args, cpu)
        train.setup_booster(model, config, args, cpu)
        assert args._fused_lm_loss_status == status, (config, flag)
        fused = vars(model).get("forward")  # FusedLossForward when fused, on the HF model
        assert (getattr(getattr(fused, "config", None), "fp8_recipe", "unfused")
                == (recipe if status == "fused" else "unfused")), (config, flag)

    class Stop(Exception):
        pass

    seen: dict[str, object] = {}

    def fake(name):
        def plugin(*_, **kw):
            seen[name] = kw.get("fused_lm_loss", "missing")
            raise Stop
        return plugin

    import fp8boost.plugins as plugins
    names = {"ddp": "TorchDDPPlugin", "gemini": "GeminiPlugin", "tp2": "HybridParallelPlugin",
             "torchfsdp": "TorchFSDPPlugin", "zero1": "LowLevelZeroPlugin"}
    for cls in names.values():
        monkeypatch.setattr(plugins, cls, fake(cls))
    args = train.parse_args(["--device", "cpu", "--fused-lm-loss", "off"])
    for kind in names:
        with pytest.raises(Stop):
            train.setup_booster(torch.nn.Linear(2, 2), f"{kind}_bf16", args, cpu)
    assert seen == {cls: False for cls in names.values()}


def test_shape_at_another_batch_size(sg):
    """<shape>@b<N> (issue 35 item 4: the largest batch each mode fits): the shape's command
    line with --batch-size N, under its own name; a bad base or batch is refused."""
    args = sg.parse_args(["--shapes", "llama3-8b-4l@b6,tiny", "--modes", "fp8_compiled_all"])
    assert args.shapes == ["llama3-8b-4l@b6", "tiny"]
    targs = sg.train.parse_args(sg.cell_argv(args, "llama3-8b-4l@b6", "fp8_compiled_all",
                                             "x.json")[2:])
    assert (targs.batch_size, targs.seq_len, targs.vocab_size) == (6, 4096, 128256)
    assert sg.shape_spec("llama3-8b-4l") == sg.SHAPES["llama3-8b-4l"]  # no suffix: unchanged
    for bad in ("nope@b4", "tiny@b0", "tiny@4", "tiny@b"):
        with pytest.raises(ValueError, match="unknown shape"):
            sg.parse_args(["--shapes", bad])


def test_issue35_ratios_against_torchao_with_hf_loss(sg):
    """FP8 cells get vs_torchao_compiled_hfloss when that cell was run (None when not ok);
    BF16 and torchao cells never do."""
    def ok(tok):
        return dict(status="ok", tokens_per_s_per_gpu=tok)
    cells = dict(bf16_compiled=ok(100.0), torchao_compiled=ok(120.0),
                 torchao_compiled_hfloss=ok(110.0), fp8_compiled_all=ok(132.0),
                 fp8_compiled_all_fp8head=ok(143.0), bf16_compiled_hfloss=ok(90.0))
    sg.add_ratios(cells)
    assert cells["fp8_compiled_all"]["vs_torchao_compiled_hfloss"] == pytest.approx(1.2)
    assert cells["fp8_compiled_all_fp8head"]["vs_torchao_compiled_hfloss"] == pytest.approx(1.3)
    assert cells["fp8_compiled_all_fp8head"]["vs_torchao_compiled"] == pytest.approx(143 / 120)
    assert not any("vs_torchao_compiled_hfloss" in cells[m] for m in (
        "bf16_compiled", "torchao_compiled", "torchao_compiled_hfloss", "bf16_compiled_hfloss"))
    cells["torchao_compiled_hfloss"] = dict(status="oom")
    sg.add_ratios(cells)
    assert cells["fp8_compiled_all"]["vs_torchao_compiled_hfloss"] is None


def test_fused_adamw_steps_fp32_masters():
    """--fused-adamw: the fp8boost wrapper re-points AdamW(fused=True) at its FP32 masters; the
    fused kernel (CPU here, CUDA on the GPU) must match the default implementation."""
    from fp8boost.booster import Booster
    from fp8boost.booster.mixed_precision import MixedPrecision

    weights = {}
    for fused in (None, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 32))
        booster = Booster(mixed_precision=MixedPrecision("bf16"), device=torch.device("cpu"))
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2,
                                                                fused=fused))
        assert opt.optim.param_groups[0]["params"][0].dtype == torch.float32
        x = torch.randn(8, 32)
        for _ in range(3):
            booster.backward(model(x).float().pow(2).mean(), opt)
            opt.step()
            opt.zero_grad()
        weights[fused] = [p.detach().float() for p in model.unwrap().parameters()]
    assert all(torch.equal(a, b) for a, b in zip(weights[None], weights[True]))


def test_timed_out_cell_is_recorded(sg, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert sg.main(["--device", "cpu", "--shapes", "tiny", "--modes", "bf16_eager",
                    "--config-timeout", "1", "--output", str(out)]) == 0
    cell = json.loads(out.read_text())["shapes"]["tiny"]["cells"]["bf16_eager"]
    assert (cell["status"], cell["returncode"]) == ("timeout", "timeout")
    assert "| tiny | timeout |" in capsys.readouterr().out


def test_cpu_run_tiny(tmp_path):
    out = tmp_path / "single.json"
    # One thread per cell: 2-thread BF16 CPU kernels slow down badly on a shared 2-core box.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    modes = "bf16_eager,fp8_eager_all,torchao_compiled"
    proc = subprocess.run([sys.executable, str(BENCH / "single_gpu.py"), "--device", "cpu",
                           "--shapes", "tiny", "--modes", modes, "--warmup", "1", "--steps", "2",
                           "--output", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| tiny |" in proc.stdout and "tiny warm-up s" in proc.stdout
    report = json.loads(out.read_text())
    assert report["versions"]["torch"] and report["peak_bf16_tflops"] is None  # CPU: no MFU
    shape = report["shapes"]["tiny"]
    assert shape["model"]["layers"] == 4 and shape["model"]["flops_per_token"] > 0
    cells = shape["cells"]
    for mode in ("bf16_eager", "fp8_eager_all"):
        cell = cells[mode]
        assert cell["status"] == "ok", cell.get("error")
        assert cell["tokens_per_s_per_gpu"] > 0 and cell["finite"]
        assert cell["first_step_s"] > 0 and cell["warmup_s"] >= cell["first_step_s"] * 0.99
        assert "mfu" in cell and cell["vs_bf16_eager"] > 0
    assert cells["fp8_eager_all"]["fp8_layers"]["converted"] > 0
    assert cells["bf16_eager"]["fused_lm_loss_status"] == "fused"  # the library default
    assert cells["fp8_eager_all"]["vs_torchao_compiled"] is None  # torchao cell not ok here
    torchao = cells["torchao_compiled"]["status"]
    assert torchao == ("skipped" if importlib.util.find_spec("torchao") is None else "ok"), \
        cells["torchao_compiled"].get("error")


def test_profile_categories_name_the_kernels_seen_on_h100(sg):
    """bench/_profile.py: kernel names from an H100 profile (cuBLAS nvjet FP8 and BF16 GEMMs,
    our Triton kernels, PyTorch's dtype copies whose names contain 'Cast') land where the
    BENCHMARKS breakdown says; and --profile-steps reaches the cell's train.py command."""
    import _profile

    seen = {
        "nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT": "gemm_fp8_cublas",
        "nvjet_sm90_qqtst_128x256_128x4_2x1_v_bz_coopA_TNN": "gemm_fp8_cublas",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "gemm_bf16",
        "_gemm_tma_kernel": "gemm_fp8_triton",
        "_cast_kernel": "fp8_cast",
        "_amax_kernel": "fp8_cast",
        "_rows_kernel": "fp8_cast",  # the granular casts, seen on an H200 (FP8 lm_head)
        "_tile_cast_kernel": "fp8_cast",
        "_amax_rc_kernel": "fp8_cast",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
        "at::TensorIteratorBase&)::{lambda()#3}, memory::LoadWithCast<1>>": "dtype_copy",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
        "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>":
            "optimizer",
        "triton_poi_fused__to_copy_add_clamp_mul_reciprocal_scaled_mm_silu": "inductor_fused",
        "void at::native::cunn_SoftMaxBackward<4, float>": "loss_softmax",
        "some_unknown_kernel": "other",
    }
    assert {name: _profile.categorize(name) for name in seen} == seen
    args = sg.parse_args(["--shapes", "tiny", "--modes", "fp8_eager_all", "--profile-steps", "2"])
    argv = sg.cell_argv(args, "tiny", "fp8_eager_all", "/tmp/x.json")
    assert argv[argv.index("--profile-steps") + 1] == "2"
    assert sg.train.parse_args(["--profile-steps", "2"]).profile_steps == 2
