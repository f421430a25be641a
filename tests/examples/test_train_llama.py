"""CPU tests of examples/train_llama.py (and the helpers beside it) and bench/train.py.

End-to-end runs go through subprocesses, as a user would launch them: plain python (no plugin),
and a 2-rank torchrun with ZeRO-2 + FP8 + FP8 communication. Each run is a few dozen steps of
the tiny preset on short sequences (~10-25 s each, most of it ``import torch``/transformers).

Tolerances: resuming a single-process run must reproduce the uninterrupted run's losses
exactly (same process layout, same batches, deterministic CPU kernels: nothing may differ).
"Loss falls" means the mean of the last 5 logged losses is at least 0.5 nats below the mean of
the first 5 (an untrained byte model starts at ln 256 = 5.5; 24 steps at lr 3e-3 reach ~3.3).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SCRIPT = EXAMPLES / "train_llama.py"

# Short, fast runs: 24 steps of 8 x 64 tokens.
FAST = ["--preset", "tiny", "--seq-len", "64", "--batch-size", "8", "--lr", "3e-3",
        "--warmup-steps", "2", "--no-progress", "--eval-batches", "2"]


@pytest.fixture(scope="module")
def ex():
    """The example's modules, imported the way the script imports them."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import checkpointing
        import data
        import metrics
        import presets
        import train_llama
        yield type("Ex", (), dict(data=data, metrics=metrics, presets=presets,
                                  checkpointing=checkpointing, train=train_llama))
    finally:
        sys.path.remove(str(EXAMPLES))


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    return env


def _run(cmd: list[str], threads: int, timeout: float = 240) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(threads), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}"
    return proc.stdout


def _losses(out_dir: Path) -> dict[int, float]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


def _assert_loss_falls(losses: dict[int, float]) -> None:
    values = [losses[s] for s in sorted(losses)]
    first, last = sum(values[:5]) / 5, sum(values[-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: first {first:.3f}, last {last:.3f}"


# --------------------------------------------------------------------------- end to end


def test_plain_python_trains_saves_and_resumes_exactly(ex, tmp_path):
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    out = _run([sys.executable, str(SCRIPT), *FAST, "--steps", "24", "--save-every", "12",
                "--out-dir", str(run_a), "--eval-every", "12"], threads=2)
    assert "done: loss" in out
    losses_a = _losses(run_a)
    assert sorted(losses_a) == list(range(1, 25))
    _assert_loss_falls(losses_a)
    summary = json.loads((run_a / "summary.json").read_text())
    assert summary["steps_run"] == 24 and summary["last_loss"] < summary["first_loss"]
    assert summary["tokens_per_s"] > 0 and summary["tflops_per_device"] > 0
    config = json.loads((run_a / "run_config.json").read_text())
    assert config["plugin"] == "none" and config["world_size"] == 1
    records = [json.loads(x) for x in (run_a / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [12, 24]
    assert all(r["peak_mem_gib"] > 0 and r["tokens_per_s"] > 0 for r in records
               if r["kind"] == "train")
    ckpts = run_a / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000024"
    assert not list(ckpts.glob("*.partial"))
    # The saved weights are a pretrained folder: --model-path (from_pretrained) loads them.
    model = ex.presets.build_model(None, 256, 128,
                                   model_path=str(ckpts / "step_00000024" / "model"))
    assert model.config.vocab_size == 256 and model.config.num_hidden_layers == 4
    # Resume from the middle checkpoint: the second half must repeat run A bit for bit.
    _run([sys.executable, str(SCRIPT), *FAST, "--steps", "24", "--out-dir", str(run_b),
          "--eval-every", "12", "--resume", str(ckpts / "step_00000012")], threads=2)
    losses_b = _losses(run_b)
    assert sorted(losses_b) == list(range(13, 25))
    assert {s: losses_a[s] for s in losses_b} == losses_b


def test_torchrun_zero2_fp8_fp8comm_two_ranks_trains_and_resumes_exactly(tmp_path):
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", str(SCRIPT), *FAST, "--steps", "24", "--plugin", "zero2",
                "--use-fp8", "--fp8-comm", "--grad-accum", "2"]
    _run(torchrun + ["--out-dir", str(run_a), "--save-every", "12"], threads=1)
    losses_a = _losses(run_a)
    assert sorted(losses_a) == list(range(1, 25))
    _assert_loss_falls(losses_a)
    config = json.loads((run_a / "run_config.json").read_text())
    assert config["world_size"] == 2 and config["use_fp8"] and config["fp8_comm"]
    ckpt = run_a / "checkpoints" / "step_00000012"
    assert (ckpt / "rng" / "rank0.pt").is_file() and (ckpt / "rng" / "rank1.pt").is_file()
    assert (ckpt / "model" / "model.safetensors.index.json").is_file()
    assert len(list((ckpt / "optimizer").glob("optimizer-rank*"))) == 2  # ZeRO shards
    # Same world size, same batches, gloo reductions in a fixed order: bit-exact again.
    _run(torchrun + ["--out-dir", str(run_b), "--resume", str(ckpt)], threads=1)
    losses_b = _losses(run_b)
    assert sorted(losses_b) == list(range(13, 25))
    assert {s: losses_a[s] for s in losses_b} == losses_b


def test_torchrun_mixtral_ep2_fp8_trains_and_resumes_exactly(tmp_path):
    """--model mixtral --plugin moe --ep 2: experts split over 2 ranks, FP8 GEMMs (emulated)
    and FP8 dispatch; the run reports its FP8 layers and resumes bit-exactly."""
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", str(SCRIPT), *FAST, "--steps", "16", "--model", "mixtral",
                "--plugin", "moe", "--ep", "2", "--use-fp8", "--fp8-comm"]
    out = _run(torchrun + ["--out-dir", str(run_a), "--save-every", "8"], threads=1)
    assert "plugin=moe(ep=2,zero=1)" in out
    # tiny: 4 layers; q/k/v/o per layer FP8, lm_head high precision; 2 of 4 experts per rank
    assert ("FP8 GEMMs: 16/17 linear layers, 4/4 expert layers (8 FP8 grouped GEMMs per "
            "forward, each over 2 of 4 experts on this rank)") in out
    losses_a = _losses(run_a)
    assert sorted(losses_a) == list(range(1, 17))
    assert all(math.isfinite(v) for v in losses_a.values())
    _assert_loss_falls(losses_a)
    config = json.loads((run_a / "run_config.json").read_text())
    assert config["ep"] == 2 and config["fp8_coverage"]["experts_fp8"] == 4
    ckpt = run_a / "checkpoints" / "step_00000008"
    subdirs = sorted(p.name for p in (ckpt / "optimizer").iterdir() if p.is_dir())
    assert subdirs == ["ep00000-of-00002", "ep00001-of-00002"]  # one optimizer per ep rank
    _run(torchrun + ["--out-dir", str(run_b), "--resume", str(ckpt)], threads=1)
    losses_b = _losses(run_b)
    assert sorted(losses_b) == list(range(9, 17))
    assert {s: losses_a[s] for s in losses_b} == losses_b


def test_torchrun_mixtral_ep2_compiled_matches_eager(tmp_path):
    """--plugin moe --compile (issue 34): each block compiles around the expert exchange (its
    all-to-alls are sized on the host: EpExperts runs eager, one graph break per MoE block);
    aot_eager gives the eager run's losses."""
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(SCRIPT), *FAST, "--steps", "4", "--model", "mixtral", "--plugin", "moe",
            "--ep", "2", "--use-fp8", "--fp8-comm", "--eval-every", "0"]
    _run(base + ["--out-dir", str(tmp_path / "eager")], threads=1)
    out = _run(base + ["--out-dir", str(tmp_path / "compiled"), "--compile",
                       "--compile-backend", "aot_eager"], threads=1)
    eager, compiled = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    assert sorted(compiled) == [1, 2, 3, 4], out[-3000:]
    proof = json.loads((tmp_path / "compiled" / "summary.json").read_text())["compile"]
    assert proof["graphs"] >= 2 and proof["graph_breaks"] >= 1, proof  # around the exchange
    for step, loss in eager.items():
        assert abs(compiled[step] - loss) <= 1e-4 * abs(loss), (step, loss, compiled[step])


def test_moe_families_at_preset_sizes(ex):
    """Every preset builds both MoE families with FP8-eligible expert shapes; experts
    divide a power-of-two --ep; FLOPs count the active experts only."""
    import moe
    import model_setup
    for preset in ex.presets.PRESETS:
        for family in moe.MOE_FAMILIES:
            cfg = model_setup.family_config(family, preset, 256, 128)
            fields = moe.moe_fields(family, preset)
            experts = fields.get("num_local_experts", fields.get("num_experts"))
            ffn = fields.get("moe_intermediate_size", fields.get("intermediate_size"))
            assert experts % 4 == 0 and ffn % 16 == 0, (family, preset)
            assert cfg.hidden_size == ex.presets.PRESETS[preset]["hidden_size"]
            assert cfg.num_experts_per_tok < experts
    model = ex.train.build_model(ex.train.parse_args(["--model", "qwen3_moe"]), 256, 128,
                                 torch.device("cpu"))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    fused = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    assert fused and moe.inactive_expert_params(model) == fused * (16 - 8) // 16
    cov = moe.fp8_coverage(model)  # before any conversion: nothing FP8, every layer counted
    assert cov["linear_fp8"] == cov["experts_fp8"] == 0 and cov["experts_total"] == 4


# --------------------------------------------------------------------------- pieces


def test_shipped_sample_is_plain_public_domain_text(ex):
    path = ex.data.default_data_path()
    raw = path.read_bytes()
    assert 100_000 <= len(raw) <= 300_000
    assert b"Gutenberg" not in raw and b"LICENSE" not in raw.upper()[:5000]
    assert raw.startswith(b"HAMLET") and raw.decode("ascii")
    ids = ex.data.ByteTokenizer().encode_file(path)
    assert ids.dtype == torch.uint8 and ids.numel() == len(raw)


def test_windows_are_deterministic_per_rank_and_step(ex):
    tokens = torch.arange(1000, dtype=torch.int32)
    w = ex.data.TokenWindows(tokens, seq_len=16, seed=3)
    a = w.batch(step=5, micro_step=1, rank=0, batch_size=4)
    assert a.shape == (4, 16) and a.dtype == torch.int64
    assert torch.equal(a, w.batch(step=5, micro_step=1, rank=0, batch_size=4))
    # contiguous windows of the stream
    assert torch.equal(a - a[:, :1], torch.arange(16).expand(4, 16))
    for other in (dict(step=6, micro_step=1, rank=0), dict(step=5, micro_step=0, rank=0),
                  dict(step=5, micro_step=1, rank=1)):
        assert not torch.equal(a, w.batch(batch_size=4, **other)), other
    with pytest.raises(ValueError, match="--seq-len"):
        ex.data.TokenWindows(torch.arange(10), seq_len=10)
    train, val = ex.data.split_train_val(tokens, 0.05, min_len=16)
    assert train.numel() == 950 and torch.equal(val, tokens[950:])
    assert ex.data.split_train_val(tokens, 0.05, min_len=64)[1] is None


def test_local_hf_tokenizer_folder(ex, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sample = ex.data.default_data_path()
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
    tok.train([str(sample)], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path)
    assert ex.data.has_tokenizer_files(tmp_path)
    hf = ex.data.load_tokenizer(str(tmp_path))
    ids = hf.encode_file(sample)
    assert hf.vocab_size == 300 and ids.dtype == torch.int32
    assert 0 < ids.numel() < len(sample.read_bytes()) and int(ids.max()) < 300
    assert "HAMLET" in hf.decode(ids[:10].tolist())
    with pytest.raises(ValueError, match="not a directory"):
        ex.data.load_tokenizer(str(tmp_path / "missing"))


def test_flops_and_params(ex):
    model = ex.presets.build_model("tiny", vocab_size=256, max_seq_len=128)
    total = sum(p.numel() for p in model.parameters())
    assert ex.metrics.matmul_params(model) == total - 256 * 128  # input embedding excluded
    n = ex.metrics.matmul_params(model)
    assert ex.metrics.flops_per_token(n, 4, 128, 128) == 6 * n + 12 * 4 * 128 * 128
    cfg = ex.presets.build_llama_config("7b-8l", vocab_size=32000)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
            cfg.num_attention_heads) == (4096, 11008, 8, 32)
    for name, shape in ex.presets.PRESETS.items():  # every linear dim FP8-eligible
        assert shape["hidden_size"] % 16 == 0 and shape["intermediate_size"] % 16 == 0, name
    with pytest.raises(ValueError, match="unknown model preset"):
        ex.presets.build_llama_config("13b", vocab_size=256)


def test_cosine_schedule_with_warmup(ex):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = ex.train.cosine_with_warmup(opt, warmup=4, total=20, min_ratio=0.1)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0) and all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


@pytest.mark.parametrize("argv, match", [
    (["--steps", "0"], "--steps"),
    (["--grad-accum", "0"], "--grad-accum"),
    (["--seq-len", "1"], "--seq-len"),
    (["--lr", "0"], "--lr"),
    (["--max-norm", "-1"], "--max-norm"),
    (["--fp8-comm"], "--fp8-comm needs a distributed plugin"),
    (["--use-fp8", "--precision", "fp16"], "--precision bf16"),
    (["--data", "/nonexistent.txt"], "is not a file"),
    (["--model-path", "/nonexistent"], "not a directory"),
    (["--resume", "/nonexistent"], "not a complete checkpoint"),
    # pipeline parallelism (--pp): --plugin hybrid cases run on 4 ranks unless they say
    (["--pp", "2"], "--pp is an option of --plugin hybrid"),
    (["--plugin", "zero1", "--microbatches", "2"], "--microbatches is an option of --plugin hybrid"),
    (["--plugin", "hybrid", "--pp-style", "zbv"], "--pp-style configure a pipeline"),
    (["--plugin", "hybrid", "--pp", "2", "--tp", "2", "world=2"], "--pp 2 = 4 ranks"),
    (["--plugin", "hybrid", "--pp", "3"], "--tp 1 x --pp 3 = 3 ranks per model replica"),
    (["--plugin", "hybrid", "--pp", "2", "--zero", "2"], "needs --zero 0 or 1"),
    (["--plugin", "hybrid", "--pp", "4", "--pp-style", "interleaved"],
     "4 decoder layers do not split evenly over --pp 4 x 2 chunks"),
    (["--plugin", "hybrid", "--pp", "2", "--model", "gpt2"], "--model gpt2 is not one"),
    (["--plugin", "hybrid", "--pp", "2", "--microbatches", "3"],
     "--microbatches 3 must be >= 1 and divide the step's 8 rows"),
    (["--plugin", "hybrid", "--pp", "4", "--microbatches", "2", "--preset", "small"],
     "--pp-style 1f1b needs --microbatches >= --pp"),
    (["--plugin", "hybrid", "--pp", "2", "--batch-size", "3"], "no micro-batch count divides"),
    # mixture of experts (--plugin moe, --ep)
    (["--plugin", "zero2", "--ep", "2", "world=2"], "--ep configures --plugin moe"),
    (["--plugin", "moe", "--ep", "2", "world=2"], "--model llama is dense"),
    (["--plugin", "moe", "--model", "mixtral", "--ep", "2", "world=3"],
     "--ep 2 must divide the number of ranks"),
    (["--plugin", "moe", "--model", "mixtral", "--ep", "8", "world=8"],
     "must divide the model's 4 experts"),
    (["--plugin", "moe", "--model", "mixtral", "--ep", "0"], "--ep must be >= 1"),
    (["--plugin", "moe", "--model", "mixtral", "--tp", "2", "world=2"],
     "--tp is an option of --plugin hybrid"),
    (["--plugin", "hybrid", "--tp", "2", "--fp8-head", "rowwise", "world=2"],
     "--fp8-head is wired for --plugin none"),
    # --fp8-option FIELD=VALUE
    (["--fp8-option", "fp8_format=hybrid"], "--fp8-option sets a field of the FP8 recipe"),
    (["--use-fp8", "--fp8-option", "fp8_fromat=hybrid"], "expected FIELD=VALUE with FIELD one"),
    (["--use-fp8", "--fp8-option", "margin"], "expected FIELD=VALUE"),
    (["--use-fp8", "--fp8-option", "fp8_format=e3m4"], "fp8_format='e3m4' is not supported"),
])
def test_bad_arguments_raise_before_any_work(ex, argv, match):
    world = 4 if "hybrid" in argv else 1  # "world=N" in a case: N ranks
    world = next((int(a[6:]) for a in argv if a.startswith("world=")), world)
    argv = [a for a in argv if not a.startswith("world=")]
    args = ex.train.parse_args(argv)
    with pytest.raises(ValueError, match=match):
        ex.train.validate_args(args, world_size=world)


def test_pipeline_defaults_and_gradient_accumulation_map_onto_micro_batches(ex):
    """--microbatches defaults to a multiple of --pp >= --grad-accum dividing the step's rows:
    the smallest with 4 per stage, else the largest (a small bubble); --grad-accum joins its
    batches into the pipeline's step batch."""
    hybrid = ["--plugin", "hybrid", "--pp", "2"]
    for extra, want in (([], 8), (["--grad-accum", "3"], 8), (["--batch-size", "6"], 6),
                        (["--pp", "4"], 8), (["--batch-size", "16"], 8),
                        (["--batch-size", "2"], 2), (["--grad-accum", "3", "--batch-size", "1"], None),
                        (["--pp-style", "zbv", "--batch-size", "4", "--grad-accum", "2"], 8)):
        if want is None:  # 3 rows: no multiple of --pp 2 divides them
            args = ex.train.parse_args(hybrid + extra)
            assert args.microbatches is None, extra
            continue
        args = ex.train.parse_args(hybrid + extra)
        ex.train.validate_args(args, world_size=4)
        assert args.microbatches == want, extra
    assert ex.train.parse_args(["--plugin", "hybrid"]).microbatches is None
    args = ex.train.parse_args(hybrid + ["--grad-accum", "3", "--batch-size", "2"])
    import hybrid as hy
    windows = ex.data.TokenWindows(torch.arange(1000), seq_len=16, seed=0)
    batch = hy.step_batch(windows, args, step=5, index=1, vocab_size=1000)
    assert batch.shape == (6, 16)
    assert torch.equal(batch[2:4], windows.batch(5, 1, 1, 2))  # grad-accum micro-step 1
    assert [hy.data_rank(args, r, 8) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    args = ex.train.parse_args(["--plugin", "hybrid", "--tp", "2", "--pp", "2"])
    assert [hy.data_rank(args, r, 8) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_plugin_none_rejects_several_ranks(ex):
    with pytest.raises(ValueError, match="--plugin ddp, zero1, zero2, gemini, fsdp or hybrid"):
        ex.train.validate_args(ex.train.parse_args([]), world_size=2)


def test_preset_defaults_fill_unset_options(ex):
    args = ex.train.parse_args(["--preset", "7b-8l"])
    assert (args.seq_len, args.batch_size) == (4096, 2)
    args = ex.train.parse_args(["--steps", "40"])
    assert (args.seq_len, args.steps, args.warmup_steps) == (128, 40, 2)


def test_checkpoint_resolution(ex, tmp_path):
    step = tmp_path / "step_00000007"
    step.mkdir()
    (step / "trainer_state.json").write_text(json.dumps({"step": 7}))
    (tmp_path / "latest").write_text("step_00000007")
    assert ex.checkpointing.resolve_checkpoint(step) == step
    assert ex.checkpointing.resolve_checkpoint(tmp_path) == step
    (tmp_path / "step_00000009.partial").mkdir()  # a save that died: never picked
    assert ex.checkpointing.resolve_checkpoint(tmp_path) == step
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ex.checkpointing.resolve_checkpoint(tmp_path / "step_00000009.partial")
    (step / "trainer_state.json").write_text(json.dumps({"step": 7, "preset": "small"}))
    with pytest.raises(ValueError, match="--preset small"):
        ex.train.check_resume(ex.train.parse_args(["--resume", str(tmp_path)]))
    with pytest.raises(ValueError, match="raise --steps"):
        ex.train.check_resume(ex.train.parse_args(["--resume", str(step), "--preset", "small",
                                                   "--steps", "7"]))
    ex.train.check_resume(ex.train.parse_args(["--resume", str(step), "--preset", "small"]))


def test_loss_plot_or_single_warning(ex, tmp_path):
    jsonl = tmp_path / "m.jsonl"
    writer = ex.metrics.MetricsWriter(jsonl)
    for s in range(1, 4):
        writer.write(dict(kind="train", step=s, loss=5.0 - s))
    writer.write(dict(kind="eval", step=3, val_loss=2.5))
    writer.close()
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.warns(UserWarning, match="matplotlib is not installed"):
            assert ex.metrics.plot_loss_curve(jsonl, tmp_path / "loss.png") is None
    else:
        assert ex.metrics.plot_loss_curve(jsonl, tmp_path / "loss.png").stat().st_size > 1000


# --------------------------------------------------------------------------- bench/train.py


def _bench():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "bench" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_options_and_table():
    bench = _bench()
    args = bench.parse_args([])
    assert args.preset == "7b-8l" and (args.batch_size, args.seq_len) == (2, 4096)
    assert "fsdp2_bf16" in args.configs and "zero2_fp8_comm" in args.configs
    info = bench.model_info(args)  # meta device: no memory
    assert info["params"] > 1.8e9 and info["flops_per_token"] > 6 * info["matmul_params"]
    with pytest.raises(ValueError, match="unknown configs"):
        bench.validate(bench.parse_args(["--configs", "zero3_bf16"]), 1)
    with pytest.raises(ValueError, match="without torchrun"):
        bench.validate(bench.parse_args(["--configs", "single_fp8"]), 2)
    results = [dict(config="fsdp2_bf16", status="ok", tokens_per_s_per_gpu=100.0),
               dict(config="zero2_bf16", status="ok", tokens_per_s_per_gpu=120.0),
               dict(config="zero2_fp8", status="ok", tokens_per_s_per_gpu=180.0),
               dict(config="ddp_fp8", status="oom", error="CUDA out of memory")]
    bench.add_speedups(results)
    assert results[2]["speedup_vs_fsdp2_bf16"] == pytest.approx(1.8)
    assert results[2]["speedup_vs_own_bf16"] == pytest.approx(1.5)
    for r in results[:3]:
        r.update(tflops_per_gpu=1.0, peak_mem_gib=2.0, finite=True)
    report = dict(device="cpu", world_size=2, model=info, batch_size=2, seq_len=4096,
                  steps=20, warmup=5, results=results)
    table = bench.format_table(report)
    assert "zero2_fp8" in table and "1.50x" in table and "oom" in table


def test_gemini_meta_init_loads_pretrained_like_a_full_load(tmp_path):
    """--plugin gemini --model-path builds on the meta device and reads only its shards; its
    first loss equals the fully loaded model's (same batch, BF16 compute: 1e-2 relative)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2))
    folder = tmp_path / "pretrained"
    model.save_pretrained(folder)
    first = {}
    for plugin in ("none", "gemini"):
        out_dir = tmp_path / plugin
        _run([sys.executable, str(SCRIPT), *FAST, "--steps", "3", "--plugin", plugin,
              "--model-path", str(folder), "--out-dir", str(out_dir)], threads=2)
        first[plugin] = _losses(out_dir)[1]
    assert abs(first["gemini"] - first["none"]) / first["none"] < 1e-2, first


def test_fp8_recipe_option_builds_that_recipe(ex, tmp_path, monkeypatch):
    from fp8boost.fp8 import Fp8Config

    built = []
    real = Fp8Config.from_recipe.__func__

    def spy(cls, name, **kw):
        built.append(name)
        return real(cls, name, **kw)

    monkeypatch.setattr(Fp8Config, "from_recipe", classmethod(spy))
    ex.train.train(ex.train.parse_args([*FAST, "--use-fp8", "--fp8-recipe", "delayed",
                                        "--steps", "3", "--eval-every", "0",
                                        "--out-dir", str(tmp_path)]))
    assert built == ["delayed"]
    assert json.loads((tmp_path / "run_config.json").read_text())["fp8_recipe"] == "delayed"
    assert len(_losses(tmp_path)) == 3


def test_fp8_option_overrides_the_recipe_field(ex, tmp_path, monkeypatch):
    from fp8boost.fp8 import Fp8Config

    built = []
    real = Fp8Config.from_recipe.__func__

    def spy(cls, name, **kw):
        cfg = real(cls, name, **kw)
        built.append(cfg)
        return cfg

    monkeypatch.setattr(Fp8Config, "from_recipe", classmethod(spy))
    ex.train.train(ex.train.parse_args([*FAST, "--use-fp8", "--fp8-recipe", "rowwise",
                                        "--fp8-option", "fp8_format=hybrid",
                                        "--fp8-option", "power_of_2_scale=false",
                                        "--steps", "2", "--eval-every", "0",
                                        "--out-dir", str(tmp_path)]))
    cfg = built[-1]  # the booster's (validation builds one first)
    assert (cfg.recipe, cfg.fp8_format, cfg.power_of_2_scale) == ("rowwise", "hybrid", False)
    assert len(_losses(tmp_path)) == 2


def test_fp8_head_option_runs_the_fp8_head(ex, tmp_path, monkeypatch):
    from fp8boost.loss import fp8_head

    recipes = []
    real = fp8_head.head_config

    def spy(recipe):
        recipes.append(recipe)
        return real(recipe)

    monkeypatch.setattr(fp8_head, "head_config", spy)
    monkeypatch.setattr("fp8boost.loss.linear_cross_entropy.head_config", spy)
    ex.train.train(ex.train.parse_args([*FAST, "--fp8-head", "blockwise", "--steps", "2",
                                        "--eval-every", "0", "--out-dir", str(tmp_path)]))
    assert recipes and set(recipes) == {"blockwise"}  # every training step's head was FP8
    assert len(_losses(tmp_path)) == 2
