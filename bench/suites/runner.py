"""Running a suite's steps, or printing them (``--dry-run``).

Every step runs even when an earlier one failed, as in the former scripts (``set -u``, no
``-e``): one broken config must not cost the rest of a device call. The output filters are the
scripts' ``grep``/``tail`` pipelines done in Python, so a step's exit status is the command's
own (a shell pipeline reported ``tail``'s).
"""
from __future__ import annotations

import collections
import glob
import os
import re
import shlex
import subprocess
import sys
from typing import IO, Optional

from suites.core import Ctx, Step

# torchao is not on the GPU image (no internet there): it comes from a wheel carried in .whl/
# (carry=[".whl"]) installed into /tmp/site; --upgrade because a warm machine already has one.
WHEEL_SITE = "/tmp/site"
WHEEL_CMD = ["python3", "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
             "--no-cache-dir", "--upgrade", "--target", WHEEL_SITE]
# Variables a caller commonly sets that the commands inherit; --dry-run shows them when set.
INHERITED = ("CUDA_VISIBLE_DEVICES", "PYTHONPATH")


def shell_line(step: Step) -> str:
    """The step as one shell line: its own variables, then ``timeout N command``."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in step.env.items())
    return (env + " " if env else "") + shlex.join(step.argv())


def output_line(step: Step) -> str:
    """The scripts' pipeline for this step's output, for --dry-run."""
    pipe = []
    if step.drop:
        pipe.append(f"grep -vE {shlex.quote(step.drop)}")
    if step.keep:
        pipe.append(f"grep -E {shlex.quote(step.keep)}")
    if step.count:
        pipe.append("sort | uniq -c")
    if step.log and step.show:
        pipe.append(f"tee -a {step.log}" if step.append else f"tee {step.log}")
    if step.head:
        pipe.append(f"head -{step.head}")
    if step.show and step.tail:
        pipe.append(f"tail -{step.tail}")
    line = " | ".join(pipe)
    if step.log and not step.show:
        line += (" " if line else "") + (">> " if step.append else "> ") + step.log
    return line


def dry_run(ctx: Ctx, steps: list[Step]) -> None:
    """Print the environment and every command the suite would run, and nothing else."""
    suite = ctx.suite
    knobs = " ".join(f"{k}={shlex.quote(ctx.values[k])}" for k in ("OUT", *suite.knobs))
    args = " ".join(f"{n}={shlex.quote(ctx.values[n])}" for n, _ in suite.args)
    print(f"# suite {suite.name} (former bench/{suite.former}): {knobs}" + (f"; {args}" if args
                                                                            else ""))
    print(f"cd {shlex.quote(ctx.root)}")
    inherited = [f"{k}={shlex.quote(os.environ[k])}" for k in INHERITED if k in os.environ]
    if inherited:
        print(f"# inherited: {' '.join(inherited)}")
    print("export " + " ".join(f"{k}={shlex.quote(ctx.raw(v))}" for k, v in suite.env.items()))
    print(f"mkdir -p {shlex.quote(ctx.out)}")
    if suite.torchao:
        print(f"# if .whl/*.whl exists: {shlex.join(WHEEL_CMD)} .whl/*.whl && "
              f"export PYTHONPATH={WHEEL_SITE}:$PYTHONPATH")
    for step in steps:
        if not step.cmd:  # Python logic only (a check of a carried file, a summary)
            print(f"# (python) {step.note}")
            continue
        print(shell_line(step) + (" &" if step.background else ""))
        pipe = output_line(step)
        if pipe:
            print(f"#   output: 2>&1 {pipe if pipe.startswith('>') else '| ' + pipe}")
        if step.note:
            print(f"#   then: {step.note}")


def install_torchao_wheel(env: dict[str, str]) -> None:
    """Put torchao from a carried ``.whl/`` on PYTHONPATH (a no-op without one)."""
    wheels = sorted(glob.glob(".whl/*.whl"))
    if not wheels:
        return
    if subprocess.run(WHEEL_CMD + wheels).returncode == 0:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (WHEEL_SITE, env.get("PYTHONPATH")) if p)


def run(ctx: Ctx, steps: list[Step]) -> int:
    """Run the steps in order; returns 1 if any checked step failed, else 0."""
    suite = ctx.suite
    os.makedirs(ctx.out, exist_ok=True)
    env = dict(os.environ, **{k: ctx.raw(v) for k, v in suite.env.items()})
    if suite.torchao:
        install_torchao_wheel(env)
    failed, background = [], []
    for i, step in enumerate(steps):
        if not step.cmd:
            failed += finish(ctx, i, step, 0)
            continue
        if step.background:
            background.append((i, step, start_background(step, env)))
            continue
        for j, bstep, proc in background:  # the scripts' `wait` before the next command
            failed += finish(ctx, j, bstep, proc.wait())
        background = []
        failed += finish(ctx, i, step, run_step(step, env))
    for j, bstep, proc in background:
        failed += finish(ctx, j, bstep, proc.wait())
    print(f"[suite] {suite.name}: {len(steps)} steps, "
          + (f"failed: {', '.join(failed)}" if failed else "all exited 0"), flush=True)
    return 1 if failed else 0


def finish(ctx: Ctx, index: int, step: Step, rc: int) -> list[str]:
    """Run the step's ``after`` logic; the step's label if it counts as a failure."""
    if step.after is not None:
        step.after(ctx, rc)
    if rc == 0 or not step.check:
        return []
    words = step.argv()
    what = next((w for w in words if w.endswith(".py")), words[0])  # the script, not "python3"
    return [f"#{index + 1} {what} rc={rc}"]


def start_background(step: Step, env: dict[str, str]) -> subprocess.Popen:
    """A step sent to the background writes only its log (the scripts' ``> log 2>&1 &``)."""
    log = open(step.log or os.devnull, "w")
    try:
        return subprocess.Popen(step.argv(), stdout=log, stderr=subprocess.STDOUT,
                                env=dict(env, **step.env))
    finally:
        log.close()  # the child holds its own descriptor


def run_step(step: Step, env: dict[str, str]) -> int:
    """Run one command, filter its output as the script did, and return its exit status."""
    sys.stdout.flush()  # what we printed comes before the child's first line
    try:
        proc = subprocess.Popen(step.argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=dict(env, **step.env), text=True, errors="replace")
    except OSError as exc:
        print(f"[suite] cannot run {step.argv()[0]}: {exc}", flush=True)
        return 127
    log: Optional[IO[str]] = open(step.log, "a" if step.append else "w") if step.log else None
    last: collections.deque = collections.deque(maxlen=step.tail or None)
    seen = 0
    counts: collections.Counter = collections.Counter()
    drop = re.compile(step.drop) if step.drop else None
    keep = re.compile(step.keep) if step.keep else None
    assert proc.stdout is not None
    for line in proc.stdout:
        if (drop and drop.search(line)) or (keep and not keep.search(line)):
            continue
        seen += 1
        if step.head and seen > step.head:
            continue
        if log:
            log.write(line)
        if step.count:
            counts[line.rstrip("\n")] += 1
        elif step.show and step.tail:
            last.append(line)
        elif step.show:
            print(line, end="", flush=True)
    rc = proc.wait()
    if log:
        log.close()
    print("".join(last), end="", flush=True)
    for line, n in sorted(counts.items()):
        print(f"{n:7d} {line}", flush=True)
    return rc
