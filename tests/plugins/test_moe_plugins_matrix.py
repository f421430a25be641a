"""MoE models with FP8 experts under the non-MoE plugins (issue 27), on CPU/gloo, 2 ranks.

A tiny transformers Mixtral and Qwen3-MoE (hidden 64, 4 experts, top-2, expert width 32, 2
layers), ``use_fp8=True`` with ``Fp8Config(backend="emulated", min_numel=0)``: every linear
becomes an Fp8Linear (tensorwise) and each layer's fused experts an ``Fp8Experts`` (grouped
FP8 GEMMs, rowwise scales). Each plugin trains 3 SGD steps (lr 0.5, momentum 0.9) on its share
of the same global batches, against one process with the same FP8 config on the same batches.

The oracle is matched to what a rank computes, so that tolerances can be tight:

* data parallel (DDP, ZeRO-1/2, Gemini = FSDP2 ZeRO-3, TorchFSDP) and pp2 (two micro-batches):
  one process running each global batch as its two halves, gradients accumulated (loss / 2
  each). FP8 scales depend on the tokens a GEMM sees (the experts' weight-gradient scales run
  along each expert's tokens), so a whole-batch oracle differs by FP8's batch dependence
  (0.1-0.2 of the update: ``whole`` in the table, not asserted for these cases). Measured:
  DDP, ZeRO-1/2, pp2: bit-identical (``TOL_EXACT``). FSDP2 (BF16): gradients reduce in FP32
  where one process accumulates BF16 ``.grad``: 1e-3 of the update after one step, growing to
  0.085 after three (routing is discontinuous: a top-k choice that flips moves a token's whole
  gradient to another expert; FP8 roundings flip alike) (``TOL_FSDP``). ``fp8_communication``:
  FP8 weights on the wire for the Fp8Linear layers: measured 0.09 (``TOL_COMM``).
* tp2 (attention split, MoE blocks replicated), tp2 + sequence parallelism: the whole batch
  (each tp rank sees every sequence). The split linears' partial sums round differently in
  BF16; measured 0.20 of the update (``TOL_TP``).
* ``+fp32`` cases (precision fp32, FP8 still on) against an FP32 one-process run: rounding
  noise 2^-24 instead of 2^-9 rarely flips an FP8 rounding or a routing choice, so they show
  the sharding (FSDP2 over the expert dim) and the replication of the MoE blocks over tp are
  exact: measured 3e-6 (``TOL_FP32``); a missing or doubled tp sum, or an expert shard applied
  to the wrong experts, would be O(1). Under sequence parallelism the MoE block sees each
  rank's sequence shard: its forward is token-local (row scales), but the experts'
  weight-gradient scales run over the shard's tokens, FP8's batch dependence again (0.069,
  ``TOL_SP_FP32``); without FP8 (``tp2+sp+nofp8``) the summed gradients are exact (7e-7).
  With the aux loss on, tp2+sp (no FP8, FP32) trained the routers 0.64 of their update away
  from one process (measured with the refusal bypassed): hence the refusal.

Initial weights are BF16-exact (see ``tiny``). The router aux loss (``output_router_logits``,
coefficient 0.02, ~1% of the loss) is a product of means over one forward's tokens, so each
data-parallel rank's aux loss is that of its half: compared with the oracle's halves (the two
differ from the whole batch's by 0.2-0.5%: asserted, so the oracle matters). Pipeline stages
cannot compute it (it needs every layer's router logits) and split-gather sequence parallelism
would count it tp_size times: both refuse it with a ValueError, and run with
``output_router_logits=False`` here. ``fp8_communication=True`` (ZeRO-2, Gemini): expert
weights are all-gathered in the training dtype (the FP8 gather carries one scale per tensor,
the experts re-quantize per expert row): one warning per plugin, the reason in ``comm_report``.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.fp8.test_moe import COMMON, family_config

transformers = pytest.importorskip("transformers")

FAMILIES = ("mixtral", "qwen3_moe")
CASES = ("ddp", "zero1", "zero2", "zero2+comm", "gemini", "gemini+comm", "fsdp", "pp2", "tp2",
         "tp2+sp", "ddp+fp32", "gemini+fp32", "tp2+fp32", "tp2+sp+fp32", "tp2+sp+nofp8")
NO_AUX = ("tp2+sp", "pp2")  # refused with output_router_logits=True (see the docstring)
MATRIX_EXTRA = dict(router_aux_loss_coef=0.02, use_cache=False)  # on top of test_moe's COMMON
GLOBAL, SEQ, STEPS, LR = 4, 8, 3, 0.5
# (loss rel, master rel to the distance travelled); measured worst of both families, 3 steps:
TOL_EXACT = (1e-6, 1e-5)  # ddp, zero1/2, pp2: 5e-8, 0
TOL_FSDP = (2e-3, 0.15)  # gemini, fsdp: 3.5e-4, 0.085
TOL_COMM = (3e-3, 0.15)  # zero2/gemini + fp8_communication: 1.0e-3, 0.090
TOL_TP = (5e-3, 0.3)  # tp2, tp2+sp: 4.1e-3, 0.20
TOL_FP32 = (1e-5, 1e-3)  # +fp32, +nofp8: 1e-7, 3e-6
TOL_SP_FP32 = (2e-3, 0.15)  # tp2+sp+fp32: 7.6e-4, 0.069 (the experts' wgrad scales per shard)
AUX_TOL = (1e-6, 5e-3)  # exact cases: 0; others: 2.7e-3


def tiny(family: str, aux: bool = True) -> torch.nn.Module:
    """The tiny MoE causal LM of ``family`` (seed 0), FP32 holding BF16-exact values."""
    torch.manual_seed(0)
    cfg = family_config(family, **MATRIX_EXTRA, output_router_logits=aux)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    # DDP, ZeRO and the one-process Booster build their FP32 masters from the BF16-cast
    # parameters, the FSDP2 plugins from the FP32 ones; BF16-exact weights give every run the
    # same masters (else the init's rounding is ~0.1 of the first update of the
    # small-gradient weights: router, experts, q/k).
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, COMMON["vocab_size"], (GLOBAL, SEQ), generator=g)


def fp8_config():
    from fp8boost.fp8 import Fp8Config
    return Fp8Config(backend="emulated", min_numel=0)


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def oracle_of(case: str) -> tuple[bool, str, bool]:
    """(aux, mode, halves) of the one-process run ``case`` is compared with; mode: "bf16",
    "fp32" (FP8 on) or "nofp8" (FP32, no FP8)."""
    base = case.replace("+fp32", "").replace("+nofp8", "")
    mode = "fp32" if case.endswith("+fp32") else "nofp8" if case.endswith("+nofp8") else "bf16"
    return base not in NO_AUX, mode, not case.startswith("tp2")


def make_plugin(case: str):
    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.plugins import (GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin,
                                  TorchDDPPlugin, TorchFSDPPlugin)
    mode = oracle_of(case)[1]
    kw = dict(precision="bf16" if mode == "bf16" else "fp32", use_fp8=mode != "nofp8",
              fp8_config=fp8_config(), fp8_communication=case.endswith("+comm"),
              comm_config=Fp8CommConfig(min_payload_numel=0))
    name = case.split("+")[0]
    if name == "ddp":
        return TorchDDPPlugin(**kw)
    if name.startswith("zero"):
        return LowLevelZeroPlugin(stage=int(name[-1]), **kw)
    if name == "gemini":
        return GeminiPlugin(**kw)
    if name == "fsdp":
        return TorchFSDPPlugin(**kw)
    if name == "tp2":
        return HybridParallelPlugin(tp_size=2, enable_sequence_parallelism="+sp" in case, **kw)
    return HybridParallelPlugin(pp_size=2, num_microbatches=2, **kw)


def named_weights(raw, opt, plugin=None) -> dict[str, torch.Tensor]:
    """Every parameter's full FP32 master by HF name (collective: every rank calls it)."""
    from tests.plugins.hybrid_cases import gathered_masters
    if getattr(plugin, "pp_state", None) is not None:
        mine = {n: t.float() for n, t in gathered_masters(plugin, opt, raw).items()}
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)  # each pipeline rank holds its stages
        return {n: t for part in parts for n, t in part.items()}
    if getattr(plugin, "tp_state", None) is not None:
        return {n: t.float() for n, t in gathered_masters(plugin, opt, raw).items()}
    if hasattr(opt, "full_master_params") and hasattr(opt, "params"):
        by_id = dict(zip(map(id, opt.params), opt.full_master_params()))
        return {n: by_id[id(p)].float() for n, p in raw.named_parameters()}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in raw.named_parameters()}


def count_fp8_experts(raw) -> int:
    from fp8boost.fp8.moe import fp8_experts
    return len(fp8_experts(raw))


def reference(family: str, aux: bool, mode: str, halves: bool) -> dict:
    """One process on the whole batches, or each as two accumulated halves (loss / 2 each):
    losses, aux losses (the halves' mean), initial and final weights. BF16: ``Booster``'s
    ``MixedPrecision("fp8")``; FP32: ``convert_to_fp8`` (not for "nofp8") and a plain
    optimizer."""
    from fp8boost.booster import Booster, MixedPrecision
    from fp8boost.fp8 import convert_to_fp8
    raw = tiny(family, aux)
    init = {n: p.detach().float().clone() for n, p in raw.named_parameters()}
    if mode != "bf16":
        if mode == "fp32":
            convert_to_fp8(raw, fp8_config())
        model, opt = raw, sgd(raw)
        backward = torch.Tensor.backward
    else:
        booster = Booster(mixed_precision=MixedPrecision("fp8", fp8_config()), device="cpu")
        model, opt, *_ = booster.boost(raw, sgd(raw))
        backward = lambda loss: booster.backward(loss, opt)  # noqa: E731
    losses, auxes = [], []
    for s in range(STEPS):
        parts = batch(s).chunk(2) if halves else [batch(s)]
        loss_sum = aux_sum = 0.0
        for ids in parts:
            out = model(input_ids=ids, labels=ids)
            backward(out.loss / len(parts))
            loss_sum += out.loss.item() / len(parts)
            aux_sum += out.aux_loss.item() / len(parts) if aux else 0.0
        opt.step()
        opt.zero_grad()
        losses.append(loss_sum)
        auxes.append(aux_sum)
    final = named_weights(raw, opt) if mode == "bf16" else {
        n: p.detach().float().clone() for n, p in raw.named_parameters()}
    return {"losses": losses, "aux": auxes, "init": init, "final": final,
            "fp8_experts": count_fp8_experts(raw)}


def train_case(case: str, family: str, rank: int, world: int) -> dict:
    """Train ``case`` for STEPS steps; what is compared with the reference."""
    from fp8boost.booster import Booster
    plugin = make_plugin(case)
    booster = Booster(plugin=plugin)
    aux_on = oracle_of(case)[0]
    raw = tiny(family, aux_on)
    model, opt, *_ = booster.boost(raw, sgd(raw))
    losses, auxes = [], []
    for s in range(STEPS):
        ids = batch(s)
        if case == "pp2":
            out = booster.execute_pipeline(iter([{"input_ids": ids, "labels": ids}]), model,
                                           optimizer=opt)
            loss, aux = out["loss"], torch.zeros(())
        else:
            local = ids if case.startswith("tp2") else ids.chunk(world)[rank]
            out = model(input_ids=local, labels=local)
            booster.backward(out.loss, opt)
            loss, aux = out.loss, out.aux_loss if aux_on else torch.zeros(())
        opt.step()
        opt.zero_grad()
        both = torch.stack([loss.detach().float(), aux.detach().float()])
        dist.all_reduce(both)
        losses.append(both[0].item() / world)
        auxes.append(both[1].item() / world)
    n = torch.tensor(count_fp8_experts(raw))
    if case == "pp2":
        dist.all_reduce(n)  # each pipeline rank holds its own layers' experts
    tp = getattr(plugin, "tp_state", None)
    report = getattr(plugin, "comm_report", None)
    return {"losses": losses, "aux": auxes, "weights": named_weights(raw, opt, plugin),
            "fp8_experts": int(n),
            "expert_sharded": [k for k in (tp.shard_dims if tp else {}) if ".experts." in k],
            "why": report.why_not.get("param_all_gather", "") if report is not None else ""}


def refusals() -> dict:
    """The configurations that must raise a ValueError (at ``boost``, before any collective)."""
    from fp8boost.booster import Booster
    from fp8boost.plugins import HybridParallelPlugin
    out = {}
    for case, kw in (("pp2+aux", dict(pp_size=2, num_microbatches=2)),
                     ("tp2+sp+aux", dict(tp_size=2, enable_sequence_parallelism=True))):
        raw = tiny("mixtral", aux=True)
        plugin = HybridParallelPlugin(precision="bf16", use_fp8=True, fp8_config=fp8_config(), **kw)
        try:
            Booster(plugin=plugin).boost(raw, sgd(raw))
            out[case] = "no error"
        except ValueError as exc:
            out[case] = str(exc)
    return out


def _flat(ws: dict, names) -> torch.Tensor:
    return torch.cat([ws[n].reshape(-1) for n in names])


def _rel(got: dict, want: dict, init: dict, names) -> float:
    w = _flat(want, names)
    return float((_flat(got, names) - w).norm() / (w - _flat(init, names)).norm())


def compare(got: dict, ref: dict, whole: dict) -> dict:
    """Relative differences (computed on the rank: only numbers travel to the parent)."""
    names = sorted(ref["final"])
    experts = [n for n in names if ".experts." in n]
    init = ref["init"]
    return {
        "names_ok": sorted(got["weights"]) == names,
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])),
        "weight_rel": _rel(got["weights"], ref["final"], init, names),
        "expert_rel": _rel(got["weights"], ref["final"], init, experts),
        "whole_rel": _rel(got["weights"], whole["final"], init, names),
        "expert_moved": float((_flat(got["weights"], experts) - _flat(init, experts)).norm()
                              / _flat(init, experts).norm()),
        "expert_checksum": float(_flat(got["weights"], experts).double().sum()),
        "aux_rel": max((abs(a - b) / b for a, b in zip(got["aux"], ref["aux"]) if b), default=0.0),
        "fp8_experts": got["fp8_experts"], "ref_fp8_experts": ref["fp8_experts"],
        "expert_sharded": got["expert_sharded"], "why": got["why"]}


def _suite(rank: int, world: int) -> dict:
    table: dict = {"refusals": refusals()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for family in FAMILIES:
            refs: dict = {}

            def ref(key):
                if key not in refs:
                    refs[key] = reference(family, *key)
                return refs[key]
            for case in CASES:
                aux, mode, halves = oracle_of(case)
                got = train_case(case, family, rank, world)
                table[(case, family)] = compare(got, ref((aux, mode, halves)),
                                                ref((aux, mode, False)))
            table[("aux", family)] = (ref((True, "bf16", True))["aux"],
                                      ref((True, "bf16", False))["aux"])
    table["expert_warnings"] = sorted({str(w.message) for w in caught
                                       if "Fp8Experts" in str(w.message)})
    return table


@pytest.fixture(scope="module")
def tables():
    return run_distributed(_suite, 2, timeout=400)


def _cases(table: dict):
    return [(k, v) for k, v in table.items() if isinstance(k, tuple) and k[0] in CASES]


def tolerance(case: str) -> tuple[float, float]:
    if case == "tp2+sp+fp32":
        return TOL_SP_FP32
    if case.endswith(("+fp32", "+nofp8")):
        return TOL_FP32
    if case.endswith("+comm"):
        return TOL_COMM
    if case.startswith("tp2"):
        return TOL_TP
    return TOL_FSDP if case in ("gemini", "fsdp") else TOL_EXACT


def test_experts_run_fp8_in_every_plugin(tables):
    want = {True: COMMON["num_hidden_layers"], False: 0}  # use_fp8=False keeps HF experts
    bad = [f"{case}/{fam}: {r['fp8_experts']} Fp8Experts (one process: {r['ref_fp8_experts']})"
           for (case, fam), r in _cases(tables[0])
           if not r["fp8_experts"] == r["ref_fp8_experts"] == want[oracle_of(case)[1] != "nofp8"]]
    assert not bad, "\n".join(bad)


def test_losses_and_weights_match_one_process(tables):
    bad = []
    for (case, fam), r in _cases(tables[0]):
        tl, tw = tolerance(case)
        if not r["names_ok"]:
            bad.append(f"{case}/{fam}: parameter names differ from the one-process model's")
        if not (r["loss_rel"] <= tl and r["weight_rel"] <= tw and r["expert_rel"] <= tw):
            bad.append(f"{case}/{fam}: loss {r['loss_rel']:.2e} (<= {tl}), weights "
                       f"{r['weight_rel']:.2e}, experts {r['expert_rel']:.2e} (<= {tw})")
        if not r["expert_moved"] > 1e-3:  # the optimizer really stepped the expert weights
            bad.append(f"{case}/{fam}: expert weights moved only {r['expert_moved']:.1e}")
    assert not bad, "\n".join(bad) + "\n" + summary(tables[0])


def test_router_aux_loss_as_the_model_defines_it(tables):
    bad = []
    for (case, fam), r in _cases(tables[0]):
        tol = AUX_TOL[0] if tolerance(case) == TOL_EXACT else AUX_TOL[1]
        if oracle_of(case)[0] and not r["aux_rel"] <= tol:
            bad.append(f"{case}/{fam}: aux loss {r['aux_rel']:.1e} from the oracle's (<= {tol})")
    assert not bad, "\n".join(bad)
    for fam in FAMILIES:  # the halves' mean is not the whole batch's: the oracle matters
        halves, whole = tables[0][("aux", fam)]
        assert max(abs(a - b) / b for a, b in zip(halves, whole)) > AUX_TOL[1] / 2, fam


def test_tp_replicates_the_moe_blocks(tables):
    for fam in FAMILIES:
        for case in ("tp2", "tp2+sp", "tp2+fp32", "tp2+sp+fp32"):
            r0, r1 = tables[0][(case, fam)], tables[1][(case, fam)]
            assert r0["expert_sharded"] == [], r0["expert_sharded"]
            # replicated experts stay identical on both tp ranks through training
            assert r0["expert_checksum"] == r1["expert_checksum"], (case, fam)


def test_fp8_communication_keeps_experts_in_training_dtype_and_says_why(tables):
    for (case, fam), r in _cases(tables[0]):
        says = "Fp8Experts" in r["why"] and "per expert row" in r["why"]
        assert says == case.endswith("+comm"), (case, fam, r["why"])
    # one warning per plugin whose FP8 gather leaves the experts in the training dtype
    names = sorted(w.split(":")[0] for w in tables[0]["expert_warnings"])
    assert names == ["fp8boost GeminiPlugin", "fp8boost LowLevelZeroPlugin"], names


def test_unsupported_moe_configurations_refuse(tables):
    got = tables[0]["refusals"]
    assert "pipeline stages do not pass router logits" in got["pp2+aux"], got["pp2+aux"]
    assert "output_router_logits=False" in got["pp2+aux"]
    assert "count tp_size=2 times" in got["tp2+sp+aux"], got["tp2+sp+aux"]


def summary(table: dict) -> str:
    """The parity table, one line per case."""
    return "\n".join(
        f"{case:12s} {fam:10s} loss {r['loss_rel']:.1e} weights {r['weight_rel']:.1e} experts "
        f"{r['expert_rel']:.1e} (whole batch {r['whole_rel']:.3f}) aux {r['aux_rel']:.1e} "
        f"moved {r['expert_moved']:.3f} Fp8Experts {r['fp8_experts']}"
        for (case, fam), r in _cases(table))
