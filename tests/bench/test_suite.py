"""CPU tests of bench/suite.py, the one entry point of the device suites (issue 38 item 6).

Every suite is planned (``--dry-run``) without a GPU: each has a purpose, names only files
that exist, and takes its knobs from the environment; the runner's filters, logs, background
steps and after-step logic are checked on small ``python -c`` steps.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.helpers import on_bench_path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
FORMER = ("2gpu 8gpu colossal_gpu comm_2gpu convergence_1gpu convergence_2gpu "
          "convergence_moe_1gpu final fsdp_2gpu fsdp_direct_2gpu gpu_checks granular_gpu "
          "granular_kernels_gpu hf_fp8_gpu hybrid_2gpu moe_4gpu moe_step_1gpu new_gpu_checks "
          "pipeline_2gpu probe_1gpu single_gpu threshold").split()
# Arguments for a suite whose default plans nothing (8gpu's default prints its parts).
PLAN_ARGS = {"8gpu": [["smoke", "2"], ["7b"], ["13b"], ["35b"]]}
REPO_PATH = re.compile(r"^(bench|tests|examples)/[\w/.-]+$")


@pytest.fixture(scope="module")
def suites():
    with on_bench_path():
        import suites as mod
        import suites.core
        import suites.runner
        yield mod


def suite_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "suite.py"), *args], cwd=ROOT,
                          env=dict(os.environ, **env), capture_output=True, text=True, timeout=60)


def plans(suites, out: str):
    """Every (suite, argv) worth planning: the default, and each named part."""
    for suite in suites.SUITES.values():
        argvs = PLAN_ARGS.get(suite.name) or [[]] + [[p] for p in suite.parts if p]
        for argv in argvs:
            yield suite, argv


def test_every_former_script_has_one_suite_with_a_purpose(suites):
    formers = sorted(s.former for s in suites.SUITES.values())
    assert formers == sorted(f"run_{f}.sh" for f in FORMER)
    listing = suite_cli("--list")
    assert listing.returncode == 0, listing.stderr
    for suite in suites.SUITES.values():
        assert suite.purpose and suite.gpus and suite.time, suite.name
        line = next(ln for ln in listing.stdout.splitlines() if ln.startswith(suite.name + " "))
        assert suite.purpose in line and "GPU" in line
    assert suites.find("run_moe_step_1gpu.sh").name == "moe-step"
    assert suites.find("moe_4gpu").name == "moe-4gpu"


def test_dry_run_names_only_files_in_the_repo(suites, tmp_path, capsys):
    """Every command of every part names bench/, tests/ and examples/ paths that exist (with
    OUT elsewhere, so output files do not count)."""
    checked = 0
    for suite, argv in plans(suites, str(tmp_path)):
        ctx = suites.core.make_ctx(suite, argv, str(ROOT), True,
                                   environ={"OUT": str(tmp_path), "NGPU": "2"})
        steps = ctx.steps()
        assert steps, (suite.name, argv)
        suites.runner.dry_run(ctx, steps)
        for line in capsys.readouterr().out.splitlines():
            if line.startswith("#"):
                continue
            for word in shlex.split(line):
                if REPO_PATH.match(word):
                    assert (ROOT / word).exists(), (suite.name, argv, word)
                    checked += 1
    assert checked > 60


def test_unknown_suite_or_part_is_one_clear_line():
    out = suite_cli("no-such-suite")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "unknown suite 'no-such-suite'" in out.stderr and "moe-step" in out.stderr
    out = suite_cli("hybrid-2gpu", "bogus")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "compiled" in out.stderr and "zero" in out.stderr
    out = suite_cli("threshold", "extra-arg")
    assert out.returncode != 0 and "too many arguments" in out.stderr


def test_env_knobs_and_arguments_reach_the_commands(tmp_path):
    out = suite_cli("--dry-run", "moe-step", "table", "qwen3", OUT=str(tmp_path), TAG="h200x",
                    CELL_TIMEOUT="77", CUDA_VISIBLE_DEVICES="1")
    assert out.returncode == 0, out.stderr
    assert f"--output {tmp_path}/moe_step_h200x.json" in out.stdout
    assert "--shapes qwen3" in out.stdout and "--cell-timeout 77" in out.stdout
    assert "CUDA_VISIBLE_DEVICES=1" in out.stdout and "-m pytest" not in out.stdout
    out = suite_cli("--dry-run", "moe-step", "gemm", GEMM_ARGS="--shapes a --x 1",
                    GEMM_TIMEOUT="99")
    assert "timeout 99 python3 bench/moe_gemm.py --quick --shapes a --x 1" in out.stdout
    out = suite_cli("--dry-run", "convergence-1gpu", "bf16,rowwise", RUN_TIMEOUT="33",
                    STEPS="10", OUT=str(tmp_path))
    assert out.stdout.count("timeout 33 torchrun") == 2 and "--steps 10 " in out.stdout
    assert f"{tmp_path}/convergence_1gpu_rowwise.jsonl" in out.stdout
    out = suite_cli("--dry-run", "convergence-1gpu", "bf16,bf16_fp8head", OUT=str(tmp_path),
                    TOKENIZER=".data/tok128k")
    assert out.stdout.count("--tokenizer .data/tok128k") == 2
    assert "--fp8-head rowwise --tokenizer" in out.stdout and "--use-fp8" not in out.stdout
    assert f"{tmp_path}/convergence_1gpu_bf16_fp8head_tok128k.jsonl" in out.stdout
    out = suite_cli("--dry-run", "convergence-1gpu", "rowwise_e5m2grad,rowwise_fp32scale",
                    OUT=str(tmp_path), SEED="3")
    assert "--fp8-recipe rowwise --fp8-option fp8_format=hybrid" in out.stdout
    assert "--fp8-recipe rowwise --fp8-option power_of_2_scale=false" in out.stdout
    assert out.stdout.count("--seed 3 ") == 2
    assert f"{tmp_path}/convergence_1gpu_rowwise_fp32scale_seed3.jsonl" in out.stdout
    out = suite_cli("--dry-run", "convergence-1gpu", "bf16", SEED="-1")
    assert out.returncode != 0 and "SEED must be" in out.stdout + out.stderr
    out = suite_cli("--dry-run", "convergence-1gpu", "bf16", TOKENIZER="x; rm -rf /")
    assert out.returncode != 0 and "bad TOKENIZER" in out.stdout + out.stderr
    out = suite_cli("--dry-run", "moe-4gpu", "ep4_fp8comm_compiled", PRESET="7b-8l")
    assert "--preset 7b-8l" in out.stdout and "--fp8-comm --compile" in out.stdout
    out = suite_cli("--dry-run", "convergence-2gpu", "gemini", "fp8_tensorwise,fp8_tensorwise_comm",
                    SIDE_BY_SIDE="1")
    lines = out.stdout.splitlines()
    assert "rm -rf /tmp/conv_fp8_tensorwise /tmp/conv_fp8_tensorwise_comm" in lines
    runs = [ln for ln in lines if "torchrun" in ln]
    assert len(runs) == 2 and all(ln.startswith("timeout 570 ") and ln.endswith(" &")
                                  for ln in runs), runs
    assert runs[1].endswith("--fp8-comm &") and "--plugin gemini" in runs[0]
    out = suite_cli("--dry-run", "convergence-2gpu", "zero2")
    assert out.stdout.count("torchrun") == 4 and " &" not in out.stdout
    out = suite_cli("--dry-run", "convergence-2gpu", "gemini", "fp8_delayed")
    assert out.returncode != 0 and "unknown run(s) ['fp8_delayed']" in out.stdout + out.stderr
    out = suite_cli("--dry-run", "colossal-gpu", TAG="t1", OUT=str(tmp_path))
    assert f"{tmp_path}/colossal_gpu_t1.log" in out.stdout and "PYTHONPATH=" in out.stdout


def test_runner_filters_logs_background_and_after(suites, tmp_path, capsys):
    core = suites.core
    py = shlex.quote(sys.executable)
    seen = []
    suite = core.Suite("demo", "run_demo.sh", "demo", "0", "1 s", knobs={"N": "5"}, parts={"": (
        core.Step(f"{py} -c 'import time; time.sleep(0.2); print(\"bg\")'", background=True,
                  log="{OUT}/bg.log", show=False),
        core.Step(f"{py} -c 'for i in range({{N}}): print(\"row\", i); print(\"DEBUG x\")'",
                  timeout=30, drop="DEBUG", keep="row", tail=2, log="{OUT}/rows.log"),
        core.Step(f"{py} -c 'import sys; sys.exit(3)'", after=lambda c, rc: seen.append(rc)),
        core.Step(f"{py} -c 'print(open(\"{{OUT}}/bg.log\").read().strip())'"),
    )})
    ctx = core.make_ctx(suite, [], str(ROOT), environ={"OUT": str(tmp_path), "N": "4"})
    rc = suites.runner.run(ctx, ctx.steps())
    out = capsys.readouterr().out
    assert rc == 1 and seen == [3]
    assert "row 2\nrow 3\n" in out and "row 1" not in out and "DEBUG" not in out
    assert (tmp_path / "rows.log").read_text() == "row 0\nrow 1\nrow 2\nrow 3\n"
    assert "\nbg\n" in out  # the background step finished before the next foreground one
    assert "failed: #3" in out and "rc=3" in out


def test_no_former_script_remains_and_docs_name_existing_scripts():
    assert not list(BENCH.glob("run_*.sh"))
    docs = [ROOT / n for n in ("README.md", "BENCHMARKS.md", "CONTRIBUTING.md", "DESIGN.md")]
    docs += sorted((ROOT / "docs").glob("*.md"))
    for folder in ("tests", "examples", "bench"):
        docs += sorted((ROOT / folder).rglob("*.py"))
    for path in docs:
        for m in re.finditer(r"(?<![\w/.])bench/[\w/.-]+\.(?:sh|py)\b", path.read_text()):
            assert (ROOT / m.group(0)).exists(), f"{path.relative_to(ROOT)} names {m.group(0)}"
