"""GPU: the block FP8 export loads through transformers' own FP8 support (FP8Linear, Triton
block GEMMs) on CUDA, and its held-back loss is within 1% of the BF16 export's (issue 28).

Run on the device machine: ``python bench/suite.py hf-fp8-gpu`` (after ``bash
bench/hub_kernel_offline.sh`` here; carry=[".hubkernels"]), or all of them:
``pytest -q tests/export/test_export_gpu.py -s``.
"""
from __future__ import annotations

import copy
import json
from typing import Callable

import pytest
import torch

from tests.export import helpers as H

pytestmark = pytest.mark.gpu


@torch.no_grad()
def _loss_cuda(model) -> float:
    model.eval()
    losses = [model(input_ids=ids.cuda(), labels=ids.cuda()).loss.float()
              for ids in H.batches(H.split()[1], 6, seed=1)]
    return float(torch.stack(losses).mean())


def _exports(tmp_path, kind):
    from fp8boost.booster import Booster
    raw = H.make(kind, hidden=256, inter=512)  # every dim a multiple of 128 (block kernels)
    opt = torch.optim.AdamW(raw.parameters(), lr=3e-3)
    for ids in H.batches(H.split()[0], 30):
        raw(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    booster = Booster(mixed_precision="bf16", device="cpu")
    model, *_ = booster.boost(copy.deepcopy(raw))
    booster.save_model(model, str(tmp_path / "bf16"))
    booster.save_model(model, str(tmp_path / "fp8"), fp8_export="block")
    return str(tmp_path / "bf16"), str(tmp_path / "fp8")


def _fp8_linears(model) -> dict[str, torch.nn.Module]:
    """transformers' FP8Linear modules of ``model``, each checked to hold the export's FP8 bytes.

    Not dequantized: float8_e4m3fn weights with FP32 [128, 128]-block ``weight_scale_inv``
    (FP8Linear.forward falls back to F.linear only for weights wider than one byte).
    """
    from transformers.integrations.finegrained_fp8 import FP8Linear
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    for name, m in layers.items():
        assert m.weight.dtype == torch.float8_e4m3fn, (name, m.weight.dtype)
        assert m.weight_scale_inv.dtype == torch.float32, (name, m.weight_scale_inv.dtype)
        assert tuple(m.block_size) == (128, 128), (name, m.block_size)
        assert tuple(m.weight_scale_inv.shape) == (m.out_features // 128, m.in_features // 128)
    # Everything but the ignored lm_head is FP8: no Linear was left in (or cast back to) BF16.
    plain = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and n not in layers]
    assert plain == ["lm_head"], plain
    return layers


def _count_fp8_gemms(monkeypatch) -> dict[str, int]:
    """Count FP8Linear's calls into transformers' dispatcher and into its Triton hub kernel.

    Both are looked up as module globals of transformers.integrations.finegrained_fp8 at call
    time, so wrapping them there counts without changing what runs.
    """
    from transformers.integrations import finegrained_fp8 as fg
    counts = {"fp8_linear": 0, "triton": 0}

    def counting(key: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(fg, "fp8_linear", counting("fp8_linear", fg.fp8_linear))
    monkeypatch.setattr(fg, "finegrained_fp8_linear",
                        counting("triton", fg.finegrained_fp8_linear))
    return counts


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_block_export_loads_in_transformers_fp8(tmp_path, monkeypatch, kind):
    """transformers' own FP8 path runs the block export: FP8Linear layers with our FP8 weights
    on CUDA, their forward through the finegrained-fp8 GEMM kernel, loss within 1% of BF16's.

    transformers takes that kernel from the hub (`kernels` package); the GPU machine has no
    internet, so it is the copy bench/hub_kernel_offline.sh made of the kernels-community source
    (carried as .hubkernels/), registered where a hub download would be cached.
    """
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepgemm import is_deepgemm_loadable
    from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel
    kernel, where = H.transformers_fp8_kernel(monkeypatch)
    if kernel is None:
        pytest.skip(where)
    bf16, fp8_path = _exports(tmp_path, kind)
    ref = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16, device_map="cuda")
    fp8 = AutoModelForCausalLM.from_pretrained(fp8_path, dtype=torch.bfloat16, device_map="cuda")
    layers = _fp8_linears(fp8)
    assert len(layers) == 7 * fp8.config.num_hidden_layers  # q k v o gate up down per layer
    counts = _count_fp8_gemms(monkeypatch)
    a, b = _loss_cuda(ref), _loss_cuda(fp8)
    assert counts["fp8_linear"] > 0  # the forward went through FP8Linear's FP8 dispatcher
    if not is_deepgemm_loadable():  # no DeepGEMM: every FP8 GEMM ran the finegrained-fp8 kernel
        assert counts["triton"] == counts["fp8_linear"], counts
    source = H.offline_kernel_source()
    if source is not None:  # transformers resolved the registered copy, not some other module
        assert load_finegrained_fp8_kernel().matmul is H.import_offline_kernel().matmul_2d
    print("HF_FP8 " + json.dumps({
        "kind": kind, "transformers": transformers.__version__, "kernel": where,
        "kernel_commit": source and source["commit"],
        "fp8_linear_layers": len(layers), "fp8_gemm_calls": counts,
        "deepgemm": bool(is_deepgemm_loadable()), "bf16_export_loss": round(a, 5),
        "fp8_export_loss": round(b, 5), "rel_diff_pct": round(100 * (b / a - 1), 4)}))
    assert abs(b / a - 1) < 0.01


def test_block_export_dequantized_by_transformers_on_cuda(tmp_path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    bf16, fp8_path = _exports(tmp_path, "llama")
    ref = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16, device_map="cuda")
    deq = AutoModelForCausalLM.from_pretrained(
        fp8_path, dtype=torch.bfloat16, device_map="cuda",
        quantization_config=FineGrainedFP8Config(dequantize=True))
    a, b = _loss_cuda(ref), _loss_cuda(deq)
    print(f"llama: bf16 export {a:.4f}, fp8 block export dequantized by transformers {b:.4f}")
    assert abs(b / a - 1) < 0.01
