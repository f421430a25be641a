"""Run Colossal-AI's own tests against ``fp8boost.colossal`` (docs/colossal_upstream_tests.md).

Not a pytest module (CI does not run it: it needs a Colossal-AI checkout). It extracts
``tests/`` from a Colossal-AI git directory into ``--dest`` (outside this repository, or an
ignored folder such as ``.upstream``), applies the one-line import edit of docs/colossal.md to
every ``.py`` file there (the same ``sed``), and runs each test file on its own in ``--dest``,
``pytest -x -q`` with this repository first on ``PYTHONPATH`` (the caller's last), printing
one line per file: exit code, seconds, the closing line. A file with no test function but a
``__main__`` block (``test_fp8_ddp_comm_hook.py``) runs as ``python FILE`` instead.

The extraction also writes ``pytest.ini`` (``--dest`` is pytest's rootdir, not this repository)
and ``THUDM/chatglm2-6b/``: the test kit calls ``AutoConfig.from_pretrained("THUDM/chatglm2-6b",
trust_remote_code=True)`` on import, and transformers reads that folder (relative to the
working directory) instead of the Hub: the chatglm2-6b code kept in Colossal-AI's history
(``CHATGLM2_CODE``; two attributes kept for transformers 5, ``CHATGLM2_KEEP``) and the Hub
model's ``config.json`` values. ``FAST_TEST=1`` (the model subset of Colossal-AI's PR CI) and
``HF_HUB_OFFLINE=1`` are set unless the environment sets them.

``--wheels DIR`` installs (``pip --no-deps --no-index --target DEST/_site``) the wheels whose
distribution the running Python lacks; ``DEST/_site`` follows the repository on ``PYTHONPATH``.
``--gpu`` runs ``GPU_FILES`` (the doc's "needs CUDA" and "not run here" files in scope).
``--jobs N`` runs N files at once; ``--budget S`` starts no file after S seconds and cuts each
file's timeout to what is left. ``--json PATH`` writes the results (rewritten after each file);
``--log DIR`` every file's output (its last 512 KiB) into ``DIR/upstream.log``.

Usage:
    python tests/colossal/run_upstream.py                       # the files of the doc's table
    python tests/colossal/run_upstream.py tests/test_fp8/test_fp8_cast.py --timeout 300
    python tests/colossal/run_upstream.py --no-extract --dest .upstream --wheels \\
        .upstream/wheels --gpu --fast-first --jobs 4 --json out.json --log out   # 2 GPUs
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import importlib.metadata
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
#: the import edit of docs/colossal.md, verbatim
SED = (r"s/^( *)import colossalai$/\1import fp8boost.colossal as colossalai/; "
       r"s/^( *)from colossalai([. ])/\1from fp8boost.colossal\2/")
#: the directories in scope (docs/colossal_upstream_tests.md)
DIRS = ("tests/test_fp8", "tests/test_booster", "tests/test_checkpoint_io", "tests/test_lora",
        "tests/test_moe")
#: the doc's "needs CUDA" and "not run here" files in scope, in the doc's order
GPU_FILES = tuple(f"tests/test_{f}.py" for f in """
    fp8/test_fp8_ddp_comm_hook fp8/test_fp8_fsdp_comm_hook fp8/test_fp8_linear
    booster/test_accelerator booster/test_mixed_precision/test_fp16_torch
    booster/test_plugin/test_dp_plugin_base booster/test_plugin/test_torch_ddp_plugin
    booster/test_plugin/test_torch_fsdp_plugin booster/test_plugin/test_low_level_zero_plugin
    checkpoint_io/test_general_checkpoint_io checkpoint_io/test_torch_fsdp_checkpoint_io
    checkpoint_io/test_torch_ddp_checkpoint_io checkpoint_io/test_low_level_zero_checkpoint_io
    checkpoint_io/test_gemini_checkpoint_io checkpoint_io/test_gemini_torch_compability
    checkpoint_io/test_plugins_huggingface_compatibility lora/test_lora
    moe/test_moe_checkpoint""".split())
#: GPU_FILES that spawn 4 ranks (they fail on fewer than 4 GPUs); --fast-first puts them last
FOUR_GPUS = ("tests/test_checkpoint_io/test_gemini_checkpoint_io.py",
             "tests/test_moe/test_moe_checkpoint.py")
#: THUDM/chatglm2-6b's config.json on the Hub: the values unlike ChatGLMConfig's defaults
CHATGLM2_CONFIG = {
    "model_type": "chatglm", "architectures": ["ChatGLMModel"], "auto_map": {
        "AutoConfig": "configuration_chatglm.ChatGLMConfig",
        **{f"AutoModel{k}": "modeling_chatglm.ChatGLMForConditionalGeneration"
           for k in ("", "ForCausalLM", "ForSeq2SeqLM")}},
    "add_qkv_bias": True, "eos_token_id": 2, "multi_query_attention": True,
    "multi_query_group_num": 2, "original_rope": True, "pad_token_id": 0, "seq_length": 32768,
    "tie_word_embeddings": False, "torch_dtype": "float16"}
#: chatglm2-6b's code in Colossal-AI's history (quantization.py, only imported, was deleted)
CHATGLM2_CODE = ("HEAD:colossalai/shardformer/modeling/chatglm2_6b/configuration_chatglm.py",
                 "HEAD:colossalai/shardformer/modeling/chatglm2_6b/modeling_chatglm.py",
                 "dad00c42aa79e726d55e778a9c5c681714882d43:"  # 00f6ef159^
                 "tests/kit/model_zoo/transformers/chatglm2_6b/quantization.py")
#: use_cache and max_length (transformers 4's PretrainedConfig default, 20) kept by the config
#: itself: transformers 5 moved both to GenerationConfig and the model code reads them
CHATGLM2_KEEP = ("        use_cache=True,\n        max_length=20,\n        **kwargs,\n    ):\n"
                 "        self.use_cache, self.max_length = use_cache, max_length\n")
#: copies chatglm2-6b's code into transformers' module cache once, before ranks race to do it
WARM = ("from transformers.dynamic_module_utils import get_class_from_dynamic_module as g\n"
        "for c in ('configuration_chatglm.ChatGLMConfig', "
        "'modeling_chatglm.ChatGLMForConditionalGeneration'):\n"
        "    print(g(c, 'THUDM/chatglm2-6b'))")
LOG_TAIL = 512 * 1024  # bytes of each file's output kept in --log's file


def extract(git_dir: str, dest: pathlib.Path) -> None:
    """``git archive HEAD tests`` into ``dest``, the import edit on every ``.py``, then
    ``pytest.ini`` and the ``THUDM/chatglm2-6b`` folder (module docstring)."""
    def git(*a: str) -> bytes:
        return subprocess.run(["git", f"--git-dir={git_dir}", *a], check=True,
                              capture_output=True).stdout
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=git("archive", "HEAD", "tests"),
                   check=True)
    subprocess.run(["sed", "-i", "-E", SED, *map(str, (dest / "tests").rglob("*.py"))], check=True)
    (dest / "pytest.ini").write_text("[pytest]\nmarkers =\n    dist\n    largedist\n")
    (glm := dest / "THUDM" / "chatglm2-6b").mkdir(parents=True, exist_ok=True)
    for src in CHATGLM2_CODE:
        (glm / src.rsplit("/", 1)[1]).write_bytes(git("show", src))
    conf = glm / "configuration_chatglm.py"
    text = conf.read_text().replace("        **kwargs,\n    ):\n", CHATGLM2_KEEP, 1)
    assert CHATGLM2_KEEP in text, "configuration_chatglm.py changed upstream"
    conf.write_text(text)
    (glm / "config.json").write_text(json.dumps(CHATGLM2_CONFIG, indent=2) + "\n")


def install_wheels(wheels: pathlib.Path, site: pathlib.Path) -> dict:
    """Install into ``site`` the wheels whose distribution this Python lacks."""
    done: dict = {"installed": [], "present": []}
    for whl in sorted(wheels.glob("*.whl")):
        try:
            name = whl.name.split("-")[0]
            done["present"].append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            done["installed"].append(whl.name)
    if done["installed"]:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--no-compile", "--upgrade", "--target", str(site),
                        *(str(wheels / w) for w in done["installed"])], check=True)
    return done


def run(dest: pathlib.Path, test_file: str, timeout: float, env: dict) -> dict:
    """Exit code (124 on timeout), seconds, closing line and output file of one test file."""
    src = (dest / test_file).read_text()
    script = "def test_" not in src and "__main__" in src
    cmd = ([sys.executable, test_file] if script else
           [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", test_file])
    out = dest / "_logs" / (test_file.replace("/", "__") + ".log")
    out.parent.mkdir(exist_ok=True)
    start = time.monotonic()
    with open(out, "wb") as fh:  # a file, not a pipe: spawned ranks may outlive a timeout
        proc = subprocess.Popen(cmd, cwd=dest, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = 124
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the spawned ranks too
        proc.wait()
    lines = [ln for ln in out.read_text(errors="replace").splitlines() if ln.strip()]
    last = f"timed out after {timeout:.0f}s" if rc == 124 else (lines[-1] if lines else "")
    return {"file": test_file, "mode": "python" if script else "pytest", "rc": rc,
            "seconds": round(time.monotonic() - start, 1), "last": last[:500], "out": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="test files relative to the checkout (default: "
                    "every test_*.py of the directories in scope)")
    ap.add_argument("--git-dir", default="/work/.mirror/hpcaitech+ColossalAI/repo")
    ap.add_argument("--dest", default="/tmp/colossal", type=pathlib.Path)
    ap.add_argument("--timeout", default=600, type=int, help="seconds per file")
    ap.add_argument("--no-extract", action="store_true", help="reuse an edited --dest")
    ap.add_argument("--wheels", type=pathlib.Path, help="wheels for DEST/_site")
    ap.add_argument("--gpu", action="store_true", help="run GPU_FILES")
    ap.add_argument("--fast-first", action="store_true", help="no test kit first, FOUR_GPUS last")
    ap.add_argument("--jobs", default=1, type=int, help="files run at once")
    ap.add_argument("--budget", type=float, help="seconds after which no file starts")
    ap.add_argument("--json", type=pathlib.Path, help="write the results here")
    ap.add_argument("--log", type=pathlib.Path, help="write all output to DIR/upstream.log")
    args = ap.parse_args()
    t0 = time.monotonic()
    dest = args.dest.resolve()
    if not args.no_extract:
        extract(args.git_dir, dest)
    files = args.files or (list(GPU_FILES) if args.gpu else sorted(
        str(p.relative_to(dest)) for d in DIRS for p in (dest / d).rglob("test_*.py")))
    if args.fast_first:
        files.sort(key=lambda f: (f in FOUR_GPUS, "tests.kit" in (dest / f).read_text()))
    env = dict(os.environ)
    paths = [str(REPO)] + ([str(dest / "_site")] if args.wheels else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("FAST_TEST", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    report: dict = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    "python": sys.version.split()[0], "fast_test": env["FAST_TEST"]}
    if args.wheels:
        report["wheels"] = install_wheels(args.wheels, dest / "_site")
    warm = subprocess.run([sys.executable, "-c", WARM], cwd=dest, env=env, capture_output=True)
    warm_out = (warm.stdout + warm.stderr).decode(errors="replace").strip()
    report["chatglm2_stand_in"] = warm_out.split("\n")[-1]
    if args.json:
        import torch  # the runner's own Python: the versions for the record
        report.update(torch=torch.__version__, cuda=torch.version.cuda,
                      gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    results: dict = {}
    lock = threading.Lock()
    if args.log:
        args.log.mkdir(parents=True, exist_ok=True)
    log = open(args.log / "upstream.log", "w", encoding="utf-8") if args.log else None

    def write_json() -> None:
        rows = [{k: v for k, v in results[f].items() if k != "out"} for f in files if f in results]
        args.json.write_text(json.dumps({
            **report, "seconds": round(time.monotonic() - t0, 1), "files": rows,
            "not_started": [f for f in files if f not in results]}, indent=1))

    def one(f: str) -> None:
        left = args.timeout if args.budget is None else args.budget - (time.monotonic() - t0)
        if left < 5:
            return
        res = run(dest, f, min(args.timeout, left), env)
        with lock:
            results[f] = res
            print(f"{f}\trc={res['rc']}\t{res['seconds']:.0f}s\t{res['last']}", flush=True)
            if log:
                text = res["out"].read_bytes()[-LOG_TAIL:].decode(errors="replace")
                log.write(f"===== {f} ({res['mode']}) rc={res['rc']} {res['seconds']}s\n{text}\n")
                log.flush()
            if args.json:
                write_json()

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(one, files))
    if args.json:
        write_json()
    for f in (f for f in files if f not in results):
        print(f"{f}\tnot started (--budget)", flush=True)


if __name__ == "__main__":
    main()
