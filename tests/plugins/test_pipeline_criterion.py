"""``execute_pipeline``'s criterion gets the model's own HF output (issue 23, item 3).

Colossal-AI users write ``criterion=lambda o, i: o.loss`` or ``lambda o, i: o[0]``: the
criterion receives what ``model(**batch)`` returns on the non-pipeline plugins, a
``CausalLMOutputWithPast`` with the HF loss (labels in the batch) and the logits. Each form,
and a criterion that computes its own loss from ``o.logits`` and ``i["labels"]``, must train
exactly like the default criterion: at pp2 (2 gloo ranks) and pp2 x tp2 (4 ranks, vocabulary-
parallel ``lm_head``: ``o.logits`` is this rank's vocabulary slice, ``o.loss`` the full-vocabulary
loss), with FP8 GEMMs (emulated, tensorwise) and FP32 masters.

Tolerances (measured on torch 2.13 CPU):

* ``o.loss``, ``o[0]``, ``o["loss"]``: the same computation as the default criterion, so the
  loss and every gradient are bit-identical.
* own loss from ``o.logits``: the same cross-entropy, summed in another order at tp2: loss
  within 1e-5 relative (measured 0 at pp2, 9e-8 at tp2); gradients within 1e-3 of their norm
  (measured 0: the logits' gradient is softmax - onehot / tokens either way; the margin is for
  an fp32 rounding difference that flips an e5m2 cast inside the FP8 GEMMs).
* against one unsplit process (same FP8 recipe), before and after one SGD step with ``o[0]``:
  1e-2 relative, as the FP8 pipeline parity tests (micro-batches take their own FP8 scales).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.plugins.pipeline_cases import VOCAB, global_batch, tiny_model

FORMS = ("default", "o.loss", "o[0]", 'o["loss"]', "own")


def _own_loss(plugin):
    """A user's criterion: next-token cross-entropy from ``o.logits`` and ``i["labels"]``.

    Under tp the logits are this rank's vocabulary slice, so the loss must be vocabulary-
    parallel, as ``docs/PLUGINS.md`` says.
    """
    from fp8boost.parallel.tp import vocab_parallel_cross_entropy

    def own(o, i) -> torch.Tensor:
        logits = o.logits[:, :-1].reshape(-1, o.logits.shape[-1])
        target = i["labels"][:, 1:].reshape(-1)
        if plugin.tp_size == 1:
            return F.cross_entropy(logits.float(), target)
        group = plugin.tp_state.group
        start = dist.get_rank(group) * logits.shape[-1]
        return vocab_parallel_cross_entropy(logits, target, start, group).mean()
    return own


def _probe(plugin, seen: dict):
    """``o.loss``, recording on the last stage what the criterion was given."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def probe(o, i) -> torch.Tensor:
        loss = o.loss
        seen["hf_class"] = isinstance(o, CausalLMOutputWithPast)
        seen["same_views"] = o[0] is loss and o["loss"] is loss and \
            o["logits"] is o.logits and o[1] is o.logits
        seen["logits"] = tuple(o.logits.shape)
        seen["rows"] = tuple(i["labels"].shape)
        full = o.logits.detach()
        if plugin.tp_size > 1:  # the slices, in tp-rank order, are the whole vocabulary
            parts = [torch.empty_like(full) for _ in range(plugin.tp_size)]
            dist.all_gather(parts, full.contiguous(), group=plugin.tp_state.group)
            full = torch.cat(parts, dim=-1)
        want = F.cross_entropy(full[:, :-1].reshape(-1, VOCAB).float(),
                               i["labels"][:, 1:].reshape(-1))
        seen["full_vocab_rel"] = max(seen.get("full_vocab_rel", 0.0),
                                     abs(loss.item() - want.item()) / want.item())
        return loss
    return probe


def _criterion(form: str, plugin):
    return {"default": None, "o.loss": lambda o, i: o.loss, "o[0]": lambda o, i: o[0],
            'o["loss"]': lambda o, i: o["loss"], "own": _own_loss(plugin)}[form]


def _rel(a: list, b: list) -> float:
    """Relative distance of two gradient lists (inf unless both have every gradient)."""
    if not b or any(x is None or y is None for x, y in zip(a, b)):
        return float("inf")
    num = sum(float(((x - y) ** 2).sum()) for x, y in zip(a, b))
    return (num / sum(float((y ** 2).sum()) for y in b)) ** 0.5


def _criteria(rank: int, world: int, tp: int) -> dict:
    """Every criterion form on one pp2 (x tp) FP8 pipeline: losses, gradients, one step."""
    from fp8boost.booster import Booster
    from fp8boost.fp8 import Fp8Config
    from fp8boost.parallel.zero import ZeroOptimizer
    from fp8boost.plugins import HybridParallelPlugin
    from fp8boost.plugins.precision import prepare_model

    cfg = Fp8Config(backend="emulated", min_numel=0)
    model = tiny_model(4)
    ref = copy.deepcopy(model)
    plugin = HybridParallelPlugin(tp_size=tp, pp_size=2, precision="fp32", use_fp8=True,
                                  fp8_config=cfg, num_microbatches=2)
    booster = Booster(plugin=plugin, device="cpu")
    wrapped, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.5))
    ids = global_batch(0)
    batch = {"input_ids": ids, "labels": ids}
    out: dict = {"seen": {}}
    losses, grads = {}, {}
    for form in FORMS:  # training steps without optimizer.step(): same weights for each form
        crit = _probe(plugin, out["seen"]) if form == "o.loss" else _criterion(form, plugin)
        res = booster.execute_pipeline(iter([batch]), wrapped, criterion=crit, optimizer=opt)
        losses[form] = res["loss"].item()
        grads[form] = [None if p.grad is None else p.grad.clone() for p in opt.params]
        opt.zero_grad()
    out["has_grads"] = bool(opt.params) and all(g is not None and bool(g.abs().sum())
                                                for g in grads["default"])
    out["loss"] = losses
    out["grads_equal"] = {f: all(torch.equal(a, b) for a, b in zip(grads[f], grads["default"]))
                          for f in FORMS}
    out["own_grad_rel"] = _rel(grads["own"], grads["default"])
    with torch.no_grad():  # evaluation (forward only) hands the criterion the same output
        out["eval"] = {f: booster.execute_pipeline(iter([batch]), wrapped,
                                                   criterion=_criterion(f, plugin))["loss"].item()
                       for f in FORMS}
    booster.execute_pipeline(iter([batch]), wrapped, criterion=lambda o, i: o[0], optimizer=opt)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        out["after"] = booster.execute_pipeline(iter([batch]), wrapped)["loss"].item()
    # the unsplit model in this process, same FP8 recipe, one SGD step on the same batch
    prepare_model(ref, "fp32", True, cfg, torch.device("cpu"))
    ref_opt = ZeroOptimizer(torch.optim.SGD(ref.parameters(), lr=0.5))
    r = ref(input_ids=ids, labels=ids).loss
    ref_opt.backward(r)
    ref_opt.step()
    with torch.no_grad():
        out["ref"] = (r.item(), ref(input_ids=ids, labels=ids).loss.item())
    return out


def _check(results: list, last_ranks: list, logits: tuple) -> None:
    for rank, res in enumerate(results):
        loss, want = res["loss"], res["loss"]["default"]
        for form in ("o.loss", "o[0]", 'o["loss"]'):
            assert loss[form] == want and res["grads_equal"][form], (rank, form, res)
            assert res["eval"][form] == res["eval"]["default"], (rank, form, res["eval"])
        assert loss["own"] == pytest.approx(want, rel=1e-5), (rank, loss)
        assert res["eval"]["own"] == pytest.approx(res["eval"]["default"], rel=1e-5), rank
        assert res["own_grad_rel"] <= 1e-3, (rank, res["own_grad_rel"])
        assert res["has_grads"], rank
        ref_before, ref_after = res["ref"]
        assert want == pytest.approx(ref_before, rel=1e-2), (rank, want, ref_before)
        assert res["eval"]["default"] == pytest.approx(ref_before, rel=1e-2), rank
        assert res["after"] == pytest.approx(ref_after, rel=1e-2), (rank, res["after"], ref_after)
        assert res["after"] < want - 0.05, (rank, res["after"], want)  # the step trained
        seen = res["seen"]
        if rank in last_ranks:  # the criterion ran here: a real HF output, micro-batch rows
            assert seen["hf_class"] and seen["same_views"], (rank, seen)
            assert seen["logits"] == logits and seen["rows"] == (4, 16), (rank, seen)
            assert seen["full_vocab_rel"] <= 1e-5, (rank, seen)
        else:
            assert seen == {}, (rank, seen)


def test_criterion_gets_hf_output_pp2() -> None:
    _check(run_distributed(_criteria, 2, 1), last_ranks=[1], logits=(4, 16, VOCAB))


def test_criterion_gets_hf_output_pp2_tp2() -> None:
    # ranks (pp, tp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1); lm_head split over tp
    _check(run_distributed(_criteria, 4, 2), last_ranks=[2, 3], logits=(4, 16, VOCAB // 2))


def test_criterion_must_return_a_scalar_tensor() -> None:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from fp8boost.parallel.pipeline.runner import check_criterion_loss

    loss = torch.tensor(2.5, requires_grad=True)
    assert check_criterion_loss(loss) is loss
    one = torch.ones(1, requires_grad=True)
    assert check_criterion_loss(one).shape == ()
    out = CausalLMOutputWithPast(loss=loss, logits=torch.zeros(1, 2, 3))
    for bad, what in ((out, "CausalLMOutputWithPast"), ((loss, out.logits), "tuple"),
                      (2.5, "float"), (torch.ones(4), r"shape \(4,\)"),
                      (torch.ones((), dtype=torch.long), "torch.int64")):
        with pytest.raises(TypeError, match=what) as err:
            check_criterion_loss(bad)
        assert "outputs.loss" in str(err.value) and "outputs[0]" in str(err.value)
