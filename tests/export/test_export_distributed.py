"""FP8 exports under 2-rank gloo (zero2, gemini, hybrid tp2) equal the single-process export
byte for byte (one spawned run)."""
from __future__ import annotations

import os

import torch

from tests.dist_utils import run_distributed

PLUGINS = ("zero2", "gemini", "hybrid_tp2")
LAYOUTS = ("per_tensor", "block")


def _plugin(name):
    from fp8boost.plugins import GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin
    if name == "zero2":
        return LowLevelZeroPlugin(stage=2, precision="fp32")
    if name == "gemini":
        return GeminiPlugin(precision="fp32")
    return HybridParallelPlugin(tp_size=2, precision="fp32")


def _model():
    from tests.export import helpers as H
    return H.make("llama", hidden=128, inter=256)


def _export_all(rank, world, root):
    from fp8boost.booster import Booster
    for name in PLUGINS:
        booster = Booster(plugin=_plugin(name))
        raw = _model()
        model, *_ = booster.boost(raw, torch.optim.AdamW(raw.parameters(), lr=1e-3))
        for layout in LAYOUTS:
            booster.save_model(model, os.path.join(root, f"{name}_{layout}"), fp8_export=layout)
    return True


def _files(path):
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))
            if f.endswith(".safetensors")}


def test_two_rank_exports_equal_single_process(tmp_path):
    from fp8boost.booster import Booster
    root = str(tmp_path)
    run_distributed(_export_all, 2, root)
    booster = Booster(mixed_precision="fp32", device="cpu")
    model, *_ = booster.boost(_model())
    for layout in LAYOUTS:
        ref = os.path.join(root, f"single_{layout}")
        booster.save_model(model, ref, fp8_export=layout)
        want = _files(ref)
        assert want
        for name in PLUGINS:
            assert _files(os.path.join(root, f"{name}_{layout}")) == want, (name, layout)
