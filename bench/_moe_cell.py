"""One cell of bench/moe_step.py: build an MoE model, train it a few steps, time and profile.

Run by bench/moe_step.py as ``python bench/_moe_cell.py SHAPE MODE JSON [options]`` (one
process per cell); prints and writes one JSON object. Every cell: BF16 parameters, fused AdamW
(CUDA), ``use_cache=False``, the same deterministic token stream (a fixed random successor
table: each token is followed by its successor with probability 3/4, so the loss has something
to learn and falls over the steps), the same seed and initial weights.

Modes: ``bf16_*`` run transformers' own experts (``experts_implementation="grouped_mm"``,
what its users get); ``fp8_*`` convert every linear and expert module
(``convert_to_fp8(model, Fp8Config(min_numel=0))``); ``fp8default_*`` convert with the library
defaults (whatever ``convert_to_fp8`` keeps in BF16 is reported); ``fp8fast_*`` as ``fp8_*``
with fast accumulation in the gradient GEMMs too (an ablation); ``fp8hpw_*`` with the experts'
weight gradient in BF16 (``Fp8Config(expert_wgrad="high_precision")``). ``*_compiled``: each decoder
block compiled in place (``fp8boost.compile.compile_blocks``), with dynamo's counters as proof.
A ``_fusedloss`` / ``_fp8head`` suffix trains with fp8boost's fused lm_head + loss, with a BF16 /
rowwise FP8 head (:data:`HEADS`); without one, HF's own lm_head + loss.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES: dict[str, dict[str, Any]] = {
    # Mixtral-8x7B's block: h4096, 8 experts x 14336, top-2, GQA 32/8.
    "mixtral": dict(arch="mixtral", hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                    num_local_experts=8, num_experts_per_tok=2, batch=2, seq=4096),
    # Qwen3-30B-A3B's block: h2048, 128 experts x 768, top-8, GQA 32/4, head_dim 128.
    "qwen3": dict(arch="qwen3_moe", hidden_size=2048, moe_intermediate_size=768,
                  num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                  head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                  batch=4, seq=4096),
    # CPU smoke shape (tests/bench/test_moe_step.py).
    "tiny": dict(arch="mixtral", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                 num_experts_per_tok=2, batch=2, seq=32, vocab_size=256),
}
VOCAB = 32000  # both: the expert blocks are measured, not a 152k-word lm_head
BASE_MODES = ("bf16_eager", "bf16_compiled", "fp8_eager", "fp8_compiled", "fp8default_eager",
              "fp8default_compiled", "fp8fast_eager", "fp8fast_compiled", "fp8hpw_eager",
              "fp8hpw_compiled")
# The lm_head + loss: HF's (no suffix: full FP32 logits), or fp8boost's fused lm_head + loss
# (what ``booster.boost`` installs for HF causal LMs), with a BF16 (``_fusedloss``) or a rowwise
# FP8 head (``_fp8head``). A BF16 row with ``_fusedloss`` says what the fused loss gives alone.
HEADS = ("fusedloss", "fp8head")
MODES = BASE_MODES + tuple(f"{m}_{h}" for m in BASE_MODES for h in HEADS)


def split_mode(mode: str) -> tuple[str, str]:
    """``(base mode, head)``: head is ``""`` (HF's loss), ``"fusedloss"`` or ``"fp8head"``.

    Example:
        >>> split_mode("fp8hpw_compiled_fp8head"), split_mode("bf16_eager")
        (('fp8hpw_compiled', 'fp8head'), ('bf16_eager', ''))
    """
    for head in HEADS:
        if mode.endswith("_" + head):
            return mode[:-len(head) - 1], head
    return mode, ""


def is_compiled(mode: str) -> bool:
    """Whether ``mode`` compiles each decoder block."""
    return split_mode(mode)[0].endswith("_compiled")


def build_model(shape: str, device: torch.device) -> torch.nn.Module:
    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    spec.pop("batch"), spec.pop("seq")
    spec.setdefault("vocab_size", VOCAB)
    if arch == "mixtral":
        from transformers import MixtralConfig as Config
    else:
        from transformers import Qwen3MoeConfig as Config
    cfg = Config(max_position_embeddings=8192, attention_dropout=0.0, use_cache=False, **spec)
    cfg._experts_implementation = "grouped_mm"
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.train()


def token_stream(shape: str, steps: int, device: torch.device) -> list[torch.Tensor]:
    """``steps`` batches of the learnable stream (the same in every cell)."""
    s = SHAPES[shape]
    vocab = s.get("vocab_size", VOCAB)
    g = torch.Generator().manual_seed(1234)
    successor = torch.randperm(vocab, generator=g)
    out = []
    for _ in range(steps):
        ids = torch.empty(s["batch"], s["seq"], dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (s["batch"],), generator=g)
        noise = torch.randint(0, vocab, (s["batch"], s["seq"]), generator=g)
        keep = torch.rand(s["batch"], s["seq"], generator=g) < 0.75
        for t in range(1, s["seq"]):
            ids[:, t] = torch.where(keep[:, t], successor[ids[:, t - 1]], noise[:, t])
        out.append(ids.to(device))
    return out


def prepare(model: torch.nn.Module, mode: str) -> dict[str, Any]:
    """Convert (fp8 modes) and compile (compiled modes); returns what was done."""
    info: dict[str, Any] = {}
    if mode.startswith("fp8"):
        from fp8boost.fp8 import Fp8Config, convert_to_fp8
        from fp8boost.fp8.moe import fp8_experts

        # fp8_*: every GEMM in FP8 (no per-shape choice); fp8default_*: the library's choice
        cfg = (Fp8Config() if mode.startswith("fp8default")
               else Fp8Config(min_numel=0, expert_wgrad="fp8"))
        if mode.startswith("fp8fast"):  # ablation: fast accumulation in every GEMM
            cfg = cfg.replace(fast_accum_dgrad=True, fast_accum_wgrad=True)
        if mode.startswith("fp8hpw"):  # the experts' weight gradient in BF16
            cfg = cfg.replace(expert_wgrad="high_precision")
        convert_to_fp8(model, cfg)
        experts = fp8_experts(model)
        linears = [n for n, m in model.named_modules() if type(m).__name__.startswith("Fp8")
                   and m not in experts]
        kept = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                and type(m) is torch.nn.Linear]
        info["fp8_coverage"] = dict(experts=len(experts), linears=len(linears),
                                    bf16_linears=kept, backend=[e.options(
                                        e.gate_up_proj.device).backend for e in experts][:1],
                                    precision=[e.precision for e in experts])
    head = split_mode(mode)[1]
    if head:
        from fp8boost.loss import FusedLmLossConfig, install_fused_lm_loss

        config = FusedLmLossConfig(fp8_recipe="rowwise" if head == "fp8head" else None)
        why = install_fused_lm_loss(model, config)
        if why is not None:  # a row that claims the fused loss must have it
            raise RuntimeError(f"{mode}: the fused lm_head + loss was not installed: {why}")
        info["lm_head"] = dict(loss="fused", fp8_recipe=config.fp8_recipe)
    if is_compiled(mode):
        from fp8boost.compile import compile_blocks

        info["compiled_blocks"] = compile_blocks(model, backend="inductor")
    return info


def run(shape: str, mode: str, warmup: int, steps: int, profile_steps: int,
        lr: float) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(shape, device)
    result: dict[str, Any] = dict(shape=shape, mode=mode, **{k: v for k, v in SHAPES[shape].items()
                                                             if k != "arch"})
    result["params"] = sum(p.numel() for p in model.parameters())
    result["experts_implementation"] = model.config._experts_implementation
    result.update(prepare(model, mode))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    data = token_stream(shape, warmup + steps + profile_steps, device)
    losses, times = [], []

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i, ids in enumerate(data[:warmup + steps]):
        sync()
        t0 = time.perf_counter()
        loss = step(ids)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    timed = times[warmup:]
    tokens = SHAPES[shape]["batch"] * SHAPES[shape]["seq"]
    result.update(step_ms_median=1e3 * statistics.median(timed), step_ms=[1e3 * t for t in timed],
                  tokens_per_s=tokens / statistics.median(timed), losses=losses,
                  final_loss=losses[-1], warmup_s=sum(times[:warmup]))
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if is_compiled(mode):
        from _setup import compile_evidence

        result["compile"] = compile_evidence()
    if profile_steps and device.type == "cuda":
        from _moe_profile import step_breakdown

        rest = iter(data[warmup + steps:])
        result["profile"] = step_breakdown(lambda: step(next(rest)), profile_steps)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shape", choices=list(SHAPES))
    p.add_argument("mode", choices=MODES)
    p.add_argument("json")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--profile-steps", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    a = p.parse_args(argv)
    result = run(a.shape, a.mode, a.warmup, a.steps, a.profile_steps, a.lr)
    Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k not in ("profile", "step_ms")},
                     default=str))


if __name__ == "__main__":
    main()
