"""What every single-GPU bench script records (the environment, where its JSON goes) and how it
times a kernel."""
from __future__ import annotations

import datetime
import json
import os

import torch


def env_info(argv) -> dict:
    """Device, SM count, torch/triton/CUDA versions, date and the command line."""
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"device": torch.cuda.get_device_name(0), "sm_count": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": "python " + " ".join(argv)}


def write_json(name: str, payload: dict) -> str:
    """Write ``<name>_<date>.json`` to ``$OUT`` (device machine) or bench/results/."""
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}_{datetime.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    return path


def bench(fn, warmup_ms=25, rep_ms=150) -> float:
    """Median milliseconds of ``fn()`` on the GPU (``triton.testing.do_bench``)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
