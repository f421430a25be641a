"""HybridParallelPlugin with pipeline parallelism on 4 gloo ranks: parity with one process.

Each case trains a tiny HF decoder for 3 steps with ``booster.execute_pipeline`` (SGD with
momentum, clipping at 1.0 -- active: the initial gradient norm is ~1.7, so the norm must span
every stage, tp shard and dp replica) and compares with the same model trained in one process
on the same global batches; then one ``torch.no_grad()`` evaluation step. Loss: the schedules
sum micro-batch gradients and the plugin divides by their count, so the gradient is that of
the batch mean, as in the reference. Tolerances, measured on torch 2.13 CPU:

* fp32: losses and masters within 1e-5 relative (measured <= 9e-8 / 5e-7): only summation
  order differs.
* bf16 (with or without FP8 P2P): losses within 5e-3, masters within 0.08 of the distance
  they travelled (measured bf16 6e-3; with e4m3/e5m2 boundaries 3.9e-2).
* FP8 GEMMs (emulated, tensorwise), with or without FP8 P2P: losses within 1e-2, masters
  within 0.35 (measured <= 1.3e-3 / 0.22 on 8 layers): each FP8 rounding that bf16-level
  differences flip is worth 2**-3 relative, and they add up with depth.

Checkpoints with pp (see the last block of the parity test) are exact too.

The FP8 point-to-point check is exact: on a pp2 run every activation stage 1 computes on and
every gradient stage 0 receives equal "quantize, then dequantize" of what the other stage
sent, bit for bit.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.plugins.pipeline_cases import BoundaryCapture, run_pp_parity, tiny_model

LOSS_TOL = {"fp32": 1e-5, "bf16": 5e-3, "fp8": 1e-2}
PARAM_TOL = {"fp32": 1e-5, "bf16": 0.08, "fp8": 0.35}

PP2_CASES = [
    dict(pp=2, tp=2),
    dict(pp=2, tp=2, arch="qwen2", precision="bf16", fp8=True, comm=True, sp=True, tie=True),
    dict(pp=2, zero=1, precision="bf16", microbatches=None, microbatch_size=2),
    dict(pp=2, zero=1, precision="bf16", fp8=True, comm=True, tie=True),
]
PP4_CASES = [
    dict(pp=4, style="interleaved", chunks=2, layers=8, microbatches=4),
    dict(pp=4, style="interleaved", chunks=2, layers=8, microbatches=4, precision="bf16",
         fp8=True, comm=True),
    dict(pp=4, style="zbv", chunks=2, layers=8, microbatches=4, tie=True),
    dict(pp=4, style="zbv", chunks=2, layers=8, microbatches=4, tie=True, precision="bf16",
         fp8=True, comm=True),
]


def _kind(case: dict) -> str:
    return "fp8" if case.get("fp8") else case.get("precision", "fp32")


def _all_cases(rank: int, world: int, tmp: str) -> dict:
    """Every case in ONE 4-rank spawn (each spawn costs ~11 s of imports)."""
    from fp8boost.parallel.comm.config import Fp8CommConfig
    from tests.plugins.pipeline_cases import checkpoint_round_trip

    out = {"pp2": [run_pp_parity(**case) for case in PP2_CASES],
           "pp4": [run_pp_parity(**case) for case in PP4_CASES]}
    cap = BoundaryCapture()  # FP8 P2P only (bf16 compute), pp2 x dp2, 1F1B
    out["comm"] = run_pp_parity(pp=2, zero=1, precision="bf16", comm=True, hooks=cap)
    out["compared"] = cap.check(Fp8CommConfig(min_payload_numel=0))
    out["ckpt"] = checkpoint_round_trip(tmp)
    return out


def _check(cases: list, results: list) -> None:
    for case, res in zip(cases, results[0]):
        kind = _kind(case)
        assert res["loss_rel"] <= LOSS_TOL[kind], (case, res)
        assert res["eval_rel"] <= LOSS_TOL[kind], (case, res)
        assert res["param_rel"] <= PARAM_TOL[kind], (case, res)
        if case.get("comm"):  # every cross-rank boundary went FP8
            assert res["report"] and all(v.startswith("FP8") or "one rank" in v
                                         for v in res["report"].values()), (case, res["report"])
    for r in results[1:]:  # the loss is broadcast over pp and averaged over dp: same everywhere
        for (case, res), res0 in zip(zip(cases, r), results[0]):
            assert res["losses"] == pytest.approx(res0["losses"], rel=1e-6), case


def test_pipeline_parity_fp8_p2p_and_checkpoints_4_ranks(tmp_path) -> None:
    results = run_distributed(_all_cases, 4, str(tmp_path))
    _check(PP2_CASES, [r["pp2"] for r in results])
    _check(PP4_CASES, [r["pp4"] for r in results])
    comm = results[0]["comm"]
    assert comm["loss_rel"] <= LOSS_TOL["bf16"] and comm["param_rel"] <= PARAM_TOL["bf16"], comm
    assert list(comm["report"]) == ["stage 0->1"], comm["report"]
    assert comm["report"]["stage 0->1"].startswith("FP8"), comm["report"]
    # 3 steps x 2 micro-batches, activations on stage 1 and gradients on stage 0, bit-exact
    assert [r["compared"] for r in results] == [6, 6, 6, 6]
    # pp2 x tp2: stage 0 holds layers 0-1 and the embeddings, stage 1 layers 2-3, norm, head
    owned0, owned1 = results[0]["pp2"][0]["owned"], results[2]["pp2"][0]["owned"]
    assert "model.embed_tokens.weight" in owned0 and "lm_head.weight" not in owned0
    assert "lm_head.weight" in owned1 and "model.norm.weight" in owned1
    assert all(".layers.2." not in n for n in owned0) and all(".layers.0." not in n for n in owned1)
    # evaluation outputs: the whole batch's logits (vocabulary slice under tp) on the last stage
    assert [r["pp2"][0]["logits"] for r in results] == [None, None, (8, 16, 128), (8, 16, 128)]
    # training with return_outputs: this dp replica's batch (pp2 x dp2: 4 rows of the 8)
    assert [r["pp2"][2]["train_logits"] for r in results] == [None, (4, 16, 256)] * 2
    assert [r["pp4"][2]["logits"] for r in results] == [(8, 16, 256), None, None, None]  # zbv
    # zbv: rank 0 holds the first and the last stage (tied embedding local, no sync needed)
    zbv0 = results[0]["pp4"][2]["owned"]
    assert "model.embed_tokens.weight" in zbv0 and "model.norm.weight" in zbv0
    assert any(".layers.7." in n for n in zbv0) and any(".layers.0." in n for n in zbv0)
    # interleaved: rank 1 holds stages 1 and 5 (layers 1 and 5 of 8)
    inter1 = results[1]["pp4"][0]["owned"]
    assert {n.split(".")[2] for n in inter1 if ".layers." in n} == {"1", "5"}
    # Checkpoints (fp32, tied embeddings): DCP saved at pp2 x tp2 loads bit-exactly at pp4 and
    # at pp1 x tp2 x dp2 (ZeRO-1), and the next step matches the saving run (measured 9e-8 /
    # 4e-7: resharded sums); save_model's HF folder equals the FP32 masters exactly, loads
    # with from_pretrained and into pp4.
    ck = results[0]["ckpt"]
    assert ck["load_exact"] and ck["hf_exact"] and ck["hf_load_exact"], ck
    assert ck["step_loss_rel"] <= 1e-5 and ck["step_param_rel"] <= 1e-5, ck


def test_bad_pipeline_arguments_raise_before_any_collective() -> None:
    from fp8boost.booster import Booster
    from fp8boost.plugins import HybridParallelPlugin, TorchDDPPlugin

    assert not dist.is_initialized()
    hp = HybridParallelPlugin
    with pytest.raises(ValueError, match="zero_stage <= 1"):
        hp(pp_size=2, zero_stage=2, num_microbatches=2)
    with pytest.raises(ValueError, match="num_microbatches"):
        hp(pp_size=2)
    with pytest.raises(ValueError, match="exactly one"):
        hp(pp_size=2, num_microbatches=2, microbatch_size=1)
    with pytest.raises(ValueError, match="num_model_chunks=2"):
        hp(pp_size=2, num_microbatches=2, pp_style="zbv")
    with pytest.raises(ValueError, match="num_model_chunks > 1"):
        hp(pp_size=2, num_microbatches=2, pp_style="interleaved")
    with pytest.raises(ValueError, match="one model chunk"):
        hp(pp_size=2, num_microbatches=2, num_model_chunks=2)
    with pytest.raises(ValueError, match="pp_style"):
        hp(pp_size=2, num_microbatches=2, pp_style="gpipe")
    with pytest.raises(ValueError, match="num_layers_per_stage"):
        hp(pp_size=2, num_microbatches=2, num_layers_per_stage=[1, 1, 2])
    with pytest.raises(ValueError, match="multiple"):
        hp(pp_size=2, num_microbatches=5, pp_style="interleaved", num_model_chunks=2)
    with pytest.raises(ValueError, match="num_microbatches >= pp_size"):
        hp(pp_size=4, num_microbatches=2)
    # pp 1: pipeline options are ignored with one INFO line, as Colossal-AI does (pinned in
    # tests/plugins/test_colossal_args_hybrid.py)
    assert hp(num_microbatches=2).pipeline is None
    with pytest.raises(ValueError, match="do not split evenly"):
        Booster(plugin=hp(pp_size=2, num_microbatches=2)).boost(tiny_model(3))
    with pytest.raises(ValueError, match="sums to"):
        Booster(plugin=hp(pp_size=2, num_microbatches=2, num_layers_per_stage=[1, 1])).boost(
            tiny_model(4))
    with pytest.raises(ValueError, match="Llama"):
        Booster(plugin=hp(pp_size=2, num_microbatches=2)).boost(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="pp_size > 1"):
        hp().execute_pipeline(iter([]), None)
    with pytest.raises(NotImplementedError, match="HybridParallelPlugin"):
        Booster(plugin=TorchDDPPlugin()).execute_pipeline(iter([]), None)
    assert not dist.is_initialized()
