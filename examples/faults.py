"""Fault drills for the training example: a rank that dies mid-step, on purpose.

``--simulate-crash STEP[:RANK[:ATTEMPT]]`` makes ``RANK`` (default: the last rank) exit with
status 1 at ``STEP``, after its backward pass and before the optimizer step, but only in
torchrun attempt ``ATTEMPT`` (``TORCHELASTIC_RESTART_COUNT``, default 0). Under
``torchrun --max-restarts N ... --resume auto`` the job is then restarted and resumes from its
newest complete checkpoint; the restarted attempt does not crash again, so the run finishes
with the same weights as an uninterrupted one (bit-exact on CPU/gloo).

Example:
    >>> parse_crash("12", world_size=2)
    (12, 1, 0)
    >>> parse_crash("12:0:1", world_size=2)
    (12, 0, 1)
"""
from __future__ import annotations

import os
import sys
from typing import Optional


def parse_crash(spec: str, world_size: int) -> tuple[int, int, int]:
    """``(step, rank, attempt)`` of ``--simulate-crash``; ValueError naming the fix."""
    parts = spec.split(":")
    try:
        values = [int(x) for x in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3:
        raise ValueError(f"--simulate-crash {spec!r}: expected STEP[:RANK[:ATTEMPT]] with "
                         "integers, e.g. 12 or 12:1:0")
    step = values[0]
    rank = values[1] if len(values) > 1 else world_size - 1
    attempt = values[2] if len(values) > 2 else 0
    if step < 1 or not 0 <= rank < world_size or attempt < 0:
        raise ValueError(f"--simulate-crash {spec!r}: STEP must be >= 1, RANK in [0, "
                         f"{world_size}) and ATTEMPT >= 0")
    return step, rank, attempt


def maybe_crash(spec: Optional[str], step: int, rank: int) -> None:
    """Exit this process now when ``spec`` names this step, rank and torchrun attempt."""
    if spec is None:
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    at_step, at_rank, attempt = parse_crash(spec, world)
    if (step, rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))) != \
            (at_step, at_rank, attempt):
        return
    print(f"[train] rank {rank}: --simulate-crash: exiting at step {step} (attempt {attempt})",
          flush=True)
    sys.stdout.flush()
    # os._exit: no cleanup, no exception handler, no barrier: as a killed process would.
    os._exit(1)
