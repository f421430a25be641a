"""MoeHybridParallelPlugin optimizer checkpoints on gloo: BF16 + FP8 (emulated, FP8 dispatch),
AdamW with a LR scheduler.

2 ranks (ep2) and 4 ranks (ep2 x dp2), ZeRO 0/1/2: train K steps, save model + optimizer +
scheduler (separately, or as one ``save_checkpoint``), train M more; a fresh model, optimizer
and scheduler loading them and training the same M steps gives bit-identical losses and
weights. Also: loading at another dp size, ZeRO stage or ep size (ep2 -> ep1 x dp2 and ep4)
restores every master weight and Adam moment exactly, each expert's from the saved ep rank
that held it, and so does LowLevelZeroPlugin's optimizer directory (every expert on every
rank); a save that fails on one rank leaves the previous checkpoint at the path loadable.
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
    from fp8boost.parallel.ep import EpExperts
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
    # Whole moments where the state is not sharded (dp 1): _check_loaded compares with them.
    moments = [opt.optim.state[m]["exp_avg"][:w.numel()].clone().view_as(w)
               for m, w in zip(opt.masters, masters)] if opt.shard_world_size == 1 else None
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
    return {"masters": masters, "moments": moments, "losses": want}


def _check_loaded(booster, opt, saved: list[dict]) -> None:
    """Every master weight and Adam moment this rank holds equals the saved one exactly.

    ``saved[e]``: what ep rank ``e`` of the saving run held (dp 1: whole local tensors); an
    expert tensor's whole ``[E, ...]`` value is theirs concatenated in ep order.
    """
    plugin = booster.plugin
    ep_rank = dist.get_rank(plugin.ep_group)
    for i, (p, got, s, m) in enumerate(zip(opt.params, opt.full_master_params(),
                                           opt.checkpoint_layout(), opt.masters)):
        def want(key: str) -> torch.Tensor:
            parts = [part[key][i] for part in saved]
            if not plugin.is_expert_param(p):
                assert all(torch.equal(parts[0], x) for x in parts), i  # replicated
                return parts[0]
            rows = got.shape[0]  # this rank's experts of the whole [E, ...] tensor
            return torch.cat(parts)[ep_rank * rows:(ep_rank + 1) * rows]
        assert torch.equal(got, want("masters")), f"master {i}"
        moment = opt.optim.state[m]["exp_avg"][:s.length]
        assert torch.equal(moment, want("moments").reshape(-1)[s.start:s.end]), f"moment {i}"


def _load_elsewhere(rank: int, world: int, root: str, saved: list[dict], ep: int,
                    zero: int) -> None:
    """The ep2 (dp 1) checkpoint loaded at ``ep`` x ``world/ep``: state exact; training on."""
    booster, model, opt, sched = _boost(ep, zero)
    _load(booster, model, opt, sched, root, whole=False)
    _check_loaded(booster, opt, saved)
    losses = _train(rank, world, booster, model, opt, sched, range(K, K + M))
    # Not bit-exact (other ranks run other experts, FP8 dispatch differs): the same run.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(saved[0]["losses"]),
                               rtol=1e-2, atol=0)


def _failed_save_keeps_old(rank: int, world: int, root: str) -> None:
    """A save failing on rank 1 raises on every rank; the previous checkpoint still loads."""
    from fp8boost.checkpoint_io import CheckpointSaveError
    from fp8boost.checkpoint_io import moe as moe_io
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


def _from_zero_plugin(rank: int, world: int, root: str) -> None:
    """An optimizer directory of LowLevelZeroPlugin (ZeRO-2 over both ranks, every expert on
    each) loads into the MoE plugin at ep2: each rank takes its experts' state exactly."""
    from fp8boost.booster import Booster
    from fp8boost.fp8 import Fp8Config
    from fp8boost.plugins import LowLevelZeroPlugin
    cfg = Fp8Config(recipe="rowwise", backend="emulated", min_numel=0)
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="bf16", use_fp8=True,
                                                fp8_config=cfg, max_norm=1.0))
    model = tiny("mixtral")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    _train(rank, world, booster, model, opt, sched, range(K))
    masters = opt.full_master_params()
    moments = []
    for m, s, w in zip(opt.masters, opt.checkpoint_layout(), masters):
        parts = [torch.empty_like(m) for _ in range(world)]  # padded chunks: equal sizes
        dist.all_gather(parts, opt.optim.state[m]["exp_avg"])
        moments.append(torch.cat(parts)[:s.numel].view_as(w))
    path = os.path.join(root, "zero2")
    booster.save_model(model, os.path.join(path, "model"))
    booster.save_optimizer(opt, os.path.join(path, "optim"))
    booster.save_lr_scheduler(sched, os.path.join(path, "sched.pt"))
    booster, model, opt, sched = _boost(2, 0)
    _load(booster, model, opt, sched, path, whole=False)
    _check_loaded(booster, opt, [{"masters": masters, "moments": moments}])
    _train(rank, world, booster, model, opt, sched, range(K, K + M))


def _ranks2(rank: int, world: int, root: str) -> dict:
    out = {0: _round_trip(rank, world, 0, os.path.join(root, "z0"), whole=False)}
    out[2] = _round_trip(rank, world, 2, os.path.join(root, "z2"), whole=True)
    both = [None] * world
    dist.all_gather_object(both, out[0])  # ep rank r = rank r here
    _load_elsewhere(rank, world, os.path.join(root, "z0"), both, ep=1, zero=2)
    _failed_save_keeps_old(rank, world, os.path.join(root, "z0"))
    _from_zero_plugin(rank, world, root)
    return out


def _ranks4(rank: int, world: int, root: str, saved: list) -> None:
    """Loads the 2-rank (ep2, dp1) checkpoint at ep2 x dp2 and at ep4 exactly; ep2 x dp2
    round-trips its own checkpoints (ZeRO 1 and 2 sharded over dp)."""
    for ep, zero in ((2, 1), (4, 0)):
        _load_elsewhere(rank, world, os.path.join(root, "z0"), [s[0] for s in saved], ep, zero)
    _round_trip(rank, world, 2, os.path.join(root, "z2_dp2"), whole=False)
    _round_trip(rank, world, 1, os.path.join(root, "z1_dp2"), whole=True)


def test_moe_optimizer_checkpoint_resume_is_exact(tmp_path) -> None:
    root = str(tmp_path)
    saved = run_distributed(_ranks2, 2, root)
    assert saved[0][0]["losses"] and saved[0][2]["losses"]
    run_distributed(_ranks4, 4, root, saved)
