"""Steps and after-step logic that several suites share: the GPU and version lines printed
first, and what the scripts did with a finished command's log (its last line, its failures,
copying a run's metrics under $OUT)."""
from __future__ import annotations

import os
import re
import shutil
from typing import Callable, Sequence

from suites.core import Ctx, Step

GPU_NAME = Step("nvidia-smi --query-gpu=name --format=csv,noheader", check=False)
GPU_NAME_MEM = Step("nvidia-smi --query-gpu=name,memory.total --format=csv,noheader",
                    check=False)
# Grep of a pytest log for what did not pass (the scripts printed these after the count line).
NOT_PASSED = r"^(FAILED|ERROR|SKIPPED)"
# The line tests/export/test_export_gpu.py prints for transformers' FP8 forward (both losses).
HF_FP8 = r"HF_FP8 \{.*\}"


def versions(*modules: str) -> Step:
    """One line of library versions (``python3 -c "import torch...; print(...)"``)."""
    prints = ", ".join(f'"{m}", {m}.__version__' for m in modules)
    return Step(f"python3 -c 'import {', '.join(modules)}; print({prints})'", check=False)


def read_lines(path: str) -> list[str]:
    """A log's lines, or none when the command never wrote it."""
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []


def grep(path: str, pattern: str, only: bool = False, cut: int = 0) -> list[str]:
    """``grep -E`` (``-o`` with ``only``) of a log, each line cut to ``cut`` characters."""
    rx, found = re.compile(pattern), []
    for line in read_lines(path):
        if only:
            found += [m.group(0) for m in rx.finditer(line)]
        elif rx.search(line):
            found.append(line)
    return [ln[:cut] if cut else ln for ln in found]


def last_line(path: str) -> str:
    lines = read_lines(path)
    return lines[-1] if lines else ""


def copy(src: str, dst: str) -> None:
    """``cp src dst 2>/dev/null``: a run that wrote nothing leaves nothing to copy."""
    try:
        shutil.copyfile(src, dst)
    except OSError:
        pass


def log_report(label: str, log: str, greps: Sequence[tuple[str, bool, int]] = (),
               with_rc: bool = True, suffix: str = "",
               summary_last: bool = False) -> Callable[[Ctx, int], None]:
    """After a command logged to ``log``: ``[label] rc=N <its last line>``, and the lines
    matching each ``(pattern, only_match, cut)`` (after it, or before with ``summary_last``)."""
    def report(ctx: Ctx, rc: int) -> None:
        path = ctx.raw(log)
        head = f"[{label}] " + (f"rc={rc} " if with_rc else "")
        summary = head + last_line(path) + ctx.raw(suffix)
        found = [ln for pattern, only, cut in greps for ln in grep(path, pattern, only, cut)]
        print("\n".join([*found, summary] if summary_last else [summary, *found]), flush=True)
    return report


def report_note(label: str, greps: Sequence[tuple[str, bool, int]] = ()) -> str:
    """The --dry-run text of a ``log_report``."""
    extra = "".join(f"; grep {'-o ' if only else ''}'{p}'" for p, only, _ in greps)
    # a note is a template too (filled like a command), so the patterns' braces are escaped
    extra = extra.replace("{", "{{").replace("}", "}}")
    return f"print '[{label}] rc=N' and the log's last line{extra}"


def print_tail(path: str, n: int, cut: int = 0) -> None:
    """``tail -n path | cut -c1-cut``."""
    for line in read_lines(path)[-n:]:
        print(line[:cut] if cut else line, flush=True)


def remove_tree(path: str) -> None:
    """``rm -rf path`` (the training example refuses an --out-dir it already used)."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
