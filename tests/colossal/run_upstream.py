"""Run Colossal-AI's own tests against ``fp8boost.colossal`` (docs/colossal_upstream_tests.md).

Not a pytest module (CI does not run it: it needs a Colossal-AI checkout). It extracts
``tests/`` from a Colossal-AI git directory into ``--dest`` (never into this repository),
applies the one-line import edit of docs/colossal.md to every ``.py`` file there (the same ``sed``), and
runs each given test file on its own, ``pytest -x -q`` with this repository on ``PYTHONPATH``,
printing one line per file: exit code, seconds, pytest's closing line.

Usage:
    python tests/colossal/run_upstream.py                       # the files of the doc's table
    python tests/colossal/run_upstream.py tests/test_fp8/test_fp8_cast.py --timeout 300
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
#: the import edit of docs/colossal.md, verbatim
SED = (r"s/^( *)import colossalai$/\1import fp8boost.colossal as colossalai/; "
       r"s/^( *)from colossalai([. ])/\1from fp8boost.colossal\2/")
#: the directories in scope (docs/colossal_upstream_tests.md)
DIRS = ("tests/test_fp8", "tests/test_booster", "tests/test_checkpoint_io", "tests/test_lora",
        "tests/test_moe")


def extract(git_dir: str, dest: pathlib.Path) -> None:
    """``git archive HEAD tests`` into ``dest``, then the import edit on every ``.py``."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", "HEAD", "tests"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    files = [str(p) for p in (dest / "tests").rglob("*.py")]
    subprocess.run(["sed", "-i", "-E", SED, *files], check=True)


def run(dest: pathlib.Path, test_file: str, timeout: int) -> tuple[int, float, str]:
    """(exit code, seconds, pytest's last summary line) of one file; 124 on timeout."""
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                               "no:cacheprovider", test_file], cwd=dest, env=env,
                              capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        rc, out = 124, "timed out"
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return rc, time.monotonic() - start, lines[-1] if lines else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="test files relative to the checkout (default: "
                    "every test_*.py of the directories in scope)")
    ap.add_argument("--git-dir", default="/work/.mirror/hpcaitech+ColossalAI/repo")
    ap.add_argument("--dest", default="/tmp/colossal", type=pathlib.Path)
    ap.add_argument("--timeout", default=600, type=int, help="seconds per file")
    ap.add_argument("--no-extract", action="store_true", help="reuse an edited --dest")
    args = ap.parse_args()
    if not args.no_extract:
        extract(args.git_dir, args.dest)
    files = args.files or sorted(str(p.relative_to(args.dest)) for d in DIRS
                                 for p in (args.dest / d).rglob("test_*.py"))
    for f in files:
        rc, secs, last = run(args.dest, f, args.timeout)
        print(f"{f}\trc={rc}\t{secs:.0f}s\t{last}", flush=True)


if __name__ == "__main__":
    main()
