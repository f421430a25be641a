"""torchrun entry point of test_faults.py: every plugin's run of the example is interrupted
at the same step, the last one by a real rank death, and all resume after ONE restart.

Launched as ``torchrun --nproc_per_node 2 --max-restarts 1 fault_driver.py ROOT STEPS SAVE
CRASH PLUGIN...``. In each attempt this process joins the job once (through the library's
``init_distributed``, which re-forms the group after a restart) and then, for every plugin in
order, runs the example's ``train()`` twice with ``--resume auto``:

* ``ROOT/<plugin>-ref``: uninterrupted (a finished run returns at once in the next attempt);
* ``ROOT/<plugin>-crash``: interrupted in step CRASH (after backward, before the optimizer
  step) in attempt 0. For the last plugin, ``--simulate-crash CRASH:1:0`` makes rank 1
  ``os._exit`` there: torchrun kills the job and restarts it (attempt 1). The others stop at
  the same point on both ranks (an exception the driver catches: a preemption that leaves the
  same checkpoints), so one launch pays for two start-ups instead of one restart per plugin.

In attempt 1 every ``-crash`` run resumes, in the restarted processes and process group, from
its newest complete checkpoint; the test compares the final checkpoints with the ``-ref`` ones.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

import train_llama  # noqa: E402

FAST = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "4", "--lr", "3e-3",
        "--warmup-steps", "2", "--no-progress", "--eval-batches", "1", "--eval-every", "0",
        "--val-fraction", "0"]
EXTRA = {"zero2": ["--use-fp8"], "hybrid": ["--tp", "2"]}
if importlib.util.find_spec("tensorboard") is not None:  # installed by the dev extra
    EXTRA["ddp"] = ["--tensorboard"]


class Interrupted(Exception):
    """Both ranks stop mid-step (the soft interruption of all but the last plugin)."""


def main() -> None:
    out, steps, save, crash, *plugins = sys.argv[1:]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    real_crash = train_llama.faults.maybe_crash

    def stop(spec, step, rank):
        if step == int(crash):
            raise Interrupted(step)

    for i, plugin in enumerate(plugins):
        common = FAST + ["--plugin", plugin, "--steps", steps, "--resume", "auto",
                         *EXTRA.get(plugin, [])]
        train_llama.train(train_llama.parse_args(
            common + ["--out-dir", f"{out}/{plugin}-ref", "--save-every", steps]))
        argv = common + ["--out-dir", f"{out}/{plugin}-crash", "--save-every", save]
        if i == len(plugins) - 1:  # the real thing: rank 1 dies, torchrun restarts the job
            train_llama.train(train_llama.parse_args(argv + ["--simulate-crash", f"{crash}:1:0"]))
            continue
        train_llama.faults.maybe_crash = stop if attempt == 0 else real_crash
        try:
            train_llama.train(train_llama.parse_args(argv))
        except Interrupted:
            if os.environ.get("RANK") == "0":
                print(f"[driver] {plugin}: interrupted in step {crash} (attempt {attempt})",
                      flush=True)
        finally:
            train_llama.faults.maybe_crash = real_crash
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
