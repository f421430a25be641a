"""Issue 39 ("the first ten minutes, again") for examples/train_llama.py: one run per
``--out-dir``, ``--resume auto`` following ``latest``, no duplicate metrics rows after a resume,
the quick CPU default, Ctrl-C and SIGTERM (also under torchrun), the inputs that printed a
traceback or were accepted silently, one-line warnings and the quiet KV-cache notice. Each test
failed before its fix.

A refused command line must be one line naming the cause and the fix, exit status 2, no
traceback, and (where the check needs no model) come before the model is built: the run's
first ``[train]`` line (``... params``) is never printed. Subprocess runs are a few steps of
the tiny preset on 16-token sequences (~3-6 s each on a 2-core CPU, mostly imports).
"""
from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.examples.example_env import ROOT, SCRIPT, SHORT, example_modules


@pytest.fixture(scope="module")
def ex():
    """The example's modules, imported the way the script imports them."""
    with example_modules("checkpointing", "interrupts", "presets", "run_checks",
                         "train_llama") as (ckpt, interrupts, presets, checks, tl):
        yield SimpleNamespace(checkpointing=ckpt, interrupts=interrupts, presets=presets,
                              run_checks=checks, train=tl)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _launch(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *SHORT, *argv], cwd=ROOT, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=240)


def _train(*argv: str) -> str:
    proc = _launch(*argv)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def _assert_refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2, one error line holding ``words``, no traceback, no model built."""
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert "Traceback" not in proc.stdout, proc.stdout
    assert "params, model=" not in proc.stdout, proc.stdout  # refused before the model
    errors = [line for line in proc.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1 and all(w in errors[0] for w in words), proc.stdout
    return errors[0]


def _duplicates(out_dir: Path) -> list:
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    counts = collections.Counter((r["kind"], r["step"]) for r in rows)
    return [key for key, n in counts.items() if n > 1]


# ---------------------------------------------------------------- item 1: one run per folder


def test_reused_out_dir_is_refused_and_resume_auto_follows_latest(tmp_path):
    run = tmp_path / "d"
    _train("--steps", "4", "--save-every", "2", "--out-dir", str(run))
    # The second command: the same folder without --resume mixed two runs.
    line = _assert_refused(_launch("--steps", "2", "--save-every", "1", "--out-dir", str(run)),
                           "already holds a run", "--resume auto", "new --out-dir")
    assert "step_00000004" in line
    # Checkpoints alone in a --save-dir are a run too.
    _assert_refused(_launch("--steps", "2", "--out-dir", str(tmp_path / "e"), "--save-dir",
                            str(run / "checkpoints")), "--save-dir", "already holds a run")
    # Continue from step 2 to 3: latest names step 3, step 4 is the first attempt's leftover.
    ckpts = run / "checkpoints"
    _train("--steps", "3", "--save-every", "3", "--out-dir", str(run), "--resume",
           str(ckpts / "step_00000002"))
    assert (ckpts / "latest").read_text().strip() == "step_00000003"
    out = _train("--steps", "5", "--out-dir", str(run), "--resume", "auto")
    assert f"resumed from {ckpts / 'step_00000003'} (step 3)" in out, out  # was: step 4
    assert _duplicates(run) == []  # was: steps 3 and 4 twice


def test_auto_candidates_start_at_latest_and_never_take_a_later_leftover(ex, tmp_path):
    for step in (1, 2, 3):
        folder = tmp_path / f"step_{step:08d}"
        folder.mkdir()
        (folder / ex.checkpointing.STATE_FILE).write_text(json.dumps({"step": step}))
    names = lambda paths: [p.name for p in paths]  # noqa: E731
    assert names(ex.checkpointing.auto_candidates(tmp_path)) == [
        "step_00000003", "step_00000002", "step_00000001"]  # no latest: newest first
    (tmp_path / ex.checkpointing.LATEST_FILE).write_text("step_00000002")
    assert names(ex.checkpointing.auto_candidates(tmp_path)) == ["step_00000002",
                                                                 "step_00000001"]
    # --keep-last keeps the checkpoint latest names, not the leftover numbered past it.
    ex.checkpointing.prune_checkpoints(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "step_00000002", "step_00000003"]


def test_refusal_comes_before_the_model_and_allows_resume_and_empty_folders(ex, tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    args = ex.train.parse_args(["--out-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="already holds a run \\(metrics.jsonl\\)"):
        ex.train.validate_args(args, 1)
    ex.train.validate_args(ex.train.parse_args(["--out-dir", str(tmp_path), "--resume",
                                                "auto"]), 1)  # torchrun --max-restarts
    ex.train.validate_args(ex.train.parse_args(["--out-dir", str(tmp_path / "new")]), 1)


# ------------------------------------------------------------ item 2: a quick main command


def test_tiny_preset_trains_cpu_steps_on_cpu_and_the_readme_says_so(ex, monkeypatch):
    """Without a GPU (or with --device cpu) and without --steps the tiny preset trains
    CPU_STEPS; --steps, another preset and --model-path keep their own counts."""
    parse, presets = ex.train.parse_args, ex.presets
    cpu, gpu = presets.CPU_STEPS["tiny"], presets.TRAIN_DEFAULTS["tiny"]["steps"]
    assert cpu < gpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = parse(["--use-fp8"])  # the README's main command
    assert (args.steps, args.warmup_steps, args.eval_every) == (cpu, cpu // 20, cpu // 10)
    assert parse(["--steps", "7"]).steps == 7
    assert parse(["--preset", "small"]).steps == presets.TRAIN_DEFAULTS["small"]["steps"]
    assert parse(["--model-path", "m"]).steps == ex.train.PRETRAINED_DEFAULTS["steps"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parse([]).steps == gpu and parse(["--device", "cpu"]).steps == cpu
    assert parse(["--steps", "7", "--device", "cpu"]).steps == 7
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"({cpu} steps; the tiny preset trains {gpu} on a GPU)" in readme
    with example_modules("cli") as (cli,):
        assert f"tiny {gpu} ({cpu} on CPU)" in " ".join(cli.build_parser().format_help().split())


# --------------------------------------------------------------- item 3: no more tracebacks


@pytest.mark.parametrize("argv, words", [
    (["--val-fraction", "1.5"], ["--val-fraction must be in [0, 1), got 1.5", "e.g. 0.05"]),
    (["--tokenizer", "/nonexistent"], ["--tokenizer '/nonexistent' does not exist",
                                       "leave --tokenizer out"]),
    (["--tokenizer", "{tmp}"], ["holds no tokenizer.json", "save_pretrained"]),
    (["--out-dir", "{tmp}/file"], ["is a file, not a folder", "pass a folder path"]),
    (["--out-dir", "{tmp}/file/run"], ["lies under the file", "pass a folder path"]),
    (["--data", "{tmp}/garbage.bin"], ["is not UTF-8 text", "pass a UTF-8 text file"]),
    (["--warmup-steps", "500", "--steps", "2"], ["--warmup-steps 500 is more than --steps 2",
                                                 "pass --warmup-steps 1 or less"]),
])
def test_bad_input_is_one_line_before_the_model(tmp_path, argv, words):
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "garbage.bin").write_bytes(bytes(range(256)) * 64)  # 0x80..: never UTF-8
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    _assert_refused(_launch(*argv, "--steps", "2"), *words)


def test_truncated_file_in_an_explicit_resume_folder_is_one_line(ex, tmp_path):
    _train("--steps", "2", "--save-every", "2", "--out-dir", str(tmp_path / "a"))
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000002"
    weights = next((ckpt / "model").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    _assert_refused(_launch("--steps", "4", "--out-dir", str(tmp_path / "b"), "--resume",
                            str(ckpt)), f"{weights} has 100 bytes", "truncated",
                    "restore these files")
    state = ckpt / ex.checkpointing.STATE_FILE
    state.write_text(state.read_text()[:10])
    _assert_refused(_launch("--steps", "4", "--out-dir", str(tmp_path / "c"), "--resume",
                            str(ckpt)), f"{state} is truncated", "--resume auto")


def _interrupt(cmd: list[str], run: Path, signum: int) -> subprocess.CompletedProcess:
    """Start ``cmd``, send it ``signum`` a few steps after its first checkpoint, and wait."""
    # SIGINT as a terminal sends it (a background job's SIGINT may be ignored: restore it).
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 180
        latest = run / "checkpoints" / "latest"
        while not latest.is_file() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(0.5)  # a few steps past the checkpoint
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # a hung run must not outlive the test
            proc.kill()
            out, _ = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def _assert_partial_run(out: str, run: Path, cause: str) -> dict:
    """One line naming ``cause`` and the checkpoint to resume from; metrics.jsonl,
    summary.json, loss.png and that checkpoint all valid and agreeing on the last step."""
    lines = [line for line in out.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and f"[train] interrupted ({cause}) after step" in lines[0], out
    assert "--resume auto continues from step_" in lines[0], out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert steps == list(range(1, len(steps) + 1)), steps  # every step once, the last whole
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and summary["end_step"] == summary["steps_run"] == steps[-1]
    assert f"after step {steps[-1]} of" in lines[0]
    with example_modules("checkpointing") as (ckpt,):
        newest = ckpt.latest_complete(run / "checkpoints")
    assert newest is not None and lines[0].endswith(f"continues from {newest.name}"), out
    assert (run / "loss.png").is_file() or "matplotlib is not installed" in out
    return summary


def test_ctrl_c_saves_the_partial_run_and_a_resume_logs_no_step_twice(tmp_path):
    run = tmp_path / "run"
    proc = _interrupt([sys.executable, str(SCRIPT), *SHORT, "--steps", "100000",
                       "--save-every", "20", "--out-dir", str(run), "--log-every", "100000"],
                      run, signal.SIGINT)
    assert proc.returncode == 130, proc.stdout
    assert "Traceback" not in proc.stdout, proc.stdout  # was: an 83-line traceback
    summary = _assert_partial_run(proc.stdout, run, "Ctrl-C")
    assert summary["end_step"] > 20
    # Resuming logs the steps after the checkpoint again: each must appear once.
    resumed = _train("--steps", str(summary["end_step"] + 2), "--out-dir", str(run),
                     "--resume", "auto")
    assert "resumed from" in resumed
    assert _duplicates(run) == []


def test_sigterm_takes_the_ctrl_c_path(tmp_path):
    """SIGTERM (a scheduler's stop; what torchrun forwards when it is stopped) killed the run
    at once, with no summary.json or loss.png and no line saying what happened."""
    run = tmp_path / "run"
    proc = _interrupt([sys.executable, str(SCRIPT), *SHORT, "--device", "cpu", "--steps",
                       "1000", "--save-every", "2", "--out-dir", str(run)], run,
                      signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout  # was: -15, killed
    assert "Traceback" not in proc.stdout, proc.stdout
    _assert_partial_run(proc.stdout, run, "SIGTERM")


def test_sigterm_under_torchrun_stops_both_ranks_after_the_same_step(tmp_path):
    """torchrun forwards its SIGTERM to every rank (which it killed at once, with no records);
    the ranks stop after the same step (a rank leaving mid-collective would leave its peer
    waiting in it) and rank 0 writes the partial run's records."""
    run = tmp_path / "run"
    proc = _interrupt([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node=2", str(SCRIPT), *SHORT, "--plugin", "ddp",
                       "--device", "cpu", "--steps", "1000", "--save-every", "2", "--out-dir",
                       str(run)], run, signal.SIGTERM)
    out = proc.stdout
    assert proc.returncode != 0, out
    assert out.count("closing signal SIGTERM") == 2, out  # torchrun forwarded it to each rank
    assert 'train_llama.py", line' not in out, out  # torchrun's own traceback only
    _assert_partial_run(out, run, "SIGTERM")


def test_a_stop_signal_waits_for_the_step_and_a_second_one_stops_at_once(ex):
    """Unit level: inside the training steps the first SIGINT/SIGTERM is only recorded, a
    second raises; outside them SIGTERM raises as SIGINT does; handlers are restored after."""
    interrupts = ex.interrupts
    before = signal.getsignal(signal.SIGTERM)
    with interrupts.deferred_stop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM  # recorded, nothing raised
        with pytest.raises(interrupts.SignalInterrupt) as second:
            os.kill(os.getpid(), signal.SIGTERM)  # (SIGINT may be ignored in a background job)
    assert second.value.signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(KeyboardInterrupt) as exc, interrupts.sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
    assert interrupts.exit_status(exc.value) == 143 and signal.getsignal(signal.SIGTERM) is before
    assert interrupts.exit_status(KeyboardInterrupt()) == 130  # Python's own Ctrl-C
    assert [interrupts.signal_name(s) for s in (signal.SIGINT, signal.SIGTERM)] == [
        "Ctrl-C", "SIGTERM"]


def test_a_rank_stuck_after_a_stop_signal_is_ended_by_the_watchdog():
    """A rank blocked where no handler runs (a collective whose peer died: torchrun SIGTERMs
    the survivors before a restart) exits STOP_GRACE_S after the signal, not 30 s later by
    torchrun's SIGKILL; a rank that leaves its steps in time is left alone."""
    code = f"""if True:
        import os, signal, sys, time
        sys.path.insert(0, {str(ROOT / "examples")!r})
        import interrupts
        with interrupts.deferred_stop(grace_s=0.5) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
        time.sleep(1.0)  # past the grace: the watchdog stood down
        print("left in time", stop.signum == signal.SIGTERM, flush=True)
        with interrupts.deferred_stop(grace_s=0.5, rank=1):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # stands for the collective that never returns
        print("not reached", flush=True)
        """
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 128 + signal.SIGTERM, (proc.stdout, proc.stderr)
    assert proc.stdout == "left in time True\n", proc.stdout
    assert "rank 1: SIGTERM received, but the step did not end within 0.5 s" in proc.stderr


# ---------------------------------------------------------- item 4: nothing accepted silently


def test_keep_last_1_and_a_missing_validation_split_say_why(tmp_path):
    data = tmp_path / "short.txt"
    data.write_text("to be or not to be, that is the question. " * 60)  # 2640 bytes
    out = _train("--data", str(data), "--seq-len", "200", "--batch-size", "1", "--steps", "1",
                 "--save-every", "1", "--keep-last", "1", "--out-dir", str(tmp_path / "r"))
    notes = [line for line in out.splitlines() if line.startswith("[train] note:")]
    assert any("--keep-last 1" in n and "--keep-last 2 or more" in n for n in notes), out
    assert any("no validation" in n and "shorter than one window of --seq-len 200" in n
               and "lower --seq-len or raise --val-fraction" in n for n in notes), out
    assert "validation n/a" in out


def test_long_sequences_are_explained_or_refused(ex, tmp_path):
    args = ex.train.parse_args(["--seq-len", "100000"])
    run = SimpleNamespace(flops_per_token=6e8, val_note=None)
    notes = ex.run_checks.start_notes(args, run, SimpleNamespace(type="cpu"), 8 * 100000)
    assert any("TFLOP" in n and "square of --seq-len" in n and "lower --seq-len" in n
               for n in notes), notes
    assert ex.run_checks.start_notes(ex.train.parse_args([]), SimpleNamespace(
        flops_per_token=6e6, val_note=None), SimpleNamespace(type="cpu"), 1024) == []
    (tmp_path / "config.json").write_text(json.dumps({"n_positions": 1024}))
    with pytest.raises(ValueError, match="--seq-len 100000 is longer than the 1024 positions"
                                         ".*pass --seq-len 1024 or less"):
        ex.run_checks.check_positions(str(tmp_path), 100000)


def test_progress_prints_lines_not_a_bar_into_a_log(capsys, monkeypatch):
    """Redirected output (stderr not a terminal) gets plain progress lines, no tqdm carriage
    returns; a terminal gets the bar (issue 39 item 6)."""
    with example_modules("metrics") as (metrics,):
        pass
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    bar = metrics.Progress(total=4, print_every=2)
    assert bar.bar is None
    for step in range(1, 5):
        bar.update(step, {"loss": 1.0})
    bar.close()
    out = capsys.readouterr()
    assert "[train] step 2/4" in out.out and "[train] step 4/4" in out.out and "\r" not in out.err
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bar = metrics.Progress(total=4)
    assert bar.bar is not None
    bar.close()


def test_warnings_print_one_line_without_a_source_line(ex):
    """The emulation warning printed the line of code it pointed at below it, which read as a
    stray source line in the run's output (issue 39 item 6)."""
    def shown() -> str:  # what Python prints (pytest replaces showwarning, not this)
        return warnings.formatwarning(UserWarning("fp8boost: FP8 tensor cores unavailable"),
                                      UserWarning, __file__, 1)  # line 1 has source text

    assert shown().count("\n") == 2  # Python's own format: the message, then the line
    with ex.train.one_line_warnings():
        assert shown() == f"{__file__}:1: UserWarning: fp8boost: FP8 tensor cores unavailable\n"
    assert shown().count("\n") == 2  # restored


def test_kv_cache_notice_is_debug_only(ex, caplog):
    """Boosting the example's model turns the KV cache off with one DEBUG record, not a
    warning on every run (issue 39 item 6); the default logging shows WARNING and up only."""
    from fp8boost import _state

    with example_modules("booster_setup") as (setup,):
        pass
    args = ex.train.parse_args(["--use-fp8", "--device", "cpu"])
    model = ex.train.build_model(args, 256, 64, torch.device("cpu"))
    assert model.config.use_cache  # transformers' default: there is something to turn off
    _state.forget_logged(("kv-cache-off", type(model).__name__))  # logged once per process
    booster = setup.make_booster(args, torch.device("cpu"))
    with caplog.at_level(logging.DEBUG, logger="fp8boost"):
        booster.boost(model, torch.optim.AdamW(model.parameters()))
    notices = [r for r in caplog.records if "use_cache=False" in r.getMessage()]
    assert [r.levelno for r in notices] == [logging.DEBUG], caplog.text
    assert not model.config.use_cache


def test_fp8_reduce_scatter_is_a_flag_the_messages_can_point_at(ex):
    """The comm reports say "fp8_reduce_scatter=True is for slow links"; the command line can
    now set it (issue 39 item 6), and refuses it where it has no meaning."""
    tl = ex.train
    args = tl.parse_args(["--plugin", "zero2", "--fp8-comm", "--fp8-reduce-scatter"])
    tl.validate_args(args, 2)
    with example_modules("booster_setup") as (setup,):
        plugin = setup.make_plugin(args, None)
    assert plugin.fp8_reduce_scatter and plugin.fp8_communication
    for argv, match in ((["--plugin", "zero2", "--fp8-reduce-scatter"], "needs --fp8-comm"),
                        (["--plugin", "ddp", "--fp8-comm", "--fp8-reduce-scatter"],
                         "applies to --plugin zero1")):
        with pytest.raises(ValueError, match=match):
            tl.validate_args(tl.parse_args(argv), 2)


def test_coverage_line_and_plot_title_say_what_they_count(tmp_path, monkeypatch):
    """Under --pp the FP8 coverage counts one rank's stage and says so; the plot title names
    model, size, layout and numerics (was "tiny none fp8"; issue 39 item 7)."""
    with example_modules("moe", "run_log", "train_llama") as (moe, run_log, tl):
        cov = dict(linear_fp8=14, linear_total=14, experts_fp8=0, experts_total=0,
                   expert_gemms_fp8=0, local_experts=0, num_experts=0)
        assert moe.describe_coverage(cov) == "FP8 GEMMs: 14/14 linear layers"
        assert "of this rank's pipeline stage (the model is split over 2)" in \
            moe.describe_coverage(cov, pp=2)
        args = tl.parse_args(["--use-fp8"])
        seen = {}
        monkeypatch.setattr(run_log.metrics_lib, "plot_loss_curve",
                            lambda src, dst, title: seen.setdefault("t", title))
        run_log._plot(tmp_path, args)
    assert seen["t"] == "llama tiny, one process, bf16 + FP8 GEMMs"


_NCCL_STUCK_RANK = """if True:
    import os, signal, sys, time
    import torch, torch.distributed as dist
    sys.path.insert(0, {examples!r})
    import interrupts
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    assert x.item() == 2.0  # the group works before the peer dies
    if rank == 1:
        print("rank 1: dying", flush=True)
        os._exit(3)  # a crash: torchrun then sends SIGTERM to rank 0
    print(f"rank 0: waiting at {{time.time():.3f}}", flush=True)
    with interrupts.deferred_stop(grace_s={grace}, rank=rank):
        while True:  # rank 0 waits in a collective whose peer is gone
            dist.all_reduce(x)
            x.item()
    print("not reached", flush=True)
"""


@pytest.mark.multigpu
def test_a_rank_stuck_in_an_nccl_collective_is_ended_by_the_watchdog(tmp_path):
    """The NCCL side of the watchdog (device machine, 2 GPUs): rank 1 dies, rank 0 sits in an
    NCCL all-reduce (its host thread blocked in the CUDA sync of ``.item()``, where no Python
    handler runs) and torchrun sends it SIGTERM. The watchdog ends rank 0 ``grace`` seconds
    later with its one line, instead of torchrun's SIGKILL 30 s later (or NCCL's 10-minute
    timeout)."""
    grace = 3.0
    script = tmp_path / "stuck_rank.py"
    script.write_text(_NCCL_STUCK_RANK.format(examples=str(ROOT / "examples"), grace=grace))
    env = dict(_env(), NCCL_NVLS_ENABLE="0", CUDA_VISIBLE_DEVICES=os.environ.get(
        "CUDA_VISIBLE_DEVICES", "0,1"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(script)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=180)
    ended, out = time.time(), proc.stdout
    assert proc.returncode != 0 and "rank 1: dying" in out, out[-4000:]
    assert (f"[train] rank 0: SIGTERM received, but the step did not end within {grace:g} s"
            in out), out[-4000:]
    assert "not reached" not in out, out[-4000:]
    # From rank 0's wait to torchrun's exit: grace + torchrun noticing rank 1 (its monitor
    # polls every few seconds at most); torchrun's own SIGKILL would come 30 s after SIGTERM.
    waited = float(out.split("rank 0: waiting at ")[1].split()[0])
    assert ended - waited < grace + 20, (ended - waited, out[-4000:])
