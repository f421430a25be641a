"""CPU test of bench/outlier_stress.py (issue 26's outlier stress case).

The stress (a massive first token: linear inputs x G, outputs / G, G a power of two) must leave
BF16 arithmetic bit for bit unchanged, so that only FP8 scaling sees it; per-token scaling in
forward and dgrad with a BF16 weight gradient (``rowwise_with_gw_hp``) must then be exactly as
without it, while one scale per tensor loses the other tokens. Tiny model, one step.
"""
from __future__ import annotations

import importlib.util
from argparse import Namespace
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "outlier_stress.py"


def _module():
    spec = importlib.util.spec_from_file_location("outlier_stress", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stress_is_exact_in_bf16_and_hits_only_per_tensor_scaling():
    mod = _module()
    args = Namespace(batch_size=2, seq_len=32, hidden=128, layers=1, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    train = torch.randint(0, 256, (4096,), generator=g)
    ids = mod._batch(train, 1, 2, 32, 0)

    def bf16_logits(gain):
        booster, model, _ = mod._boosted("bf16", args)
        assert mod._stress(booster.plugin.unwrap_model(model), gain) == (0 if gain == 1 else 7)
        return model(input_ids=ids).logits

    assert torch.equal(bf16_logits(1.0), bf16_logits(65536.0))
    rows = mod._one_step_errors(["bf16", "tensorwise", "rowwise_with_gw_hp"], [1.0, 65536.0],
                                train, args)
    err = {(r["recipe"], r["gain"]): (r["logits_rel"], r["wgrad_rel"]) for r in rows}
    assert err[("rowwise_with_gw_hp", 1.0)] == err[("rowwise_with_gw_hp", 65536.0)]
    assert err[("tensorwise", 65536.0)][0] > 5 * err[("tensorwise", 1.0)][0], err
