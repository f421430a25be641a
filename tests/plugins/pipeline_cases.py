"""Shared pieces of the pipeline-parallel tests: tiny HF models, the parity runner, P2P capture.

Module-level so spawned ranks can import it. The oracle is a single-process run of the same
model on the same global batches inside every rank (no collectives), with the same precision,
FP8 recipe, optimizer (SGD + momentum) and clipping.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist

from tests.plugins import hybrid_cases

VOCAB, SEQ, GLOBAL_BATCH = 256, 16, 8


def tiny_model(layers: int, arch: str = "llama", tie: bool = False, seed: int = 0):
    """The hybrid tests' GQA decoder (hidden 64, 8 heads, 4 kv heads, FFN 128, vocab 256) with
    ``layers`` layers."""
    return hybrid_cases.tiny_model(arch, seed=seed, tie=tie, layers=layers)


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def _full_masters(plugin, model, opt) -> dict[str, torch.Tensor]:
    """This rank's parameters (its stages), FP32 masters gathered over dp and tp, by name."""
    return hybrid_cases.gathered_masters(plugin, opt, model)


def run_pp_parity(*, pp: int, tp: int = 1, zero: int = 0, precision: str = "fp32",
                  fp8: bool = False, comm: bool = False, style: str = "1f1b", chunks: int = 1,
                  layers: int = 4, sp: bool = False, tie: bool = False, arch: str = "llama",
                  steps: int = 3, microbatches: Optional[int] = 2,
                  microbatch_size: Optional[int] = None, hooks=None, fp8_config=None) -> dict:
    """Train with ``execute_pipeline`` and a one-process reference; return their differences."""
    from fp8boost.booster import Booster
    from fp8boost.fp8 import Fp8Config
    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.parallel.zero import ZeroOptimizer
    from fp8boost.plugins import HybridParallelPlugin
    from fp8boost.plugins.precision import prepare_model

    cfg = fp8_config or Fp8Config(backend="emulated", min_numel=0)
    model = tiny_model(layers, arch, tie)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    plugin = HybridParallelPlugin(
        tp_size=tp, pp_size=pp, zero_stage=zero, precision=precision, use_fp8=fp8,
        fp8_communication=comm, fp8_config=cfg, max_norm=1.0, pp_style=style,
        num_model_chunks=chunks, num_microbatches=microbatches, microbatch_size=microbatch_size,
        enable_sequence_parallelism=sp, comm_config=Fp8CommConfig(min_payload_numel=0))
    booster = Booster(plugin=plugin, device="cpu")
    wrapped, opt, *_ = booster.boost(model, opt)
    if hooks is not None:
        hooks.install(plugin)
    dev = torch.device("cpu")
    prepare_model(ref, precision, fp8, cfg, dev)
    ref_opt = ZeroOptimizer(torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9), max_norm=1.0)
    init = {n: p.detach().float().clone() for n, p in ref.named_parameters(remove_duplicate=False)}
    dp, dpr = plugin.dp_size, plugin.dp_rank
    losses, ref_losses = [], []
    for s in range(steps):
        ids = global_batch(s)
        local = ids.chunk(dp)[dpr]
        out = booster.execute_pipeline(iter([{"input_ids": local, "labels": local}]), wrapped,
                                       optimizer=opt, return_outputs=s == 0)
        if s == 0:
            train_logits = None if out["outputs"] is None else tuple(out["outputs"].shape)
        opt.step()
        opt.zero_grad()
        total = out["loss"].clone()
        dist.all_reduce(total, group=plugin.dp_group)
        losses.append(total.item() / dp)
        r = ref(input_ids=ids, labels=ids).loss
        ref_opt.backward(r)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(r.item())
    with torch.no_grad():  # evaluation: forward only, same loss as a reference forward
        ev = booster.execute_pipeline(iter([{"input_ids": ids, "labels": ids}]), wrapped,
                                      return_outputs=True)
        ref_ev = ref(input_ids=ids, labels=ids).loss.item()
    logits = ev["outputs"]
    ev = ev["loss"]
    got = _full_masters(plugin, model, opt)
    names = [n for n, _ in ref.named_parameters()]
    want = dict(zip(names, ref_opt.full_master_params()))
    for n, p in ref.named_parameters(remove_duplicate=False):  # tied lm_head.weight
        want.setdefault(n, want[[k for k, q in ref.named_parameters() if q is p][0]])
    num = torch.zeros(2)
    for n, t in got.items():
        num[0] += ((t - want[n]) ** 2).sum()
        num[1] += ((want[n] - init[n]) ** 2).sum()
    dist.all_reduce(num)  # every rank's own parameters (replicas count alike)
    return {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "eval_rel": abs(ev.item() - ref_ev) / ref_ev,
            "param_rel": float((num[0] / num[1]) ** 0.5), "losses": losses,
            "ref_losses": ref_losses, "owned": sorted(got),
            "logits": None if logits is None else tuple(logits.shape),
            "train_logits": train_logits,
            "report": dict(plugin.pp_state.boundaries.report)}


class BoundaryCapture:
    """Records, on a pp2 1F1B pipeline, the tensors on both sides of the stage boundary.

    Stage 0 records the hidden states it encodes and the gradient it decodes; stage 1 the
    hidden states it decoded and the gradient it encodes. ``check()`` exchanges them (plain
    send/recv) and asserts that each side saw exactly "quantize, then dequantize" of what the
    other side had: e4m3 forward, e5m2 backward.
    """

    def __init__(self) -> None:
        self.sent, self.grads = [], []

    def install(self, plugin) -> None:
        stage = plugin.pp_state.runner.modules[0]
        self.stage, self.group = stage.index, plugin.pp_state.group

        def record(h):
            if h.requires_grad:  # training steps only (evaluation sends no gradients)
                self.sent.append(h.detach().clone())
                h.register_hook(lambda g: self.grads.append(g.detach().clone()))

        if stage.index == 0:
            stage.layers[-1].register_forward_hook(
                lambda m, args, out: record(out[0] if isinstance(out, tuple) else out))
        else:
            stage.layers[0].register_forward_pre_hook(
                lambda m, args, kwargs: record(args[0] if args else kwargs["hidden_states"]),
                with_kwargs=True)

    def check(self, cfg) -> int:
        """Asserts bit-identity; returns the number of tensors compared on this rank."""
        from fp8boost.parallel.pipeline import decode_fp8, encode_fp8

        peer = dist.get_global_rank(self.group, 1 - self.stage)
        if self.stage == 0:  # send what we encoded, receive what the other side encoded
            for t in self.sent:
                dist.send(t.contiguous(), peer)
            src = [torch.empty_like(t) for t in self.grads]
            for t in src:
                dist.recv(t, peer)
            seen, dt = self.grads, cfg.grad_dtype
        else:
            src = [torch.empty_like(t) for t in self.sent]
            for t in src:
                dist.recv(t, peer)
            for t in self.grads:
                dist.send(t.contiguous(), peer)
            seen, dt = self.sent, cfg.param_dtype
        for x, got in zip(src, seen):
            qdq = decode_fp8(encode_fp8(x, dt, cfg), tuple(x.shape), x.dtype, dt, cfg)
            assert torch.equal(qdq, got), "boundary tensor != quantize-dequantize of the source"
        return len(seen)


# --------------------------------------------------------------------------- checkpoints
def _boost(pp: int, tp: int = 1, zero: int = 0, layers: int = 4):
    from fp8boost.booster import Booster
    from fp8boost.plugins import HybridParallelPlugin

    model = tiny_model(layers, tie=True, seed=1)  # different init than the saved run
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    kw = dict(pp_size=pp, num_microbatches=max(2, pp)) if pp > 1 else {}
    plugin = HybridParallelPlugin(tp_size=tp, zero_stage=zero, max_norm=1.0, precision="fp32",
                                  **kw)
    booster = Booster(plugin=plugin, device="cpu")
    wrapped, opt, *_ = booster.boost(model, opt)
    return booster, plugin, model, wrapped, opt


def _train_step(booster, plugin, wrapped, opt, ids) -> float:
    local = ids.chunk(plugin.dp_size)[plugin.dp_rank]
    if plugin.pp_size > 1:
        loss = booster.execute_pipeline(iter([{"input_ids": local, "labels": local}]), wrapped,
                                        optimizer=opt)["loss"]
    else:
        loss = wrapped(input_ids=local, labels=local).loss
        booster.backward(loss, opt)
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total, group=plugin.dp_group)
    return total.item() / plugin.dp_size


def _everything(plugin, model, opt) -> dict:
    """Every parameter of the whole model (FP32 masters), by name, on every rank."""
    mine = _full_masters(plugin, model, opt)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out = {}
    for p in parts:
        out.update(p)
    return out


def checkpoint_round_trip(tmp: str) -> dict:
    """Save at pp2 x tp2 (tied embeddings), load at pp4 and at pp1 x tp2 x dp2 (ZeRO-1).

    Returns the largest differences: weights after loading (exact), the next step's loss and
    weights (resharded sums: fp32 rounding only), and the HF export against the saved run.
    """
    import transformers

    booster, plugin, model, wrapped, opt = _boost(pp=2, tp=2)
    _train_step(booster, plugin, wrapped, opt, global_batch(0))
    booster.save_checkpoint(f"{tmp}/ckpt", wrapped, opt, extra={"step": 1})
    booster.save_model(wrapped, f"{tmp}/hf")
    saved = _everything(plugin, model, opt)
    loss_a = _train_step(booster, plugin, wrapped, opt, global_batch(1))
    after_a = _everything(plugin, model, opt)
    out = {"load_exact": True, "step_loss_rel": 0.0, "step_param_rel": 0.0}
    for pp, tp, zero in ((4, 1, 0), (1, 2, 1)):
        booster, plugin, model, wrapped, opt = _boost(pp=pp, tp=tp, zero=zero)
        extra = booster.load_checkpoint(f"{tmp}/ckpt", wrapped, opt)
        assert extra == {"step": 1}, extra
        got = _everything(plugin, model, opt)
        out["load_exact"] &= all(torch.equal(got[n], saved[n]) for n in saved) and \
            set(got) == set(saved)
        loss_b = _train_step(booster, plugin, wrapped, opt, global_batch(1))
        got = _everything(plugin, model, opt)
        num = sum(((got[n] - after_a[n]) ** 2).sum() for n in saved)
        den = sum(((after_a[n] - saved[n]) ** 2).sum() for n in saved)
        out["step_loss_rel"] = max(out["step_loss_rel"], abs(loss_b - loss_a) / loss_a)
        out["step_param_rel"] = max(out["step_param_rel"], float((num / den) ** 0.5))
    hf = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/hf")
    ref = dict(hf.named_parameters())
    out["hf_exact"] = all(torch.equal(ref[n].float(), saved[n]) for n in saved) and \
        set(ref) == set(saved)
    booster, plugin, model, wrapped, opt = _boost(pp=4)  # the HF export into another split
    booster.load_model(wrapped, f"{tmp}/hf")
    got = _everything(plugin, model, opt)
    out["hf_load_exact"] = all(torch.equal(got[n], saved[n]) for n in saved)
    return out
