"""The GPU suite's runner (tests/gpu_suite.py) on CPU: how it deals files to workers, reads
pytest's JUnit XML, and that a skipped GPU test fails inside the suite (tests/conftest.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.gpu_suite import ROOT, deal, gpu_ids, read_junit

_TESTS = '''
import pytest

def test_ok():
    pass

def test_bad():
    assert 1 == 2

def test_plain_skip():
    pytest.skip("not a GPU test")

@pytest.mark.gpu
def test_gpu():
    pass
'''


def _run(tmp_path: Path, suite: bool) -> list[dict]:
    (tmp_path / "test_sample.py").write_text(_TESTS)
    xml = tmp_path / "out.xml"
    env = dict(os.environ, PYTHONPATH=str(ROOT), FP8BOOST_GPU_SUITE="1" if suite else "0")
    subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_sample.py"), "-q",
                    "-p", "tests.conftest", "-p", "no:cacheprovider", f"--junitxml={xml}"],
                   cwd=tmp_path, env=env, capture_output=True, check=False, timeout=120)
    return read_junit(xml)


def test_deal_puts_the_longest_files_first_on_the_least_loaded_worker():
    seconds = {"a.py": 100, "b.py": 60, "c.py": 50, "d.py": 10}
    files = {f: 1 for f in seconds} | {"new.py": 3}  # unmeasured: 5 s a test
    groups = deal(files, 2, seconds)
    loads = sorted(sum(seconds.get(f, 15) for f in g) for g in groups)
    assert loads == [115, 120] and sorted(f for g in groups for f in g) == sorted(files)
    assert deal(files, 8, seconds) == [["a.py"], ["b.py"], ["c.py"], ["new.py"], ["d.py"]]
    assert deal({}, 3, {}) == []


def test_read_junit_and_the_suite_turns_a_gpu_skip_into_a_failure(tmp_path):
    outcomes = {c["id"].rsplit("::", 1)[1]: c["outcome"] for c in _run(tmp_path, suite=False)}
    # On this CPU machine the gpu test is skipped by conftest's GPU check, as in CI.
    assert outcomes == {"test_ok": "passed", "test_bad": "failed", "test_plain_skip": "skipped",
                        "test_gpu": "skipped"}
    outcomes = {c["id"].rsplit("::", 1)[1]: c["outcome"] for c in _run(tmp_path, suite=True)}
    # Inside the suite a GPU test that does not run fails (in its setup here, where conftest's
    # skip marker acts: JUnit calls that an error); other skips are left alone.
    assert outcomes["test_gpu"] == "error" and outcomes["test_plain_skip"] == "skipped"
    assert read_junit(tmp_path / "missing.xml") == []


def test_gpu_ids_follow_the_callers_visible_devices():
    assert gpu_ids(4, 4, "") == ["0", "1", "2", "3"]
    assert gpu_ids(4, 1, "") == ["0"]
    assert gpu_ids(4, 4, "2,3") == ["2", "3"]
    assert gpu_ids(4, 4, " 1 , 3 ") == ["1", "3"]
    assert gpu_ids(2, 4, "1,5,GPU-uuid") == ["1"]  # absent or non-index entries are dropped
