"""The example with pipeline x tensor parallelism: ``--plugin hybrid --tp 2 --pp 2`` on 4 ranks.

One torchrun pair (each ~30-60 s on a 2-core machine): train 12 steps in FP8 with FP8
communication (the stage boundary moves e4m3/e5m2 bytes: ``--seq-len 128`` makes each
micro-batch's activation 4 x 128 x 128 = 65536 elements, at the library's ``min_numel``), save at
step 6, resume from it; the resumed steps must repeat the first run's losses bit for bit (same
layout, same batches, gloo reductions in a fixed order). "Loss falls": see test_train_llama.py.
"""
from __future__ import annotations

import json
import subprocess
import sys

from tests.examples.test_train_llama import FAST, ROOT, SCRIPT, _assert_loss_falls, _env, _losses


def _torchrun(args: list[str], timeout: float = 300) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(SCRIPT), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(1), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}"
    return proc.stdout


def test_hybrid_tp2_pp2_fp8_fp8comm_trains_and_resumes_exactly(tmp_path):
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    args = [*FAST, "--seq-len", "128", "--steps", "12", "--plugin", "hybrid", "--tp", "2",
            "--pp", "2", "--use-fp8", "--fp8-comm", "--microbatches", "2"]
    out = _torchrun(args + ["--out-dir", str(run_a), "--save-every", "6"])
    # 2 micro-batches of 4 rows (the default would take 8 of 1 row, each activation below the
    # FP8 boundary's min_numel)
    assert "pp=2,1f1b,microbatches=2" in out
    assert "pipeline boundary" not in out, out  # the boundary went FP8 (else it says why not)
    losses_a = _losses(run_a)
    assert sorted(losses_a) == list(range(1, 13))
    _assert_loss_falls(losses_a)
    records = [json.loads(x) for x in (run_a / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [12]
    train = [r for r in records if r["kind"] == "train"]
    assert train[0]["tokens"] == 8 * 128  # one replica: the 4 ranks share each batch
    config = json.loads((run_a / "run_config.json").read_text())
    assert (config["pp"], config["tp"], config["microbatches"], config["world_size"]) == \
        (2, 2, 2, 4)
    ckpt = run_a / "checkpoints" / "step_00000006"
    assert all((ckpt / "rng" / f"rank{r}.pt").is_file() for r in range(4))
    assert (ckpt / "model" / "model.safetensors.index.json").is_file()  # one HF set
    _torchrun(args + ["--out-dir", str(run_b), "--resume", str(ckpt)])
    losses_b = _losses(run_b)
    assert sorted(losses_b) == list(range(7, 13))
    assert {s: losses_a[s] for s in losses_b} == losses_b
