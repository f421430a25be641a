"""The GPU suite: every ``gpu`` and ``multigpu`` test on the device machine, in one command.

    python tests/gpu_suite.py            # both parts: one-GPU, then multi-GPU
    python tests/gpu_suite.py one        # the one-GPU part only (budget 6 min on one H100)
    python tests/gpu_suite.py multi      # the multi-GPU part only (2-4 GPUs; budget 5 min)

Run it after every change to a kernel, an autograd function, a collective or a compiled path
(CONTRIBUTING.md). Before the first run, on a machine with the kernels-community mirror:
``bash bench/hub_kernel_offline.sh`` (transformers' FP8 GEMM kernel, which the GPU machine
cannot download), then carry ``.hubkernels`` to the GPU machine with the working tree.

The one-GPU part (``-m "gpu and not multigpu"``, on the first GPU) runs its test files in
``--workers`` pytest processes side by side on that GPU: most of its time is compilation on the
CPU (inductor, Triton), which one process leaves mostly idle. Files are dealt to the workers
longest first by their last measured time (:data:`DURATIONS`). The multi-GPU part
(``-m multigpu``) sees every GPU; its files run side by side too (up to 3 processes: each test
starts its own ranks, with a free port or a rendezvous file, so they do not collide).
Every process runs under ``FP8BOOST_GPU_SUITE=1``, which turns a skipped GPU test into a
failure (tests/conftest.py): nothing passes by not running. A test still running after
``--hang-s`` seconds dumps every thread's stack into the log (pytest's faulthandler).

``$OUT`` (or ``--out``) receives, per part, ``gpu_suite_<part>.log`` (the workers' logs, one
after another) and ``gpu_suite_<part>.json`` (counts, failures, every test's duration). The
last lines printed are one summary per part::

    [gpu-suite] one-gpu   1x NVIDIA H100 80GB HBM3: 55 passed, 0 failed, 0 skipped, 0 errors in 201 s (budget 360 s): OK

The exit status is non-zero if any part failed, skipped a test, collected none, or ran past
its budget.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
HUB_KERNEL = ROOT / ".hubkernels" / "finegrained_fp8" / "SOURCE.json"
DURATIONS = Path(__file__).with_name("gpu_suite_durations.json")


class Part:
    """One part of the suite: which tests, on how many GPUs, in how long."""

    def __init__(self, name: str, marks: str, budget_s: int, min_gpus: int, max_gpus: int,
                 max_workers: int):
        self.name, self.marks, self.budget_s = name, marks, budget_s
        self.min_gpus, self.max_gpus, self.max_workers = min_gpus, max_gpus, max_workers


# The multi-GPU tests start their own ranks on every GPU (torchrun --standalone picks a free
# port, tests/dist_utils.py rendezvous through a file), so their files can run side by side.
PARTS = {"one": Part("one", "gpu and not multigpu", 360, 1, 1, max_workers=4),
         "multi": Part("multi", "multigpu", 300, 2, 4, max_workers=3)}
# NVLink multicast stays off on the lent machines (a program using it can take a shared host's
# GPUs down); children (torchrun, subprocess tests) inherit these.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def gpu_names() -> list[str]:
    """The GPUs ``nvidia-smi`` lists (empty without a driver)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False).stdout
    except FileNotFoundError:
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_ids(n_gpus: int, max_gpus: int, visible: str) -> list[str]:
    """The GPU indices a part runs on: a caller's CUDA_VISIBLE_DEVICES (``visible``) picks them
    (two parts side by side on one machine: ``CUDA_VISIBLE_DEVICES=0 ... one &
    CUDA_VISIBLE_DEVICES=2,3 ... multi``), else every GPU; at most ``max_gpus``. nvidia-smi
    lists every GPU whatever CUDA_VISIBLE_DEVICES says, hence ``n_gpus``.

    Example:
        >>> gpu_ids(4, 4, "2,3"), gpu_ids(4, 1, ""), gpu_ids(2, 4, "1,5")
        (['2', '3'], ['0'], ['1'])
    """
    ids = [i.strip() for i in visible.split(",") if i.strip()] or [str(i) for i in range(n_gpus)]
    return [i for i in ids if i.isdigit() and int(i) < n_gpus][:max_gpus]


def deal(files: dict[str, int], workers: int, seconds: dict[str, float]) -> list[list[str]]:
    """Test files into ``workers`` lists, longest first onto the least loaded (LPT).

    ``files``: file -> number of selected tests; a file with no measured time counts 5 s a
    test. Empty lists are dropped.

    Example:
        >>> deal({"a.py": 1, "b.py": 1, "c.py": 1}, 2, {"a.py": 9, "b.py": 5, "c.py": 4})
        [['a.py'], ['b.py', 'c.py']]
    """
    cost = {f: seconds.get(f, 5.0 * n) for f, n in files.items()}
    loads: list[tuple[float, list[str]]] = [(0.0, []) for _ in range(max(1, workers))]
    for f in sorted(cost, key=lambda f: (-cost[f], f)):
        i = min(range(len(loads)), key=lambda i: (loads[i][0], i))
        loads[i] = (loads[i][0] + cost[f], loads[i][1] + [f])
    return [names for _, names in loads if names]


def read_junit(path: Path) -> list[dict]:
    """Each test case of a JUnit XML file: id, outcome (passed/failed/error/skipped), seconds."""
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = ("failed" if "failure" in kinds else "error" if "error" in kinds
                   else "skipped" if "skipped" in kinds else "passed")
        cls = case.get("classname", "")
        cases.append({"id": f"{cls}::{case.get('name')}", "file": _test_file(cls),
                      "outcome": outcome, "seconds": float(case.get("time", 0.0))})
    return cases


def _test_file(classname: str) -> str:
    """The test file of a JUnit ``classname`` (``tests.fp8.test_x`` or ``tests.fp8.test_x.Cls``)."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        for path in ("/".join(parts[:i]) + ".py", "tests/" + "/".join(parts[:i]) + ".py"):
            if (ROOT / path).is_file():  # pytest may leave the rootdir package out of it
                return path
    return classname


def _collect(part: Part, env: dict) -> dict[str, int]:
    """Test file -> number of tests ``part`` selects there."""
    out = subprocess.run([sys.executable, "-m", "pytest", "tests", "-m", part.marks,
                          "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=False).stdout
    files: dict[str, int] = {}
    for line in out.splitlines():
        if "::" in line:
            f = line.split("::", 1)[0]
            files[f] = files.get(f, 0) + 1
    return files


def _pytest(part: Part, targets: list[str], tag: str, work: Path, hang_s: int) -> list[str]:
    return [sys.executable, "-m", "pytest", *targets, "-m", part.marks, "-v", "-p",
            "no:cacheprovider", "--tb=short", "-rfE", "--durations=15", "--durations-min=2",
            "-o", f"faulthandler_timeout={hang_s}", f"--junitxml={work / f'{tag}.xml'}"]


def _start_worker(part: Part, i: int, files: list[str], work: Path, env: dict,
                  hang_s: int) -> tuple[str, subprocess.Popen, Path]:
    """One pytest process over ``files``, in its own session (so it can be ended whole)."""
    tag = f"{part.name}_w{i}"
    log = work / f"{tag}.log"
    with open(log, "w") as f:
        f.write(f"# worker {i}: {' '.join(files)}\n")
        f.flush()
        proc = subprocess.Popen(_pytest(part, files, tag, work, hang_s), cwd=ROOT, env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return tag, proc, log


def run_part(part: Part, out: Path, gpus: list[str], workers: int, hang_s: int,
             kill_s: int) -> tuple[bool, str]:
    """Run one part; returns (ok, its summary line)."""
    ids = gpu_ids(len(gpus), part.max_gpus, os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    use = [gpus[int(i)] for i in ids]
    label = f"[gpu-suite] {part.name + '-gpu':<9} {len(use)}x {use[0] if use else 'no GPU'}"
    if len(use) < part.min_gpus:
        return False, f"{label}: needs {part.min_gpus}+ GPUs, found {len(gpus)}: NOT RUN"
    env = dict(os.environ, **SAFE_ENV, FP8BOOST_GPU_SUITE="1", PYTHONUNBUFFERED="1",
               CUDA_VISIBLE_DEVICES=",".join(ids))
    t0 = time.monotonic()
    files = _collect(part, env)
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    groups = deal(files, min(workers, part.max_workers), seconds) if files else []
    # Workers share the CPU: each gets its slice for intra-op threads and inductor's compile
    # pool (each process would otherwise size both to the whole machine).
    threads = str(max(1, (os.cpu_count() or 4) // max(1, len(groups))))
    env.update(OMP_NUM_THREADS=threads, TORCHINDUCTOR_COMPILE_THREADS=threads)
    work = Path(tempfile.mkdtemp(prefix=f"gpu_suite_{part.name}_"))  # per-worker files
    procs = [_start_worker(part, i, group, work, env, hang_s) for i, group in enumerate(groups)]
    codes = []
    for tag, proc, _ in procs:  # killed past kill_s, so that a hang still ends in a summary
        try:
            codes.append(proc.wait(timeout=max(1.0, kill_s - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:  # the whole session: torchrun ranks too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            codes.append("killed")
    secs = time.monotonic() - t0
    cases = [c for tag, _, _ in procs for c in read_junit(work / f"{tag}.xml")]
    with open(out / f"gpu_suite_{part.name}.log", "w") as merged:
        for tag, _, log in procs:
            merged.write(log.read_text())
    n = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error",
                                                            "skipped")}
    clean = (all(c == 0 for c in codes) and n["failed"] == n["error"] == n["skipped"] == 0
             and n["passed"] > 0)
    ok = clean and secs <= part.budget_s
    why = "OK" if ok else "OVER BUDGET" if clean else f"FAILED (exit codes {codes})"
    per_file: dict[str, float] = {}
    for c in cases:
        per_file[c["file"]] = round(per_file.get(c["file"], 0.0) + c["seconds"], 1)
    (out / f"gpu_suite_{part.name}.json").write_text(json.dumps({
        "part": part.name, "gpus": use, "workers": len(groups), "seconds": round(secs, 1),
        "budget_s": part.budget_s, "ok": ok, "counts": n, "exit_codes": codes,
        "not_passed": [c["id"] for c in cases if c["outcome"] != "passed"],
        "file_seconds": per_file, "tests": cases}, indent=1))
    return ok, (f"{label}: {n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped, "
                f"{n['error']} errors in {secs:.0f} s with {len(groups)} worker(s) (budget "
                f"{part.budget_s} s): {why}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", nargs="?", default="all", choices=["all", *PARTS])
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/fp8boost_gpu_suite",
                   help="folder for the logs and JSON summaries (default: $OUT)")
    p.add_argument("--workers", type=int, default=max(1, min(4, (os.cpu_count() or 4) // 4)),
                   help="pytest processes side by side (the one-GPU part takes up to 4, the "
                   "multi-GPU part up to 3)")
    p.add_argument("--hang-s", type=int, default=180,
                   help="dump every thread's stack of a test running longer than this")
    p.add_argument("--kill-s", type=int, default=540,
                   help="end a part still running after this many seconds (counted failed)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not HUB_KERNEL.exists():
        print(f"[gpu-suite] missing {HUB_KERNEL.relative_to(ROOT)}: run `bash "
              "bench/hub_kernel_offline.sh` where the kernels-community mirror is, and carry "
              ".hubkernels (transformers' FP8 loading test needs it; no skip allowed)")
        return 2
    gpus = gpu_names()
    import torch, triton, transformers  # noqa: E401 (versions for the log only)
    print(f"[gpu-suite] {len(gpus)} GPU(s): {', '.join(gpus) or 'none'}; torch {torch.__version__}"
          f", triton {triton.__version__}, transformers {transformers.__version__}", flush=True)
    parts = list(PARTS) if args.part == "all" else [args.part]
    results = [run_part(PARTS[name], out, gpus, args.workers, args.hang_s, args.kill_s)
               for name in parts]
    for _, line in results:
        print(line, flush=True)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
