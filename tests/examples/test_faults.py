"""Fault tolerance of examples/train_llama.py (issue 14) and the helpers behind it.

* One ``torchrun --max-restarts 5`` launch (``fault_driver.py``): in each plugin's run
  (ddp, zero2 + FP8, gemini, fsdp, hybrid tp 2) rank 1 of 2 really dies mid-step
  (``os._exit``), torchrun restarts the job, the restarted workers re-form the process group
  and the run resumes with ``--resume auto``. The final checkpoints (model
  export and optimizer state, FP32 masters included) must equal the uninterrupted runs' bit for
  bit, and so must every logged loss (same process layout, gloo, deterministic CPU kernels).
* ``--resume auto`` skips a checkpoint that fails verification for the next older one.
* Bad data: empty/short files and out-of-vocabulary ids are refused before any work.
* ``--tensorboard``: writes events when tensorboard is installed, else a clear error.
"""
from __future__ import annotations

import builtins
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
PLUGINS = ("ddp", "gemini", "fsdp", "hybrid", "zero2")  # each loses rank 1, in its own attempt
STEPS, SAVE, CRASH = 6, 2, 5  # rank 1 dies in step 5: the restart resumes from step 4


@pytest.fixture(scope="module")
def ex():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import checkpointing
        import data
        import run_setup
        import train_llama
        yield type("Ex", (), dict(data=data, checkpointing=checkpointing, train=train_llama,
                                  run_setup=run_setup))
    finally:
        sys.path.remove(str(EXAMPLES))


def _losses(out_dir: Path) -> dict[int, float]:
    """Train losses by step; a step logged again after a restart keeps its later record."""
    records = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint part: safetensors files, or a DCP directory."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({f"{f.name}/{k}": v for k, v in load_file(f).items()})
    if (folder / ".metadata").is_file():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dest = folder.parent / f"{folder.name}.pt"
        if not dest.exists():
            dcp_to_torch_save(str(folder), str(dest))

        def flat(prefix, obj):
            if torch.is_tensor(obj):
                out[prefix] = obj
            elif isinstance(obj, dict):
                for k, v in obj.items():
                    flat(f"{prefix}/{k}", v)
            elif isinstance(obj, (list, tuple)):
                for k, v in enumerate(obj):
                    flat(f"{prefix}/{k}", v)
        flat("", torch.load(dest, weights_only=False))
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        out.update({f"{sub.name}/{k}": v for k, v in _tensors(sub).items()})
    return out


def _drill(tmp_path: Path, plugins, env: dict) -> str:
    """One torchrun launch of fault_driver.py (rank 1 of each plugin's run dies in its own
    attempt); checks the launch, the resumes and the deaths, returns the output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={len(plugins)}", str(Path(__file__).with_name("fault_driver.py")),
           str(tmp_path), str(STEPS), str(SAVE), str(CRASH), *plugins]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    for plugin in plugins:
        crash = tmp_path / f"{plugin}-crash"
        assert f"resumed from {crash}/checkpoints/step_{SAVE * (CRASH // SAVE):08d}" in out, \
            (plugin, out[-3000:])
    for attempt in range(len(plugins)):  # one real rank death per plugin, one per attempt
        assert out.count(f"--simulate-crash: exiting at step {CRASH} (attempt {attempt})") == 1
    return out


def _final_tensors(tmp_path: Path, plugin: str):
    """(uninterrupted, restarted) final checkpoints of one plugin's runs, same keys."""
    final = f"step_{STEPS:08d}"
    a, b = (_tensors(tmp_path / f"{plugin}-{kind}" / "checkpoints" / final)
            for kind in ("ref", "crash"))
    assert a.keys() == b.keys() and len(a) > 10, plugin
    return a, b


def test_killed_rank_restarts_and_ends_bit_exact_every_plugin(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    _drill(tmp_path, PLUGINS, env)
    for plugin in PLUGINS:
        a, b = _final_tensors(tmp_path, plugin)
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differ, f"{plugin}: the restarted run ended with other values: {differ[:5]}"
        assert _losses(tmp_path / f"{plugin}-ref") == _losses(tmp_path / f"{plugin}-crash"), \
            plugin
    if importlib.util.find_spec("tensorboard") is not None:  # --tensorboard (ddp run)
        events = list((tmp_path / "ddp-ref" / "tensorboard").glob("events.out.tfevents.*"))
        assert events and events[0].stat().st_size > 100


@pytest.mark.multigpu
def test_killed_rank_restarts_on_nccl(tmp_path):
    """The same drill on 2 GPUs with NCCL (device machine): torchrun restarts the job after
    rank 1 dies, the new workers re-form an NCCL group and each run ends where the
    uninterrupted one does. GPU kernels (autotuned FP8 GEMMs, NCCL's reduction order) promise
    no bit-exact replay across processes, so values are compared with a tolerance here."""
    plugins = ("zero2", "hybrid")
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES=os.environ.get(
        "CUDA_VISIBLE_DEVICES", "0,1"), NCCL_NVLS_ENABLE="0")
    _drill(tmp_path, plugins, env)
    for plugin in plugins:
        run = json.loads((tmp_path / f"{plugin}-crash" / "run_config.json").read_text())
        assert run["device"].startswith("cuda") and run["world_size"] == 2  # NCCL: CUDA ranks
        a, b = _final_tensors(tmp_path, plugin)
        for k in a:
            torch.testing.assert_close(b[k].float(), a[k].float(), rtol=2e-3, atol=1e-4,
                                       msg=lambda m, k=k: f"{plugin} {k}: {m}")
        la, lb = _losses(tmp_path / f"{plugin}-ref"), _losses(tmp_path / f"{plugin}-crash")
        assert la.keys() == lb.keys() and all(abs(la[s] - lb[s]) <= 2e-3 * abs(la[s])
                                              for s in la), (plugin, la, lb)


def test_resume_auto_falls_back_past_a_corrupt_checkpoint(ex, tmp_path, capsys):
    fast = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "2", "--no-progress",
            "--eval-every", "0", "--val-fraction", "0", "--out-dir", str(tmp_path),
            "--save-every", "2", "--resume", "auto"]
    args = ex.train.parse_args(fast + ["--steps", "4"])
    ex.train.train(args)
    ckpts = ex.checkpointing.complete_checkpoints(tmp_path / "checkpoints")
    assert [c.name for c in ckpts] == ["step_00000004", "step_00000002"]
    (tmp_path / "checkpoints" / "step_00000005.partial").mkdir()  # a save that died: skipped
    # Run complete: a restart with the same command has nothing to do.
    assert ex.train.train(ex.train.parse_args(fast + ["--steps", "4"])) == {}
    assert "the run is complete" in capsys.readouterr().out
    victim = ckpts[0] / "rng" / "rank0.pt"
    victim.write_bytes(victim.read_bytes()[:-7])
    summary = ex.train.train(ex.train.parse_args(fast + ["--steps", "5"]))
    out = capsys.readouterr().out
    assert f"{victim} is" in out and "truncated" in out
    assert f"resumed from {ckpts[1]} (step 2)" in out
    assert summary["start_step"] == 2 and summary["steps_run"] == 3
    with pytest.raises(ValueError, match="pass --out-dir or --save-dir"):
        ex.train.validate_args(ex.train.parse_args(["--resume", "auto"]), 1)


def test_nonfinite_step_is_skipped_and_logged_then_stops(ex, tmp_path, monkeypatch):
    """NaN in step 2's forward: the example logs the step as skipped and trains on; with
    --max-bad-steps 1 the same NaN stops training with the guard's error."""
    from fp8boost.parallel.nonfinite import NonFiniteError

    real, calls = ex.train.prepare_model, [0]

    def prepare(model, args):
        def poison(_mod, _inp, out):
            calls[0] += 1
            return out * float("nan") if calls[0] == 2 else out
        model.get_input_embeddings().register_forward_hook(poison)
        return real(model, args)

    monkeypatch.setattr(ex.run_setup, "prepare_model", prepare)  # setup() calls it from there
    fast = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "2", "--no-progress",
            "--eval-every", "0", "--val-fraction", "0", "--steps", "3"]
    with pytest.warns(RuntimeWarning, match="non-finite loss on rank 0 at optimizer step 2"):
        summary = ex.train.train(ex.train.parse_args(fast + ["--out-dir", str(tmp_path / "a")]))
    records = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped", False) for r in records if r["kind"] == "train"] == \
        [False, True, False]
    assert summary["steps_run"] == 2  # the skipped step is not averaged into the summary
    calls[0] = 0
    with pytest.raises(NonFiniteError, match=r"1 optimizer steps in a row \(2-2\)"):
        ex.train.train(ex.train.parse_args(fast + ["--out-dir", str(tmp_path / "b"),
                                                   "--max-bad-steps", "1"]))


def test_full_disk_during_the_examples_save_keeps_the_previous_checkpoint(ex, tmp_path,
                                                                          monkeypatch):
    import errno

    from fp8boost.checkpoint_io import CheckpointSaveError

    real_save = torch.save

    def save(obj, f, *args, **kwargs):  # the 2nd checkpoint's RNG file hits a full disk
        if str(f).endswith("rank0.pt") and "step_00000004" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device (simulated)", str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ex.checkpointing.torch, "save", save)
    fast = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "2", "--no-progress",
            "--eval-every", "0", "--val-fraction", "0", "--out-dir", str(tmp_path),
            "--save-every", "2", "--steps", "4", "--resume", "auto"]
    with pytest.raises(CheckpointSaveError, match=r"step 4 failed .*No space left on device.*"
                       r"previous checkpoint .*step_00000002 is intact"):
        ex.train.train(ex.train.parse_args(fast))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == \
        ["latest", "step_00000002"]  # the partial save is gone
    monkeypatch.setattr(ex.checkpointing.torch, "save", real_save)
    summary = ex.train.train(ex.train.parse_args(fast))  # space again: resumes and finishes
    assert summary["start_step"] == 2 and summary["steps_run"] == 2


def test_bad_data_is_refused_with_the_required_length(ex, tmp_path):
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_text("")
    short.write_text("x" * 40)
    for path, what in ((empty, "is empty"), (short, "has 40 tokens")):
        args = ex.train.parse_args(["--data", str(path), "--seq-len", "64"])
        with pytest.raises(ValueError, match=f"{what}; training needs at least 65 tokens"):
            ex.train.validate_args(args, 1)
    with pytest.raises(ValueError, match="token id 300, outside the model's vocabulary"):
        ex.data.check_token_range(torch.tensor([1, 300]), 256, "data.txt")
    with pytest.raises(ValueError, match="needs at least 65 tokens"):
        ex.data.TokenWindows(torch.arange(64), seq_len=64)
    with pytest.raises(ValueError, match="--simulate-crash"):
        ex.train.validate_args(ex.train.parse_args(["--plugin", "ddp", "--simulate-crash", "3:2"]),
                               2)


def test_check_lm_batch():
    from fp8boost.batch_checks import check_lm_batch

    ids = torch.randint(0, 10, (2, 8))
    check_lm_batch(ids, ids, vocab_size=10)
    labels = ids.clone()
    labels[0, 0] = -100  # ignored by the loss: allowed
    check_lm_batch(ids, labels, vocab_size=10)
    with pytest.raises(ValueError, match="input_ids hold token id -1"):
        check_lm_batch(torch.tensor([[1, -1]]), vocab_size=10)
    with pytest.raises(ValueError, match="labels hold token id 12"):
        check_lm_batch(ids, torch.full((2, 8), 12), vocab_size=10)
    with pytest.raises(ValueError, match=r"labels have shape \(2, 7\) but input_ids \(2, 8\)"):
        check_lm_batch(ids, ids[:, :7])
    with pytest.raises(ValueError, match="integer tensor"):
        check_lm_batch(torch.rand(2, 8))
    with pytest.raises(ValueError, match="empty"):
        check_lm_batch(torch.zeros(0, 8, dtype=torch.long))


def test_tensorboard_missing_gives_a_clear_error(ex, monkeypatch):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ValueError, match="--tensorboard needs the tensorboard package.*pip "
                                         "install tensorboard"):
        ex.train.validate_args(ex.train.parse_args(["--tensorboard"]), 1)


def test_latest_checkpoint_skips_incomplete(tmp_path):
    from fp8boost.checkpoint_io import latest_checkpoint
    from fp8boost.checkpoint_io.base import STATE_MARKER

    assert latest_checkpoint(tmp_path / "none") is None
    for name, complete in (("ckpt-9", True), ("ckpt-10", True), ("ckpt-11", False),
                           (".ckpt-12.tmp-ab", True), ("ckpt-13.partial", True)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / STATE_MARKER).write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-10"


def test_guard_names_the_first_bad_gradient_and_validates():
    import warnings

    from fp8boost.parallel.nonfinite import NonFiniteError, NonFiniteGuard

    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    guard = NonFiniteGuard(max_consecutive=2).bind(None, model)
    assert not guard.check([torch.ones(2, 3), torch.ones(2)], params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert guard.check([torch.ones(2, 3), torch.tensor([1.0, float("nan")])], params)
    assert "non-finite gradient of bias on rank 0 at optimizer step 2" in str(caught[0].message)
    with pytest.raises(NonFiniteError, match=r"\(2-3\).*gradient of weight on rank 0"):
        guard.check([torch.full((2, 3), float("inf")), torch.ones(2)], params)
    off = NonFiniteGuard(enabled=False).bind(None, model)
    assert not off.check([torch.full((2, 3), float("nan")), None], params)
    with pytest.raises(ValueError, match="max_consecutive must be an int >= 1"):
        NonFiniteGuard(max_consecutive=0)
    from fp8boost.booster import Booster
    with pytest.raises(TypeError, match="nonfinite_guard must be True, False or a NonFiniteGuard"):
        Booster(nonfinite_guard="yes")
