"""torchrun entry point of test_faults.py: every plugin's run of the example loses a rank
mid-step for real, and resumes after torchrun restarts the job.

Launched as ``torchrun --nproc_per_node 2 --max-restarts N fault_driver.py ROOT STEPS SAVE
CRASH PLUGIN...`` with N = the number of plugins. In each attempt this process joins the job
once (through the library's ``init_distributed``, which re-forms the group after a restart)
and then, for every plugin in order, runs the example's ``train()`` twice with
``--resume auto``:

* ``ROOT/<plugin>-ref``: uninterrupted (a finished run returns at once in later attempts);
* ``ROOT/<plugin>-crash``: plugin number i runs with ``--simulate-crash CRASH:1:i``, so in
  attempt i its rank 1 ``os._exit``\ s in step CRASH (after backward, before the optimizer
  step), with no cleanup, as a killed process would; torchrun tears the job down and starts
  attempt i + 1, in which that run resumes, in new processes and a re-formed process group,
  from its newest complete checkpoint (and the runs before it, already finished, return).

The test compares every plugin's final checkpoint with its ``-ref`` one.
"""
from __future__ import annotations

import importlib.util
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


def main() -> None:
    out, steps, save, crash, *plugins = sys.argv[1:]
    for i, plugin in enumerate(plugins):
        common = FAST + ["--plugin", plugin, "--steps", steps, "--resume", "auto",
                         *EXTRA.get(plugin, [])]
        train_llama.train(train_llama.parse_args(
            common + ["--out-dir", f"{out}/{plugin}-ref", "--save-every", steps]))
        train_llama.train(train_llama.parse_args(
            common + ["--out-dir", f"{out}/{plugin}-crash", "--save-every", save,
                      "--simulate-crash", f"{crash}:1:{i}"]))
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
