"""Resume is bit-exact: save, reload into a fresh run, and train beside the uninterrupted run.

A tiny HF Llama (every linear converts to FP8 with ``min_numel=0``) trains a few AdamW steps on
2 gloo ranks and is saved both ways (``save_model`` + ``save_optimizer``, and
``save_checkpoint``); two fresh models (initialised differently), optimizers and plugins load
one save each. The three runs then take the same steps on the same data in turn, in one
process, as a user comparing them side by side would: the losses and the final state (FP32
masters where the plugin keeps them, the working parameters, and delayed-scaling FP8 amax
histories and scales) must be bit-identical, and those buffers equal on every rank. Cases:
ZeRO-1/2 x ``use_fp8`` x ``fp8_communication``; Gemini, TorchFSDP, Hybrid (ZeRO-2, tp1) and
DDP with both flags; DDP with each flag alone; ``Fp8Config(recipe="delayed")`` with ZeRO-2,
ZeRO-1 + FP8 communication, Gemini + FP8 communication and TorchFSDP. One spawn runs them all
(~15 s on 2 cores).

Issue 23 item 6 (ZeRO + FP8 + FP8 communication drifted after a reload) is the first case;
DDP with ``fp8_communication`` (``DDP_COMM``) has its own test: its FP8 gradient hook's bits
follow DDP's buckets, which DDP rebuilds after a new model's first backward. The delayed
recipe under the FSDP2 plugins' load_model has its own test too (in-place sharded reads).
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

SAVE_AT = 2   # steps before the save
AFTER = 2     # steps after it, compared bit for bit
BATCH, SEQ, VOCAB = 4, 16, 128


def _llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      use_cache=False)
    return LlamaForCausalLM(cfg)


def _configs(recipe: str = "tensorwise"):
    from fp8boost.fp8 import Fp8Config
    from fp8boost.parallel.comm.config import Fp8CommConfig
    # min_numel=0: the tiny layers must still run (and travel) in FP8.
    return (Fp8Config(backend="emulated", min_numel=0, recipe=recipe),
            Fp8CommConfig(min_payload_numel=0))


def _zero(stage: int, use_fp8: bool, comm: bool, recipe: str = "tensorwise"):
    from fp8boost.plugins import LowLevelZeroPlugin
    fc, cc = _configs(recipe)
    # A small bucket (4k elements) gives several buckets per backward.
    return LowLevelZeroPlugin(stage=stage, use_fp8=use_fp8, fp8_communication=comm,
                              fp8_config=fc, comm_config=cc, reduce_bucket_size_in_m=0.004)


def _boost(plugin, seed: int):
    from fp8boost.booster import Booster
    booster = Booster(plugin=plugin)
    raw = _llama(seed)
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt, *_ = booster.boost(raw, opt)
    return booster, model, opt


def _train(booster, model, opt, rank: int, world: int, start: int, steps: int) -> list[float]:
    """``steps`` steps on the global batches ``start..``; each rank takes its part."""
    losses = []
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + s)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        part = ids.chunk(world)[rank]
        loss = model(input_ids=part, labels=part).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _state(model, opt) -> list[torch.Tensor]:
    """Everything training continues from: FP32 masters (if any), the working params and the
    delayed-scaling FP8 histories and scales (buffers)."""
    masters = opt.full_master_params() if hasattr(opt, "full_master_params") else []
    params = [p.detach().clone() for p in model.unwrap().parameters()]
    return masters + params + _fp8_buffers(model)


def _fp8_buffers(model) -> list[torch.Tensor]:
    return [b.detach().clone() for n, b in model.unwrap().named_buffers()
            if n.rsplit(".", 1)[-1] in ("fp8_amax_history", "fp8_scale")]


def _ranks_disagree(model) -> bool:
    """True when some rank's delayed-scaling buffers differ from rank 0's (a checkpoint keeps
    one copy, so every rank must hold the same)."""
    flat = [b.reshape(-1) for b in _fp8_buffers(model)]
    if not flat:
        return False
    mine = torch.cat(flat)
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return not torch.equal(lo, hi)


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    bad = [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
    if not bad:
        return ""
    i = bad[0]
    return (f"{len(bad)}/{len(a)} tensors differ, first #{i}: max |diff| "
            f"{(a[i].float() - b[i].float()).abs().max().item():.3e}")


def _resume_cases(rank: int, world: int, root: str, cases: list[tuple]) -> list[str]:
    """For each ``(name, make_plugin)``: train, save both ways, reload twice, train in lock step.

    The uninterrupted run and the two resumed ones (``save_model`` + ``save_optimizer``, and
    ``save_checkpoint``) live in this one process and take their steps in turn (reference,
    resumed, resumed, then the next step), as a user comparing them side by side would: one
    run's optimizer step must not change how another run computes. Returns one line per
    mismatch (empty when every resume was bit-exact).
    """
    failures = []
    for name, make in cases:
        booster, model, opt = _boost(make(), seed=0)
        _train(booster, model, opt, rank, world, 0, SAVE_AT)
        exp_dir, ckpt_dir = os.path.join(root, name, "export"), os.path.join(root, name, "ckpt")
        booster.save_model(model, os.path.join(exp_dir, "model"))
        booster.save_optimizer(opt, os.path.join(exp_dir, "optim"))
        booster.save_checkpoint(ckpt_dir, model, opt)
        runs = {"uninterrupted": (booster, model, opt)}
        for how in ("save_model+save_optimizer", "save_checkpoint"):
            b2, m2, o2 = _boost(make(), seed=1)  # initialised differently: all must be loaded
            if how == "save_checkpoint":
                b2.load_checkpoint(ckpt_dir, m2, o2)
            else:
                b2.load_model(m2, os.path.join(exp_dir, "model"))
                b2.load_optimizer(o2, os.path.join(exp_dir, "optim"))
            runs[how] = (b2, m2, o2)
        losses: dict[str, list[float]] = {k: [] for k in runs}
        for step in range(SAVE_AT, SAVE_AT + AFTER):
            for how, (b, m, o) in runs.items():
                losses[how] += _train(b, m, o, rank, world, step, 1)
        want_losses, want_state = losses.pop("uninterrupted"), _state(model, opt)
        if _ranks_disagree(model):
            failures.append(f"{name} via uninterrupted: delayed-scaling buffers differ by rank")
        for how, got_losses in losses.items():
            if got_losses != want_losses:
                failures.append(f"{name} via {how}: losses {got_losses} != {want_losses}")
            why = _diff(_state(runs[how][1], runs[how][2]), want_state)
            if why:
                failures.append(f"{name} via {how}: final state: {why}")
    return failures


def _other(kind: str, use_fp8: bool = True, comm: bool = True, recipe: str = "tensorwise"):
    """Another plugin (tp1 for the hybrid one: every weight whole on the 2 dp ranks)."""
    from fp8boost.plugins import GeminiPlugin, HybridParallelPlugin, TorchDDPPlugin, \
        TorchFSDPPlugin
    fc, cc = _configs(recipe)
    kw = dict(use_fp8=use_fp8, fp8_communication=comm, fp8_config=fc)
    if kind == "hybrid_zero2":  # the ZeRO optimizer under the hybrid plugin (FP8 all-gather)
        return HybridParallelPlugin(tp_size=1, zero_stage=2, precision="bf16", **kw)
    cls = {"ddp": TorchDDPPlugin, "gemini": GeminiPlugin, "torchfsdp": TorchFSDPPlugin}[kind]
    return cls(comm_config=cc, **kw)


# DDP's FP8 gradient hook casts each bucket with per-chunk scales, and DDP re-orders its buckets
# after the first backward of every new DDP model: before the fix, the resumed run's first step
# reduced in DDP's initial bucket, the uninterrupted run in the rebuilt ones.
DDP_COMM = ("ddp_fp8_comm", "ddp_comm")


def _cases() -> list[tuple]:
    cases = [(f"zero{stage}_fp8{int(fp8)}_comm{int(comm)}",
              functools.partial(_zero, stage, fp8, comm))
             for stage in (2, 1) for fp8 in (True, False) for comm in (True, False)]
    cases += [(f"{kind}_fp8_comm", functools.partial(_other, kind))
              for kind in ("gemini", "torchfsdp", "hybrid_zero2", "ddp")]
    cases += [("ddp_fp8", functools.partial(_other, "ddp", True, False)),
              ("ddp_comm", functools.partial(_other, "ddp", False, True))]
    # Delayed scaling: each rank's amax history follows its own data unless the plugin reduces
    # the amaxes over the data-parallel group, and a checkpoint holds one rank's history.
    cases += [("zero2_delayed", functools.partial(_zero, 2, True, False, "delayed")),
              ("zero1_delayed_comm", functools.partial(_zero, 1, True, True, "delayed")),
              ("gemini_delayed", functools.partial(_other, "gemini", True, True, "delayed")),
              ("torchfsdp_delayed", functools.partial(_other, "torchfsdp", True, False,
                                                      "delayed"))]
    return cases


def _all_cases(rank: int, world: int, root: str) -> list[str]:
    return _resume_cases(rank, world, root, _cases())


@pytest.fixture(scope="module")
def resume_failures(tmp_path_factory) -> dict[str, list[str]]:
    """One 2-rank spawn runs every case; ``{case: [mismatch lines]}`` (empty: bit-exact)."""
    root = str(tmp_path_factory.mktemp("resume"))
    results = run_distributed(_all_cases, 2, root, timeout=600)
    out: dict[str, list[str]] = {name: [] for name, _ in _cases()}
    for line in sorted(set(results[0]) | set(results[1])):
        out[line.split(" via ")[0]].append(line)
    return out


def test_resume_bit_exact_every_plugin_and_flag(resume_failures):
    """ZeRO-1/2 x use_fp8 x fp8_communication, and Gemini, TorchFSDP, Hybrid (ZeRO-2, tp1) and
    DDP (use_fp8) with FP8 GEMMs + FP8 communication, and the delayed recipe: the resumed runs
    equal the uninterrupted one bit for bit (losses and final state), with the three stepping
    in turn in one process.

    Issue 23 item 6: before the fix, ZeRO with use_fp8 and fp8_communication drifted: the other
    run's optimizer step dropped the layer's prequantized FP8 weight (keyed on the process-wide
    step count) and it re-cast its FP8-decoded working weight instead. Delayed recipe: before
    the fix, ZeRO and FSDP2 ranks kept amax histories of their own data, the checkpoint kept
    rank 0's, so rank 1 resumed with another history (now reduced with MAX over dp ranks).
    """
    bad = [line for case, lines in resume_failures.items() if case not in DDP_COMM
           for line in lines]
    assert not bad, "resume is not bit-exact:\n" + "\n".join(bad)


def test_resume_bit_exact_ddp_fp8_communication(resume_failures):
    """TorchDDPPlugin with fp8_communication (with and without use_fp8). Before the fix the
    resumed model's first step reduced its gradients in DDP's initial single bucket while the
    uninterrupted run used the buckets DDP rebuilds after a first backward (other FP8 chunks
    and scales); the FP8 hook now reduces a new model's first step in the rebuilt buckets."""
    bad = [line for case in DDP_COMM for line in resume_failures[case]]
    assert not bad, "resume is not bit-exact:\n" + "\n".join(bad)


def test_resume_bit_exact_fsdp_delayed_load_model(resume_failures):
    """Gemini and TorchFSDP with the delayed recipe through save_model + load_model: the sharded
    reader writes in place past Fp8Linear._load_from_state_dict; before the fix the loaded amax
    history was then re-seeded from the first batch (dcp now calls fp8.linear.weights_loaded)."""
    bad = [line for case in ("gemini_delayed", "torchfsdp_delayed")
           for line in resume_failures[case] if "save_model" in line]
    assert not bad, "resume is not bit-exact:\n" + "\n".join(bad)
