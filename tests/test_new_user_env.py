"""Issue 13: ``python -m fp8boost`` reports the environment and the FP8 backend with a reason."""
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def test_python_m_fp8boost_prints_versions_gpus_and_backend(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fp8boost"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("fp8boost", run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in ("torch", "triton", "transformers", "GPU", "FP8 backend"):
        assert word in out
    assert torch.__version__ in out


def test_json_report_names_the_backend_and_why(capsys):
    from fp8boost.__main__ import main
    assert main(["--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["torch"] == torch.__version__
    assert env["fp8_backend"] in ("triton", "cublas", "emulated") and env["fp8_backend_why"]
    if not torch.cuda.is_available():
        assert env["fp8_backend"] == "emulated" and "no CUDA device" in env["fp8_backend_why"]
        assert env["gpus"] == []


def test_a_folder_shadowing_the_package_is_one_line(capsys, monkeypatch):
    # Issue 39 item 5: run from the folder above a clone named fp8boost, ``import fp8boost``
    # found the clone as an empty namespace package; was: AttributeError '__version__'.
    import fp8boost
    from fp8boost.__main__ import main
    monkeypatch.delattr(fp8boost, "__file__")
    monkeypatch.setattr(fp8boost, "__path__", ["/somewhere/fp8boost"])
    assert main([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/somewhere/fp8boost" in err[0] and "shadows" in err[0]
    assert "run the command from another folder" in err[0]


def test_python_m_fp8boost_above_a_clone_gives_no_traceback(tmp_path):
    # The real thing: a folder named fp8boost (the clone) in the current folder.
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "fp8boost").symlink_to(root, target_is_directory=True)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-m", "fp8boost"], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    assert "Traceback" not in proc.stdout, proc.stdout
    # Installed in editable mode the clone shadows the package (one line, status 1); installed
    # otherwise the package wins and the report prints.
    assert (proc.returncode == 1 and "shadows" in proc.stdout
            and len(proc.stdout.strip().splitlines()) == 1) or \
        (proc.returncode == 0 and "FP8 backend" in proc.stdout), proc.stdout
