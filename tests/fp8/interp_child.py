"""Shared runner of the Triton-interpreter test classes (``TestInterpreter``) of tests/fp8.

The interpreter must be on before anything imports triton (triton's own ``tl.*`` library
functions are decorated at import time), and a full test run imports triton early
(torch.compile). So each kernel test module's ``TestInterpreter`` class runs in a child process
that sets ``TRITON_INTERPRET=1`` first; :data:`IN_CHILD` tells the module which side it is on.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

IN_CHILD = os.environ.get("FP8BOOST_TRITON_INTERP_CHILD") == "1"
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreter_suite(test_file: str, node: str = "TestInterpreter",
                          timeout: int = 600) -> None:
    """Run ``test_file::node`` under ``TRITON_INTERPRET=1`` in a fresh process; assert that it
    passed and that every test really ran (no skip hides a missing interpreter path).

    Skips when called inside the child itself, and with Triton < 3.7 (whose interpreter cannot
    iterate ``range(program_id, n, step)``).
    """
    if IN_CHILD:
        pytest.skip("already inside the interpreter child process")
    from importlib.metadata import version

    if tuple(int(v) for v in version("triton").split(".")[:2]) < (3, 7):
        pytest.skip("the kernels' interpreter tests need Triton >= 3.7 (CI has 3.7/3.9)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "FP8BOOST_TRITON_INTERP_CHILD": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{os.path.abspath(test_file)}::{node}"], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    summary = [ln for ln in tail.splitlines() if " passed" in ln]
    assert summary and "skipped" not in summary[-1], tail  # every interpreter test really ran
