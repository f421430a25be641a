"""HybridParallelPlugin with DeepSpeed-Ulysses sequence parallelism (``all_to_all``) on gloo.

Oracle: one process of the same tiny HF model fed the same global batches (as
``test_hybrid_plugin.py``: SGD with momentum, clipping at 1.0, same precision and FP8 recipe).
Each sp rank is fed the full batch of its dp replica and keeps ``SEQ / sp`` tokens. Tolerances
over 3 steps, measured on torch 2.13 CPU (see TOL below for the measured values):

* fp32: losses and masters within 1e-5 relative: attention over the full sequence sees the
  same numbers, only summation orders (loss sum over chunks, gradient mean over dp x sp) differ.
* bf16 + FP8 GEMMs (+ FP8 all-to-all of q/k/v and attention output): losses within 2e-2,
  masters within 0.25 of the distance they travelled: the FP8 wire adds one e4m3 rounding
  (per-chunk scale) of q/k/v and of the attention output, which plain FP8 GEMMs do not have.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.plugins.hybrid_cases import gathered_masters, global_batch, tiny_model

TOL = {  # kind: (loss rel, master rel)
    "fp32": (1e-5, 1e-5),
    "bf16": (5e-3, 0.05),
    "fp8": (2e-2, 0.25),
}

# (arch, tp, sp, zero, precision, use_fp8, fp8_communication)
CASES_2 = [
    ("llama", 1, 2, 1, "fp32", False, False),
    ("llama", 1, 2, 2, "bf16", True, True),
    ("qwen2", 1, 2, 0, "fp32", False, False),
]
CASES_4 = [
    ("llama", 2, 2, 1, "fp32", False, False),
    ("llama", 2, 2, 2, "bf16", True, True),
    ("llama", 1, 2, 2, "fp32", False, False),  # dp 2 x sp 2: ZeRO over the flattened group
]


def run_ulysses_parity(arch, tp, sp, zero, precision, fp8, comm, steps: int = 3,
                       fp8_config=None) -> dict:
    """Train the plugin and a single-process reference; return their differences."""
    from fp8boost.booster import Booster
    from fp8boost.fp8 import Fp8Config
    from fp8boost.parallel.zero import ZeroOptimizer
    from fp8boost.plugins import HybridParallelPlugin
    from fp8boost.plugins.precision import prepare_model

    cfg = fp8_config or Fp8Config(backend="emulated", min_numel=0)
    model = tiny_model(arch)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    plugin = HybridParallelPlugin(tp_size=tp, sp_size=sp, zero_stage=zero,
                                  enable_sequence_parallelism=True,
                                  sequence_parallelism_mode="all_to_all", precision=precision,
                                  use_fp8=fp8, fp8_communication=comm, fp8_config=cfg,
                                  max_norm=1.0)
    booster = Booster(plugin=plugin)
    wrapped, opt, *_ = booster.boost(model, opt)
    prepare_model(ref, precision, fp8, cfg, torch.device("cpu"))
    ref_opt = ZeroOptimizer(torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9), max_norm=1.0)
    init = {n: p.detach().float().clone() for n, p in ref.named_parameters()}
    dp, dpr = plugin.dp_size, plugin.dp_rank
    losses, ref_losses = [], []
    for s in range(steps):
        ids = global_batch(s)
        local = ids.chunk(dp)[dpr]
        out = wrapped(input_ids=local, labels=local)
        assert out.logits.shape[1] == ids.shape[1] // sp  # this rank's chunk
        booster.backward(out.loss, opt)
        opt.step()
        opt.zero_grad()
        total = out.loss.detach().float().clone()
        dist.all_reduce(total, group=plugin.dp_group)
        losses.append(total.item() / dp)
        r = ref(input_ids=ids, labels=ids).loss
        ref_opt.backward(r)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(r.item())
    got = gathered_masters(plugin, opt, model)
    want = dict(zip([n for n, _ in ref.named_parameters()], ref_opt.full_master_params()))
    num = sum(((got[n] - want[n]) ** 2).sum() for n in want) ** 0.5
    den = sum(((want[n] - init[n]) ** 2).sum() for n in want) ** 0.5
    return {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param_rel": float(num / den), "losses": losses,
            "zero_world": opt.dp_world, "dp": dp}


def _run_cases(rank: int, world: int, cases: list) -> list:
    return [(case, run_ulysses_parity(*case)) for case in cases]


def _check(results: list, world: int) -> None:
    for case, res in results[0]:
        kind = "fp8" if case[5] else case[4]
        loss_tol, param_tol = TOL[kind]
        assert res["loss_rel"] <= loss_tol, (case, res)
        assert res["param_rel"] <= param_tol, (case, res)
        assert res["zero_world"] == res["dp"] * case[2], (case, res)  # ZeRO spans dp x sp
    for r in results[1:]:  # every rank reports the same global loss
        for (case, res), (_, res0) in zip(r, results[0]):
            assert res["losses"] == pytest.approx(res0["losses"], rel=1e-6), case


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)], ids=["sp2", "sp2xtp2"])
def test_ulysses_parity(world, cases) -> None:
    _check(run_distributed(_run_cases, world, cases), world)
