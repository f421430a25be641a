"""One entry point for the device benchmarks and checks: named suites, each the former
``bench/run_*.sh`` script of (nearly) the same name.

Each suite is a list of steps (command, time limit, environment, which output lines to print),
run from the repository root with the same knobs the scripts read from the environment (OUT,
default bench/results; TAG; RUN_TIMEOUT; STEPS; ...) and the same positional sub-modes. Every
step runs even after one fails; the exit status is 1 if any failed. ``--dry-run`` prints the
environment and the exact commands instead of running them.

Example::

    python bench/suite.py --list                         # every suite: purpose, GPUs, time
    python bench/suite.py --list moe-step                # one suite's parts and knobs
    TAG=h100 python bench/suite.py --dry-run single-gpu table 7b-4l
    TAG=h200 python bench/suite.py moe-step table qwen3  # on the GPU machine
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from suites import SUITES, find  # noqa: E402  (bench/suites/)
from suites.core import Suite, SuiteError, make_ctx  # noqa: E402
from suites.runner import dry_run, run  # noqa: E402


def describe(suite: Suite) -> str:
    """``--list NAME``: purpose, GPUs, time, arguments, parts, knobs and their defaults."""
    args = " ".join(f"[{n}={d}]" for n, d in suite.args)
    knobs = ", ".join(f"{k}={v!r}" for k, v in {"OUT": "bench/results", **suite.knobs}.items())
    lines = [f"{suite.name} {args}".rstrip(), f"  {suite.purpose}",
             f"  GPUs: {suite.gpus}; typical device time: {suite.time}",
             f"  replaces: bench/{suite.former}", f"  knobs: {knobs}"]
    parts = [p for p in suite.parts if p]
    if parts:
        lines.append(f"  parts: {', '.join(parts)}")
    if suite.usage:
        lines.append(f"  {suite.usage}")
    return "\n".join(lines)


def list_suites() -> str:
    """``--list``: one line per suite."""
    width = max(len(n) for n in SUITES)
    return "\n".join(f"{s.name:<{width}}  {s.gpus:>3} GPU  {s.time:<12}  {s.purpose}"
                     for s in sorted(SUITES.values(), key=lambda s: s.name))


def main(argv: Optional[list[str]] = None) -> int:
    """Parse the command line and list, print or run a suite; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="suites:\n" + list_suites())
    p.add_argument("--list", action="store_true", help="list the suites (or describe one)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the environment and every command; run nothing")
    p.add_argument("suite", nargs="?", help="the suite's name (see --list)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the suite's positional arguments")
    opts = p.parse_args(argv)
    try:
        if opts.list:
            print(describe(find(opts.suite)) if opts.suite else list_suites())
            return 0
        if not opts.suite:
            p.error("name a suite (see --list)")
        ctx = make_ctx(find(opts.suite), opts.args, str(ROOT), opts.dry_run)
        steps = ctx.steps()
    except SuiteError as exc:
        print(f"bench/suite.py: {exc}", file=sys.stderr)
        return 2
    os.chdir(ROOT)  # the commands name repository paths (bench/train.py), as the scripts did
    if opts.dry_run:
        dry_run(ctx, steps)
        return 0
    return run(ctx, steps)


if __name__ == "__main__":
    sys.exit(main())
