"""Every plugin trains the rowwise and blockwise recipes (issue 26), on CPU/gloo, 2 ranks.

Oracle: one process of the same model, same recipe (emulated backend), same global batches.
The distributed runs cannot be bit-exact, and the tolerances say why:

* data parallel (DDP, ZeRO-2, FSDP2): forward and dgrad operands are scaled per token row or
  per 1 x 128 tile of one token, the same on a rank as in one process; the weight-gradient
  operands are scaled along the token axis, which each rank sees only its half of, so their
  scales (and roundings) differ from one process's. Losses agree to 1e-2, the FP32 masters
  to 0.15 of the distance they travelled (0.2 with DDP's FP8 gradient all-reduce): the
  tensorwise FP8 tolerances of ``test_plugins_distributed.py``.
* tensor parallel (tp2, + split-gather SP), pipeline (pp2), Ulysses (sp2): rowwise reduces
  the row amaxes of operands whose rows span shards, blockwise tiles and blocks are
  shard-local (``fp8/linear_granular.py``; bytes checked in tests/parallel/test_tp_granular.py);
  the tiny Llama's dims split tiles at shard edges, and BF16 partial sums round differently.
  Losses within 5e-3, masters 0.15.

``fp8_communication=True``: the FP8 parameter all-gathers (FSDP2, ZeRO) and the FP8
sequence-parallel all-gather carry one scale per tensor, so they leave rowwise/blockwise
weights/inputs in the training dtype: one warning (or log line) naming why, recorded in the
plugin's comm report; except that FSDP2 (Gemini) gathers a blockwise weight whose even shards
hold whole 128-row blocks as FP8 with its block scales (here the [256, 128] one). The models: an MLP whose dims are multiples of 128 (blockwise blocks are
whole) and a tiny Llama (hidden 64, FFN 128: partial tiles, split further by tp).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed

RECIPES = ("rowwise", "rowwise_with_gw_hp", "blockwise")
# (loss rel, master rel); measured on torch 2.13 CPU, worst of the three recipes:
TOL_DP = (1e-2, 0.15)  # ddp / zero2 / gemini: 6.5e-3, 0.065
TOL_DP_COMM = (1e-2, 0.2)  # + DDP's FP8 gradient all-reduce (one e5m2 rounding): 5.3e-3, 0.11
TOL_HYBRID = (5e-3, 0.15)  # tp2, tp2+SP, pp2, sp2: 2.6e-4, 0.060
STEPS = 3


def _cfg(recipe: str):
    from fp8boost.fp8 import Fp8Config
    return Fp8Config.from_recipe(recipe, backend="emulated", min_numel=0)


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 16))


def _batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(16, 128, generator=g)
    x[:, 7] *= 50.0  # an outlier channel, as LLM activations grow them
    return x, torch.randn(16, 16, generator=g)


def _train(booster, model, opt, rank: int, world: int) -> list[float]:
    import torch.distributed as dist
    losses = []
    for s in range(STEPS):
        x, y = _batch(s)
        b = x.shape[0] // world
        loss = F.mse_loss(model(x[rank * b:(rank + 1) * b]).float(), y[rank * b:(rank + 1) * b])
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _weights(model, opt) -> torch.Tensor:
    if hasattr(opt, "full_master_params"):
        ws = opt.full_master_params()
    else:
        ws = [p.full_tensor() if hasattr(p, "full_tensor") else p
              for p in model.unwrap().parameters()]
    return torch.cat([w.detach().float().reshape(-1) for w in ws])


def _plugin(name: str, recipe: str, comm: bool):
    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.plugins import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
    kw = dict(precision="bf16", use_fp8=True, fp8_config=_cfg(recipe), fp8_communication=comm,
              comm_config=Fp8CommConfig(min_payload_numel=0))
    if name == "ddp":
        return TorchDDPPlugin(**kw)
    if name == "zero2":
        return LowLevelZeroPlugin(stage=2, reduce_bucket_size_in_m=0.002, **kw)
    return GeminiPlugin(**kw)


def _data_parallel(rank: int, world: int) -> dict:
    from fp8boost.booster import Booster, MixedPrecision
    from fp8boost.fp8 import Fp8Linear
    out = {}
    init = torch.cat([p.detach().reshape(-1) for p in _mlp().parameters()])
    for recipe in RECIPES:
        ref_b = Booster(mixed_precision=MixedPrecision("fp8", _cfg(recipe)), device="cpu")
        ref = _mlp()
        ref, ref_opt, *_ = ref_b.boost(ref, torch.optim.SGD(ref.parameters(), lr=0.1,
                                                            momentum=0.9))
        ref_losses = _train(ref_b, ref, ref_opt, 0, 1)
        want = _weights(ref, ref_opt)
        for name in ("ddp", "zero2", "gemini"):
            for comm in (False, True):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    plugin = _plugin(name, recipe, comm)
                    booster = Booster(plugin=plugin)
                    model = _mlp()
                    model, opt, *_ = booster.boost(
                        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
                    layers = [m for m in model.unwrap().modules() if isinstance(m, Fp8Linear)]
                    assert layers and all(m.fp8_config.recipe == _cfg(recipe).recipe
                                          for m in layers)
                    losses = _train(booster, model, opt, rank, world)
                got = _weights(model, opt)
                fell_back = [str(w.message) for w in caught
                             if "rowwise/blockwise Fp8Linear" in str(w.message)]
                report = getattr(plugin, "comm_report", None)
                out[(name, recipe, comm)] = (
                    max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                    float((got - want).norm() / (want - init).norm()),
                    len(fell_back),
                    report.why_not.get("param_all_gather", "") if report is not None else "",
                    tuple(getattr(report, "fp8_all_gather_modules", None) or ()))
    return out


def _hybrid(rank: int, world: int) -> dict:
    from tests.plugins.hybrid_cases import run_parity
    from tests.plugins.pipeline_cases import run_pp_parity
    from tests.plugins.test_hybrid_ulysses import run_ulysses_parity
    out = {}
    for recipe in RECIPES:
        cfg = _cfg(recipe)
        r = run_parity("llama", 2, 1, False, "bf16", True, False, fp8_config=cfg)
        out[("tp2", recipe)] = (r["loss_rel"], r["param_rel"], r["fp8_layers"])
        r = run_parity("llama", 2, 1, True, "bf16", True, True, fp8_config=cfg)
        out[("tp2+sp+comm", recipe)] = (r["loss_rel"], r["param_rel"], r["fp8_gathers"])
        r = run_pp_parity(pp=2, precision="bf16", fp8=True, layers=2, fp8_config=cfg)
        out[("pp2", recipe)] = (r["loss_rel"], r["param_rel"], 0)
        r = run_ulysses_parity("llama", 1, 2, 1, "bf16", True, False, fp8_config=cfg)
        out[("sp2", recipe)] = (r["loss_rel"], r["param_rel"], 0)
    return out


def _suite(rank: int, world: int) -> tuple[dict, dict]:
    return _data_parallel(rank, world), _hybrid(rank, world)


@pytest.fixture(scope="module")
def results():
    return run_distributed(_suite, 2, timeout=400)[0]


def test_data_parallel_plugins_train_every_recipe(results):
    table = results[0]
    bad = []
    for (name, recipe, comm), (dl, dw, warned, why, fp8_gathered) in table.items():
        tl, tw = TOL_DP_COMM if comm and name == "ddp" else TOL_DP
        if not (dl <= tl and dw <= tw):
            bad.append(f"{name} {recipe} comm={comm}: loss {dl:.2e}, weights {dw:.2e}")
        gathers = comm and name in ("zero2", "gemini")  # FP8 parameter all-gathers
        if gathers and not ("rowwise/blockwise" in why and warned <= 1):
            bad.append(f"{name} {recipe} comm: fallback not reported once ({warned}, {why!r})")
        if not gathers and warned:
            bad.append(f"{name} {recipe} comm={comm}: unexpected gather warning")
        # FSDP2 gathers the one blockwise weight whose 2 shards hold whole 128-row blocks
        # ([256, 128]) with its block scales; the others stay in the training dtype
        want = ("0.weight",) if (name, recipe, comm) == ("gemini", "blockwise", True) else ()
        if tuple(n.split("module.")[-1] for n in fp8_gathered) != want:
            bad.append(f"{name} {recipe} comm={comm}: FP8-gathered {fp8_gathered}, want {want}")
    assert not bad, "\n".join(bad) + f"\n{table}"


def test_hybrid_plugins_train_every_recipe(results):
    table = results[1]
    bad = [f"{case}: loss {dl:.2e}, weights {dw:.2e}" for case, (dl, dw, _) in table.items()
           if not (dl <= TOL_HYBRID[0] and dw <= TOL_HYBRID[1])]
    assert not bad, "\n".join(bad) + f"\n{table}"
    for recipe in RECIPES:
        assert table[("tp2", recipe)][2] > 0  # FP8 layers were split over tp
        assert table[("tp2+sp+comm", recipe)][2] == 0  # SP all-gathers stay BF16 (logged)
