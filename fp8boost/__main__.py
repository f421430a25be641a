"""``python -m fp8boost``: what this machine offers fp8boost, for bug reports and first runs.

Prints the versions of Python, torch, triton, transformers and accelerate, the visible GPUs with
their compute capability, and the FP8 backend ``Fp8Config(backend="auto")`` picks here, and why.

Example:
    >>> from fp8boost.__main__ import environment
    >>> env = environment()
    >>> env["fp8_backend"] in ("triton", "cublas", "emulated")
    True
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import warnings
from typing import Any, Optional

import torch

import fp8boost
from fp8boost.fp8.backends import get_backend


def _version(module: str) -> Optional[str]:
    """The installed version of ``module``, or None when it does not import (and why not)."""
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception as exc:  # a broken install must not stop the report  # noqa: BLE001
        return None if isinstance(exc, ImportError) else f"broken ({type(exc).__name__}: {exc})"


def _gpus() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        gpus.append({"index": i, "name": torch.cuda.get_device_name(i),
                     "capability": f"sm{major}{minor}",
                     "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30,
                                         1),
                     "fp8_tensor_cores": (major, minor) >= (8, 9)})
    return gpus


def backend_choice(device: torch.device) -> tuple[str, str]:
    """(backend name, why) that ``Fp8Config(backend="auto")`` resolves to on ``device``."""
    # get_backend warns once about each fallback: those warnings are the "why".
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = get_backend("auto", device)
    if device.type != "cuda":
        return backend.name, ("no CUDA device: FP8 GEMMs are emulated (exact FP8 numerics, "
                              "FP32 matmuls, no speed-up)")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return backend.name, (f"sm{major}{minor} < sm89: no FP8 tensor cores, so FP8 GEMMs are "
                              "emulated (no speed-up)")
    # Past the capability checks, only a Triton fallback warns; a warning seen earlier in this
    # process is not repeated, hence the default text.
    why = "; ".join(str(w.message).removeprefix("fp8boost: ") for w in caught)
    return backend.name, why or ("FP8 tensor cores (sm89+) and the Triton FP8 kernels: the "
                                 "fastest backend measured" if backend.name == "triton"
                                 else f"{backend.name} selected")


def environment() -> dict[str, Any]:
    """Everything ``python -m fp8boost`` prints, as a dict."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    name, why = backend_choice(device)
    return {
        "fp8boost": fp8boost.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "triton": _version("triton"),
        "transformers": _version("transformers"), "accelerate": _version("accelerate"),
        "gpus": _gpus(), "device": str(device), "fp8_backend": name, "fp8_backend_why": why,
    }


def format_environment(env: dict[str, Any]) -> str:
    """Human-readable lines of :func:`environment`."""
    lines = [f"fp8boost      {env['fp8boost']}", f"python        {env['python']} "
             f"({env['platform']})",
             f"torch         {env['torch']} (CUDA build: {env['torch_cuda'] or 'no'})"]
    for lib in ("triton", "transformers", "accelerate"):
        lines.append(f"{lib:<13} {env[lib] or 'not installed'}")
    if not env["gpus"]:
        lines.append("GPU           none visible (FP8 runs emulated: exact numerics, no speed-up)")
    for gpu in env["gpus"]:
        lines.append(f"GPU {gpu['index']:<9} {gpu['name']}, {gpu['capability']}, "
                     f"{gpu['memory_gib']} GiB, FP8 tensor cores: "
                     f"{'yes' if gpu['fp8_tensor_cores'] else 'no'}")
    lines.append(f"FP8 backend   {env['fp8_backend']} on {env['device']} (Fp8Config(backend='auto')): "
                 f"{env['fp8_backend_why']}")
    return "\n".join(lines)


def shadowing_folder() -> Optional[str]:
    """The folder that ``import fp8boost`` found instead of the package, or None.

    Run from the folder above a clone named ``fp8boost``, Python imports that clone (which has
    no ``__init__.py`` at its top) as an empty namespace package, since the current folder
    comes first on ``sys.path``; nothing of the package is then defined.
    """
    if getattr(fp8boost, "__file__", None) is not None:
        return None
    return ", ".join(getattr(fp8boost, "__path__", [])) or "a folder named fp8boost"


def main(argv: Optional[list[str]] = None) -> int:
    """Print the environment report (``--json``: as JSON); 1 with one line when a folder
    shadows the package."""
    parser = argparse.ArgumentParser(prog="python -m fp8boost", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    shadow = shadowing_folder()
    if shadow is not None:
        print(f"python -m fp8boost: the folder {shadow} (a clone of the repository?) shadows "
              "the installed fp8boost package, because Python imports from the current folder "
              "first; run the command from another folder, e.g. cd into the clone",
              file=sys.stderr)
        return 1
    env = environment()
    print(json.dumps(env, indent=2) if args.json else format_environment(env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
