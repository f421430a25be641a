"""``precision="bf16"``/``"fp16"`` casts buffers too, as Colossal-AI's module cast does (issue
37): a BatchNorm model trains under every plugin that casts (its running statistics must match
its input), while HF rotary tables and fp8boost's FP8 scaling state stay FP32. Two gloo ranks."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed

PLUGINS = ("booster", "zero1", "zero2", "gemini", "fsdp", "hybrid")


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64),
                               torch.nn.GELU(), torch.nn.Linear(64, 16))


def _booster(name: str, precision: str):
    from fp8boost.booster import Booster
    from fp8boost.plugins import (GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin,
                                  TorchFSDPPlugin)
    if name == "booster":
        return Booster(mixed_precision=precision, device="cpu")
    plugin = {"zero1": lambda: LowLevelZeroPlugin(stage=1, precision=precision),
              "zero2": lambda: LowLevelZeroPlugin(stage=2, precision=precision),
              "gemini": lambda: GeminiPlugin(precision=precision),
              "fsdp": lambda: TorchFSDPPlugin(precision=precision),
              "hybrid": lambda: HybridParallelPlugin(tp_size=1, pp_size=1,
                                                     precision=precision)}[name]()
    return Booster(plugin=plugin)


def _train_bn(name: str, precision: str, rank: int) -> dict:
    model = _bn_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = _booster(name, precision)
    model, opt, *_ = booster.boost(model, opt)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)
        loss = F.mse_loss(model(x).float(), y)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    out = model(torch.randn(4, 32, generator=g))  # eval: the running statistics are read
    bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d))
    return {"losses": losses, "eval_finite": bool(torch.isfinite(out).all()),
            "running_mean": bn.running_mean.dtype, "moved": bool(bn.running_var.ne(1).any()),
            "batches": bn.num_batches_tracked.dtype}


def _kept_fp32(precision: str) -> dict:
    """A tiny HF Llama converted to FP8 (delayed scaling: FP32 amax histories) before boost."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fp8boost.fp8 import Fp8Config, convert_to_fp8

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128))
    convert_to_fp8(model, Fp8Config(backend="emulated", recipe="delayed", min_numel=0))
    model, *_ = _booster("zero2", precision).boost(model, torch.optim.AdamW(model.parameters()))
    return {n: b.dtype for n, b in model.named_buffers()}


def _suite(rank: int, world: int) -> dict:
    out = {name: _train_bn(name, "bf16", rank) for name in PLUGINS}
    out["fp16 zero2"] = _train_bn("zero2", "fp16", rank)
    out["kept"] = _kept_fp32("bf16")
    return out


def test_bf16_and_fp16_cast_buffers_but_rotary_and_fp8_state_stay_fp32():
    results = run_distributed(_suite, 2)
    for rank, res in enumerate(results):
        for name in (*PLUGINS, "fp16 zero2"):
            r = res[name]
            want = torch.float16 if name.startswith("fp16") else torch.bfloat16
            assert r["running_mean"] == want, (rank, name, r)
            assert r["batches"] == torch.int64 and r["moved"] and r["eval_finite"], (rank, name)
            assert all(torch.isfinite(torch.tensor(r["losses"]))), (rank, name, r)
        kept = res["kept"]
        rotary = [n for n in kept if n.endswith("inv_freq")]
        fp8 = [n for n in kept if "fp8_" in n]
        assert rotary and fp8, sorted(kept)
        assert all(kept[n] == torch.float32 for n in rotary + fp8), kept
