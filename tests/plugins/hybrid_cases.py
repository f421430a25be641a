"""Shared pieces of the HybridParallelPlugin tests: tiny HF models, data, the parity runner.

Module-level so spawned ranks can import it. The oracle is a single-process run of the same
model on the same global batches, computed inside rank 0's process (no collectives).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

VOCAB, SEQ, GLOBAL_BATCH = 256, 16, 4


def tiny_model(arch: str = "llama", seed: int = 0, tie: bool = False, layers: int = 2):
    """A GQA decoder (8 heads, 4 kv heads, FFN 128, vocab 256; 2 layers by default): tp 2 and 4
    divide it."""
    import transformers

    torch.manual_seed(seed)
    kw = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
              num_hidden_layers=layers, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
              tie_word_embeddings=tie)
    cfg = (transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig)(**kw)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def gathered_masters(plugin, opt, model=None) -> dict[str, torch.Tensor]:
    """Every parameter's full FP32 master (gathered over dp, then over tp), by name; with
    pipeline stages, those of ``model`` (this rank's stages)."""
    model = opt_model(plugin) if model is None else model
    full = opt.full_master_params()  # local tp shards, whole over dp
    by_id = {id(p): f for p, f in zip(opt.params, full)}
    out = {}
    for name, p in model.named_parameters():
        t = by_id[id(p)]
        dim = plugin.tp_state.shard_dims.get(name) if plugin.tp_state is not None else None
        if dim is not None:
            parts = [torch.empty_like(t) for _ in range(plugin.tp_state.size)]
            dist.all_gather(parts, t.contiguous(), group=plugin.tp_state.group)
            t = torch.cat(parts, dim=dim)
        out[name] = t
    return out


def opt_model(plugin):
    return plugin._test_model


def run_parity(arch: str, tp: int, zero: int, sp: bool, precision: str, fp8: bool, comm: bool,
               tie: bool = False, steps: int = 3, device: str = "cpu",
               backend: str = "emulated", fp8_config=None) -> dict:
    """Train the hybrid plugin and a single-process reference; return their differences."""
    from fp8boost.booster import Booster
    from fp8boost.fp8 import Fp8Config
    from fp8boost.parallel.zero import ZeroOptimizer
    from fp8boost.plugins import HybridParallelPlugin
    from fp8boost.plugins.precision import prepare_model

    cfg = fp8_config or Fp8Config(backend=backend, min_numel=0)
    dev = torch.device(device)
    model = tiny_model(arch, tie=tie)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    plugin = HybridParallelPlugin(tp_size=tp, zero_stage=zero, enable_sequence_parallelism=sp,
                                  precision=precision, use_fp8=fp8, fp8_communication=comm,
                                  fp8_config=cfg, max_norm=1.0)
    booster = Booster(plugin=plugin, device=dev)
    wrapped, opt, *_ = booster.boost(model, opt)
    plugin._test_model = model
    prepare_model(ref, precision, fp8, cfg, dev)
    ref_opt = ZeroOptimizer(torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9), max_norm=1.0)
    init = {n: p.detach().float().clone() for n, p in ref.named_parameters()}
    dp, dpr = plugin.dp_size, plugin.dp_rank
    losses, ref_losses = [], []
    for s in range(steps):
        ids = global_batch(s).to(dev)
        local = ids.chunk(dp)[dpr]
        loss = wrapped(input_ids=local, labels=local).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total, group=plugin.dp_group)
        losses.append(total.item() / dp)
        r = ref(input_ids=ids, labels=ids).loss
        ref_opt.backward(r)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(r.item())
    got = gathered_masters(plugin, opt)
    want = dict(zip([n for n, _ in ref.named_parameters()], ref_opt.full_master_params()))
    num = sum(((got[n] - want[n]) ** 2).sum() for n in want) ** 0.5
    den = sum(((want[n] - init[n]) ** 2).sum() for n in want) ** 0.5
    return {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param_rel": float(num / den), "losses": losses, "ref_losses": ref_losses,
            "fp8_layers": plugin.tp_state.fp8_layers if plugin.tp_state else 0,
            "partial": len(plugin.tp_state.partial_grads) if plugin.tp_state else 0,
            "fp8_gathers": plugin.tp_state.fp8_gathers if plugin.tp_state else 0}
