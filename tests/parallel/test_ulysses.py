"""The Ulysses all-to-alls (``fp8boost.parallel.sp``) against a single-process reference, and
the sequence-parallel argument checks (no process group: they raise before any collective).

Reference: every rank builds the same full tensor ``X [b, h, s, d]`` (random, with a few
outliers 100x the rest); rank r holds ``X[:, :, chunk r]``. ``seq_to_heads`` must return
``X[:, head chunk r]`` and the backward of ``sum(out * W[:, head chunk r])`` must be
``W[:, :, chunk r]`` (the all-to-all is a permutation). Tolerances:

* fp32 / bf16 payload: exact (bit-identical: only bytes move);
* FP8 payload (e4m3, one scale per destination chunk): the error of each element is at most
  half an e4m3 step at the chunk's scale, i.e. ``|err| <= amax(chunk) * 2**-4`` (e4m3 has 3
  mantissa bits; subnormals are below that bound); the chunk a rank keeps stays exact and
  gradients (in dtype) stay exact.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

B, H, S, D = 2, 4, 8, 16


def _full(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, S, D, generator=g)
    x.view(-1)[torch.randint(0, x.numel(), (6,), generator=g)] *= 100.0  # outliers
    return x.to(dtype)


def _a2a_worker(rank: int, world: int) -> dict:
    from fp8boost.parallel.sp import heads_to_seq, seq_to_heads

    group = dist.group.WORLD
    s, h = S // world, H // world
    seq, heads = slice(rank * s, (rank + 1) * s), slice(rank * h, (rank + 1) * h)
    worst = {}
    for dtype in (torch.float32, torch.bfloat16):
        for fp8 in (False, True):
            x_full, w_full = _full(0, dtype), _full(1, dtype)
            x = x_full[:, :, seq].clone().requires_grad_(True)
            out = seq_to_heads(x, group, fp8=fp8)
            want = x_full[:, heads]
            (out.float() * w_full[:, heads].float()).sum().backward()
            assert torch.equal(x.grad, w_full[:, :, seq]), (dtype, fp8)  # grads in dtype
            back = heads_to_seq(want.clone(), group, fp8=fp8)
            if not fp8:
                assert torch.equal(out, want) and torch.equal(back, x_full[:, :, seq])
                continue
            mine = slice(rank * s, (rank + 1) * s)  # the chunk this rank keeps: never quantized
            assert torch.equal(out[:, :, mine], want[:, :, mine])
            # a received chunk: a sequence chunk of ``out`` (dim 2), a head chunk of ``back``
            for got, ref, dim in ((out, want, 2), (back, x_full[:, :, seq], 1)):
                for g, r in zip(got.float().chunk(world, dim), ref.float().chunk(world, dim)):
                    err, bound = (g - r).abs().max(), r.abs().amax() * 2.0 ** -4
                    assert err <= bound, (dtype, err, bound)
                    worst[str(dtype)] = max(worst.get(str(dtype), 0.0), float(err / bound))
            # heads_to_seq's backward is seq_to_heads of the gradient, in dtype
            y = want.clone().requires_grad_(True)
            (heads_to_seq(y, group, fp8=True).float() * w_full[:, :, seq].float()).sum().backward()
            assert torch.equal(y.grad, w_full[:, heads])
    with pytest.raises(ValueError, match="divisible"):
        seq_to_heads(torch.zeros(1, 3, 2, 4), group)
    return worst


def test_all_to_all_matches_single_process() -> None:
    results = run_distributed(_a2a_worker, 2)
    assert all(v <= 1.0 for r in results for v in r.values())


def test_sp_arguments_raise_before_any_collective(caplog) -> None:
    from fp8boost import _state
    from fp8boost.booster import Booster
    from fp8boost.parallel.mesh import ParallelDims
    from fp8boost.plugins import HybridParallelPlugin
    from tests.plugins.hybrid_cases import tiny_model

    assert not dist.is_initialized()
    for mode in ("ring_attn", "ring"):
        with pytest.raises(ValueError, match="all_to_all"):
            HybridParallelPlugin(sp_size=2, enable_sequence_parallelism=True,
                                 sequence_parallelism_mode=mode)
    with pytest.raises(ValueError, match="all_to_all"):  # split_gather without tp
        HybridParallelPlugin(enable_sequence_parallelism=True)
    with pytest.raises(ValueError, match="sp_size must be None, 1 or tp_size"):
        HybridParallelPlugin(tp_size=2, sp_size=4, enable_sequence_parallelism=True)
    with pytest.raises(ValueError, match="pp_size > 1"):
        HybridParallelPlugin(pp_size=2, sp_size=2, num_microbatches=2,
                             enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all")
    with pytest.raises(ValueError, match="enable_sequence_parallelism=True"):
        HybridParallelPlugin(sp_size=2)
    with pytest.raises(ValueError, match="sp_size must be"):
        HybridParallelPlugin(sp_size=0, enable_sequence_parallelism=True,
                             sequence_parallelism_mode="all_to_all")
    _state.reset()
    with caplog.at_level("INFO", logger="fp8boost"):  # ignored without SP, as in Colossal-AI
        plugin = HybridParallelPlugin(sequence_parallelism_mode="all_to_all")
    assert plugin.sequence_parallelism_mode is None and plugin.sp_size == 1
    assert "ignored" in caplog.text
    sp = HybridParallelPlugin(tp_size=2, sp_size=2, enable_sequence_parallelism=True,
                              sequence_parallelism_mode="all_to_all")
    assert sp.sequence_parallelism_mode == "all_to_all" and sp.sp_size == 2
    # 8 heads / 4 kv heads: tp 2 x sp 4 leaves 2 kv heads per tp rank for 4 sp ranks
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Booster(plugin=HybridParallelPlugin(tp_size=2, sp_size=4, enable_sequence_parallelism=True,
                                            sequence_parallelism_mode="all_to_all")
                ).boost(tiny_model())
    with pytest.raises(ValueError, match="num_attention_heads"):
        Booster(plugin=HybridParallelPlugin(sp_size=3, enable_sequence_parallelism=True,
                                            sequence_parallelism_mode="all_to_all")
                ).boost(tiny_model())
    with pytest.raises(ValueError, match="must divide the world size"):  # sp 2 on 3 ranks
        ParallelDims.for_world(3, sp=2)
    assert ParallelDims(dp=2, pp=1, sp=2, tp=2, world_size=8).coords(5) == \
        {"dp": 1, "pp": 0, "sp": 0, "tp": 1, "ep": 0, "moe_dp": 1}
    assert not dist.is_initialized()
