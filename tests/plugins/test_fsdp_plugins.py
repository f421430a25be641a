"""GeminiPlugin and TorchFSDPPlugin (FSDP2) on gloo: parity with one process, sharding,
offload, gradient accumulation, checkpoints (HF export, DCP resume, resharding to 1 and 4
ranks), meta-device init with a sharded HF load, and argument checks.

Tolerances (tiny Llama, 3 steps of SGD with momentum for parity, as in
test_plugins_distributed.py: Adam's normalisation turns the sign of tiny noisy gradients into
full-size updates):
* losses vs a single-process ``Booster(mixed_precision=...)`` run (BF16 compute, FP32 masters,
  the same math): within 1% relative. Both sides run BF16 matmuls; they differ in reduction
  order (two half batches summed in FP32) and, for FP8, in per-rank activation scales.
* FP32 masters, ``||w - w_ref|| / ||w_ref - w_0||``: bf16 2e-2, fp8 0.15 (each rank scales
  its own half batch: different e4m3/e5m2 grid points, relative step up to 2^-3), FP8
  all-gather 0.2 (the same plus the wire's e4m3 weights feeding BF16 dequantize).
* Checkpoint round trips and resharding: bit-exact (FP32 tensors are copied, not recomputed).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.plugins.helpers import rel_update_error

STEPS = 3


def _tiny(seed: int = 0, device=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    with torch.device(device or "cpu"):
        return LlamaForCausalLM(cfg)


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(100 + step))


def _plugin(kind: str, variant: str, **kw):
    from fp8boost.fp8 import Fp8Config
    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.plugins import GeminiPlugin, TorchFSDPPlugin

    cls = GeminiPlugin if kind == "gemini" else TorchFSDPPlugin
    if variant != "bf16":
        kw.update(use_fp8=True, fp8_config=Fp8Config(backend="emulated", min_numel=0))
    if variant == "fp8c":
        kw.update(fp8_communication=True, comm_config=Fp8CommConfig(min_numel=0))
    return cls(**kw)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(booster, model, opt, rank, world, start=0, steps=STEPS, micro=1):
    losses = []
    for s in range(start, start + steps):
        ids = _ids(s)
        mine = ids[rank * 4 // world:(rank + 1) * 4 // world]
        total = torch.zeros(())
        for k, part in enumerate(mine.chunk(micro)):
            loss = model(input_ids=part, labels=part).loss / micro
            if k < micro - 1:
                with booster.no_sync(model, opt):
                    booster.backward(loss, opt)
            else:
                booster.backward(loss, opt)
            total += loss.detach().float()
        opt.step()
        opt.zero_grad()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses


def _full(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in model.unwrap().named_parameters()}


def _reference(variant: str):
    """One process, the whole batch: Booster(mixed_precision=bf16|fp8), FP32 masters."""
    from fp8boost.booster import Booster, MixedPrecision
    from fp8boost.fp8 import Fp8Config

    mp = "bf16" if variant == "bf16" else MixedPrecision(
        "fp8", Fp8Config(backend="emulated", min_numel=0))
    booster = Booster(mixed_precision=mp, device="cpu")
    raw = _tiny()
    init = {n: p.detach().float().clone() for n, p in raw.named_parameters()}
    model, opt, *_ = booster.boost(raw, _sgd(raw))
    losses = _train(booster, model, opt, 0, 1)
    names = [n for n, _ in raw.named_parameters()]
    return losses, dict(zip(names, opt.full_master_params())), init


def _parity(rank, world):
    from fp8boost.booster import Booster

    for variant, w_tol in (("bf16", 2e-2), ("fp8", 0.15), ("fp8c", 0.2)):
        ref_losses, ref_w, init = _reference(variant)
        for kind in ("gemini", "torchfsdp"):
            raw = _tiny()
            booster = Booster(plugin=_plugin(kind, variant), device="cpu")
            model, opt, *_ = booster.boost(raw, _sgd(raw))
            losses = _train(booster, model, opt, rank, world)
            rel = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
            assert rel < 1e-2, (kind, variant, losses, ref_losses)
            full = _full(model)
            err = rel_update_error([full[n] for n in ref_w], list(ref_w.values()),
                                   [init[n] for n in ref_w])
            assert err < w_tol, (kind, variant, err)
            if variant == "fp8c":
                assert len(booster.plugin.comm_report["fp8_all_gather"]) == 14
                assert "reduce_scatter" in booster.plugin.comm_report["why_not"]
            # FP32 masters and Adam state sharded 1/world (dim 0 split, padded to even rows).
            p = model.unwrap().model.layers[0].mlp.up_proj.weight
            assert p.dtype == torch.float32 and p.to_local().numel() == p.numel() // world
            assert opt.state[p]["momentum_buffer"].to_local().numel() == p.numel() // world


def _features(rank, world, tmp):
    from transformers import LlamaForCausalLM

    from fp8boost.booster import Booster

    # Offload (optimizer on the CPU through FSDP2's policy) matches no offload.
    runs = {}
    for frac in (0.0, 1.0):
        raw = _tiny()
        booster = Booster(plugin=_plugin("gemini", "bf16", offload_optim_frac=frac), device="cpu")
        model, opt, *_ = booster.boost(raw, torch.optim.AdamW(raw.parameters(), lr=1e-3))
        runs[frac] = _train(booster, model, opt, rank, world)
    assert runs[0.0] == pytest.approx(runs[1.0], rel=1e-6)
    # Gradient accumulation: 2 micro-batches under no_sync == one batch (FP32: exact-ish).
    res = []
    for micro in (1, 2):
        raw = _tiny()
        booster = Booster(plugin=_plugin("gemini", "bf16", precision="fp32",
                                         enable_gradient_accumulation=True), device="cpu")
        model, opt, *_ = booster.boost(raw, torch.optim.AdamW(raw.parameters(), lr=1e-3))
        _train(booster, model, opt, rank, world, micro=micro)
        res.append(_full(model))
    for n in res[0]:
        torch.testing.assert_close(res[0][n], res[1][n], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="enable_gradient_accumulation"):
        raw = _tiny()
        b = Booster(plugin=_plugin("gemini", "bf16"), device="cpu")
        m, o, *_ = b.boost(raw, torch.optim.AdamW(raw.parameters(), lr=1e-3))
        with b.no_sync(m, o):
            pass

    # Checkpoints: HF export, resumable DCP state, optimizer round trip.
    raw = _tiny()
    booster = Booster(plugin=_plugin("gemini", "fp8c"), device="cpu")
    model, opt, *_ = booster.boost(raw, torch.optim.AdamW(raw.parameters(), lr=1e-3))
    sched = torch.optim.lr_scheduler.StepLR(opt.optim, step_size=1, gamma=0.9)
    _train(booster, model, opt, rank, world)
    booster.save_model(model, os.path.join(tmp, "hf"), size_per_shard_mb=0.05)
    booster.save_checkpoint(os.path.join(tmp, "state"), model, opt, sched, extra={"step": STEPS})
    booster.save_optimizer(opt, os.path.join(tmp, "optim"))
    saved = _full(model)
    cont = _train(booster, model, opt, rank, world, start=STEPS)
    if rank == 0:
        hf = LlamaForCausalLM.from_pretrained(os.path.join(tmp, "hf"))
        for n, p in hf.named_parameters():
            assert torch.equal(p, saved[n]), n
        assert len([f for f in os.listdir(os.path.join(tmp, "hf")) if f.endswith(".safetensors")]) > 2
    raw2 = _tiny(seed=7)
    b2 = Booster(plugin=_plugin("gemini", "fp8c"), device="cpu")
    m2, o2, *_ = b2.boost(raw2, torch.optim.AdamW(raw2.parameters(), lr=1e-3))
    sched2 = torch.optim.lr_scheduler.StepLR(o2.optim, step_size=1, gamma=0.9)
    assert b2.load_checkpoint(os.path.join(tmp, "state"), m2, o2, sched2) == {"step": STEPS}
    assert all(torch.equal(a, saved[n]) for n, a in _full(m2).items())
    assert _train(b2, m2, o2, rank, world, start=STEPS) == cont
    # Optimizer alone: load the export + optimizer into a fresh model, continue identically.
    raw3 = _tiny(seed=8)
    b3 = Booster(plugin=_plugin("gemini", "fp8c"), device="cpu")
    m3, o3, *_ = b3.boost(raw3, torch.optim.AdamW(raw3.parameters(), lr=1e-3))
    b3.load_model(m3, os.path.join(tmp, "hf"))
    b3.load_optimizer(o3, os.path.join(tmp, "optim"))
    assert _train(b3, m3, o3, rank, world, start=STEPS) == cont

    # Meta-device init + sharded HF load: same parameters and rotary buffers as a full load.
    meta = _tiny(device="meta")
    b4 = Booster(plugin=_plugin("torchfsdp", "bf16"), device="cpu")
    m4, o4, *_ = b4.boost(meta, torch.optim.AdamW(meta.parameters(), lr=1e-3))
    b4.load_model(m4, os.path.join(tmp, "hf"))
    assert all(torch.equal(a, saved[n]) for n, a in _full(m4).items())
    normal = _tiny()
    rot, rot_ref = m4.unwrap().model.rotary_emb, normal.model.rotary_emb
    assert torch.equal(rot.inv_freq, rot_ref.inv_freq) and rot.attention_scaling == rot_ref.attention_scaling
    _train(b4, m4, o4, rank, world)
    return cont


def _reshard(rank, world, tmp, cont):
    """A 2-rank resumable checkpoint loads into 1 and 4 ranks bit-exactly; training goes on."""
    from fp8boost.booster import Booster

    raw = _tiny(seed=9)
    b = Booster(plugin=_plugin("gemini", "fp8c"), device="cpu")
    m, o, *_ = b.boost(raw, torch.optim.AdamW(raw.parameters(), lr=1e-3))
    b.load_checkpoint(os.path.join(tmp, "state"), m, o)
    from safetensors.torch import load_file
    from glob import glob
    saved = {}
    for f in glob(os.path.join(tmp, "hf", "*.safetensors")):
        saved.update(load_file(f))
    full = _full(m)
    assert all(torch.equal(full[n], saved[n]) for n in full)
    state = o.optim.state[m.unwrap().model.layers[1].self_attn.q_proj.weight]
    assert int(state["step"]) == STEPS
    losses = _train(b, m, o, rank, world, start=STEPS)
    # Other world sizes split the batch differently: same losses up to summation order.
    assert losses == pytest.approx(cont, rel=1e-2)
    return True


@pytest.mark.slow
def test_fsdp_plugins_two_ranks_parity_and_features(tmp_path):
    run_distributed(_parity, 2)
    a, b = run_distributed(_features, 2, str(tmp_path))
    assert a == b
    assert all(run_distributed(_reshard, 4, str(tmp_path), a))
    assert all(run_distributed(_reshard, 1, str(tmp_path), a))


def test_bad_arguments_raise_before_any_collective():
    from fp8boost.plugins import GeminiPlugin, TorchFSDPPlugin

    assert not dist.is_initialized()
    cases = [(dict(offload_param_frac=0.5), "partial offload is not supported"),
             (dict(offload_optim_frac=2), r"in \[0, 1\]"),
             (dict(precision="int8"), "precision='int8' is not supported"),
             (dict(max_norm=-1), "max_norm must be"),
             (dict(norm_type=0), "norm_type"),
             (dict(fp8_reduce_scatter=True), "needs fp8_communication=True")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            GeminiPlugin(**kwargs)
    with pytest.raises(TypeError, match="use_fp8 must be True or False"):
        TorchFSDPPlugin(use_fp8=1)
    with pytest.raises(TypeError, match="fp8_config must be"):
        GeminiPlugin(fp8_config={"recipe": "tensorwise"})
    assert not dist.is_initialized()
