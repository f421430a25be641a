"""Issue 13: ``python -m fp8boost`` reports the environment and the FP8 backend with a reason."""
import json
import runpy
import sys

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
