"""MoeHybridParallelPlugin optimizer checkpoints on gloo: BF16 + FP8 (emulated, FP8 dispatch),
AdamW with a LR scheduler.

2 ranks (ep2) and 4 ranks (ep2 x dp2), ZeRO 0/1/2: train K steps, save model + optimizer +
scheduler (separately, or as one ``save_checkpoint``), train M more; a fresh model, optimizer
and scheduler loading them and training the same M steps gives bit-identical losses and
weights. Also: loading at another dp size restores every master weight and Adam moment
exactly; another ep size is refused before any collective; a save that fails on one rank
leaves the previous checkpoint at the path loadable.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.plugins.test_moe_plugin import GLOBAL, batch, tiny

K, M = 2, 2


def _boost(ep: int, zero: int):
    from fp8boost.booster import Booster
    from fp8boost.fp8 import Fp8Config
    from fp8boost.plugins import MoeHybridParallelPlugin
    cfg = Fp8Config(recipe="rowwise", backend="emulated", min_numel=0)
    plugin = MoeHybridParallelPlugin(ep_size=ep, zero_stage=zero, precision="bf16", use_fp8=True,
                                     fp8_communication=True, fp8_config=cfg, max_norm=1.0)
    booster = Booster(plugin=plugin)
    model = tiny("mixtral")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    return booster, model, opt, sched


def _train(rank: int, world: int, booster, model, opt, sched, steps: range) -> list[float]:
    b, losses = GLOBAL // world, []
    for s in steps:
        ids = batch(s)[rank * b:(rank + 1) * b]
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        sched.step()
        total = loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _weights(model) -> dict[str, torch.Tensor]:
    from fp8boost.plugins.moe_dispatch import EpExperts
    out = {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}
    for name, m in model.unwrap().named_modules():
        if isinstance(m, EpExperts):
            out.update({f"{name}.{p}": m.full_param(p) for p in m.names})
    return out


def _save(booster, model, opt, sched, root: str, whole: bool) -> None:
    if whole:  # one resumable directory
        booster.save_checkpoint(os.path.join(root, "state"), model, opt, sched, extra={"step": K})
    else:
        booster.save_model(model, os.path.join(root, "model"))
        booster.save_optimizer(opt, os.path.join(root, "optim"))
        booster.save_lr_scheduler(sched, os.path.join(root, "sched.pt"))


def _load(booster, model, opt, sched, root: str, whole: bool) -> None:
    if whole:
        extra = booster.load_checkpoint(os.path.join(root, "state"), model, opt, sched)
        assert extra == {"step": K}
    else:
        booster.load_model(model, os.path.join(root, "model"))
        booster.load_optimizer(opt, os.path.join(root, "optim"))
        booster.load_lr_scheduler(sched, os.path.join(root, "sched.pt"))


def _round_trip(rank: int, world: int, zero: int, root: str, whole: bool) -> dict:
    """Train K, save, train M; a fresh run loads and trains M: bit-identical."""
    booster, model, opt, sched = _boost(2, zero)
    _train(rank, world, booster, model, opt, sched, range(K))
    masters = [m.clone() for m in opt.full_master_params()]
    moments = [opt.optim.state[m]["exp_avg"].clone() for m in opt.masters]
    _save(booster, model, opt, sched, root, whole)
    want = _train(rank, world, booster, model, opt, sched, range(K, K + M))
    want_w = _weights(model)
    booster, model, opt, sched = _boost(2, zero)
    _load(booster, model, opt, sched, root, whole)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.7 ** K)
    got = _train(rank, world, booster, model, opt, sched, range(K, K + M))
    assert got == want, f"zero {zero}: resumed losses {got} != {want}"
    for name, w in _weights(model).items():
        assert torch.equal(w, want_w[name]), f"zero {zero}: {name} differs after resume"
    full = [(s.start, s.end) for s in opt.checkpoint_layout()]
    return {"masters": masters, "moments": moments, "ranges": full, "losses": want}


def _refusals(rank: int, world: int, root: str, saved_ep: int) -> None:
    """Another ep size: ValueError naming both layouts on every rank, before any collective
    (the ranks reach the barrier after it together)."""
    ep = 1 if saved_ep != 1 else 2
    booster, model, opt, _ = _boost(ep, 0)
    with pytest.raises(ValueError, match=f"saved at ep_size={saved_ep} .*this run is "
                                         f"ep_size={ep}.*resume with ep_size={saved_ep}"):
        booster.load_optimizer(opt, os.path.join(root, "optim"))
    dist.barrier()


def _failed_save_keeps_old(rank: int, world: int, root: str) -> None:
    """A save failing on rank 1 raises on every rank; the previous checkpoint still loads."""
    from fp8boost.plugins.checkpoint_io import CheckpointSaveError
    from fp8boost.plugins.checkpoint_io import moe as moe_io
    booster, model, opt, sched = _boost(2, 0)
    path = os.path.join(root, "optim")
    before = sorted(os.listdir(path))
    real = moe_io.write_optimizer

    def broken(optimizer, directory, is_writer):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
        real(optimizer, directory, is_writer)

    moe_io.write_optimizer = broken
    try:
        with pytest.raises(CheckpointSaveError, match="previous checkpoint .* is intact"):
            booster.save_optimizer(opt, path)
    finally:
        moe_io.write_optimizer = real
    assert sorted(os.listdir(path)) == before
    assert not [d for d in os.listdir(root) if ".tmp-" in d]
    booster.load_optimizer(opt, path)  # checksums verified, state read


def _ranks2(rank: int, world: int, root: str) -> dict:
    out = {0: _round_trip(rank, world, 0, os.path.join(root, "z0"), whole=False)}
    out[2] = _round_trip(rank, world, 2, os.path.join(root, "z2"), whole=True)
    _refusals(rank, world, os.path.join(root, "z0"), saved_ep=2)
    _failed_save_keeps_old(rank, world, os.path.join(root, "z0"))
    return out


def _ranks4(rank: int, world: int, root: str, saved: list) -> None:
    """ep2 x dp2: loads the 2-rank (dp1) checkpoint re-sharded exactly, round-trips itself."""
    booster, model, opt, sched = _boost(2, 1)
    _load(booster, model, opt, sched, os.path.join(root, "z0"), whole=False)
    ref = saved[rank % 2][0]  # the world-2 rank with the same experts (ep rank = rank % 2)
    for want, got in zip(ref["masters"], opt.full_master_params()):
        assert torch.equal(want, got)
    for want, s, m in zip(ref["moments"], opt.checkpoint_layout(), opt.masters):
        assert torch.equal(opt.optim.state[m]["exp_avg"][:s.length], want[s.start:s.end])
    _refusals(rank, world, os.path.join(root, "z0"), saved_ep=2)
    _round_trip(rank, world, 2, os.path.join(root, "z2_dp2"), whole=False)
    _round_trip(rank, world, 1, os.path.join(root, "z1_dp2"), whole=True)


def test_moe_optimizer_checkpoint_resume_is_exact(tmp_path) -> None:
    root = str(tmp_path)
    saved = run_distributed(_ranks2, 2, root)
    assert saved[0][0]["losses"] and saved[0][2]["losses"]
    run_distributed(_ranks4, 4, root, saved)
