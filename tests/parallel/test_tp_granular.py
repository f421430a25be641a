"""Rowwise and blockwise FP8 under tensor parallelism (issue 26, item 3), 2 ranks on gloo.

Oracle: one process running the same column-parallel -> row-parallel MLP (FP32, emulated
backend). Rowwise reduces the per-row amaxes of the operands whose rows span shards
(the row-parallel layer's ``x`` and ``W``, the column-parallel layer's ``dy`` and ``W^T``), so
every FP8 byte is one process's (checked bit for bit): outputs and gradients then differ from
one process only by the FP32 summation order of the split GEMMs (measured 5e-8 relative,
blockwise 2.5e-7; the bound is 1e-6). Without the reduction (shard-local row scales) the output
differs by FP8 rounding (measured 5e-6: the outlier channel dominates the norms), which the test
asserts too, so the oracle tells the two apart. Blockwise needs no reduction when each shard's
split dim is a multiple of 128 (every tile and block lies within a shard). The weight gradients
are equal bit for bit in every case: wgrad operands are scaled along the token axis, whole on
every tensor-parallel rank.
"""
from __future__ import annotations

import torch

from tests.dist_utils import run_distributed

M, K, N, OUT = 16, 256, 512, 128  # N / 2 = 256: each shard a multiple of 128


def _data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(M, K, generator=g)
    x[:, 5] *= 300.0  # an outlier channel: its shard's row amaxes differ from the other's
    w1 = torch.randn(N, K, generator=g) / K ** 0.5
    w1[:, 200] *= 50.0  # W^T rows (columns of W1) with outliers in one shard only
    w2 = torch.randn(OUT, N, generator=g) / N ** 0.5
    w2[:, 3] *= 50.0
    dy = torch.randn(M, OUT, generator=g)
    dy[2] *= 1e3
    return x, w1, w2, dy


def _mlp(recipe: str, w1, w2):
    from fp8boost.fp8 import Fp8Config, Fp8Linear
    cfg = Fp8Config.from_recipe(recipe, backend="emulated", min_numel=0)
    l1 = Fp8Linear(w1.shape[1], w1.shape[0], bias=False, config=cfg)
    l2 = Fp8Linear(w2.shape[1], w2.shape[0], bias=False, config=cfg)
    with torch.no_grad():
        l1.weight.copy_(w1)
        l2.weight.copy_(w2)
    return l1, l2


def _run(recipe: str, rank: int, world: int, group, reduce: bool) -> dict:
    from fp8boost.parallel.tp.functional import copy_to_tp, reduce_from_tp
    x, w1, w2, dy = _data()
    n = N // world
    l1, l2 = _mlp(recipe, w1[rank * n:(rank + 1) * n], w2[:, rank * n:(rank + 1) * n])
    if reduce:
        l1.set_amax_groups({"weight": group, "grad": group})  # column-parallel: N split
        l2.set_amax_groups({"input": group, "weight": group})  # row-parallel: K split
    xi = x.clone().requires_grad_(True)
    y = reduce_from_tp(l2(torch.nn.functional.gelu(l1(copy_to_tp(xi, group)))), group)
    y.backward(dy)
    return {"y": y.detach(), "dx": xi.grad, "dw1": l1.weight.grad, "dw2": l2.weight.grad}


def _reference(recipe: str) -> dict:
    x, w1, w2, dy = _data()
    l1, l2 = _mlp(recipe, w1, w2)
    xi = x.clone().requires_grad_(True)
    y = l2(torch.nn.functional.gelu(l1(xi)))
    y.backward(dy)
    return {"y": y.detach(), "dx": xi.grad, "dw1": l1.weight.grad, "dw2": l2.weight.grad}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _bytes_match(rank: int, world: int, group) -> dict:
    """The shard's rowwise operands with the reduction are the slices of one process's."""
    from fp8boost.fp8.granular import quantize_cols_t, quantize_rows
    x, w1, _, _ = _data()
    k = K // world
    full, shard = quantize_rows(x), quantize_rows(x[:, rank * k:(rank + 1) * k], amax_group=group)
    local = quantize_rows(x[:, rank * k:(rank + 1) * k])
    n = N // world
    full_t = quantize_cols_t(w1)
    shard_t = quantize_cols_t(w1[rank * n:(rank + 1) * n], amax_group=group)
    sl = slice(rank * k, (rank + 1) * k)
    return {
        "rows": torch.equal(shard.data.view(torch.uint8), full.data[:, sl].view(torch.uint8))
        and torch.equal(shard.inv_scale, full.inv_scale),
        "rows_local_differ": not torch.equal(local.inv_scale, full.inv_scale),
        "cols": torch.equal(shard_t.data.view(torch.uint8),
                            full_t.data[:, rank * n:(rank + 1) * n].view(torch.uint8))
        and torch.equal(shard_t.inv_scale, full_t.inv_scale),
    }


def _suite(rank: int, world: int) -> dict:
    import torch.distributed as dist
    group = dist.group.WORLD
    out = {"bytes": _bytes_match(rank, world, group)}
    n = N // world
    for recipe, reduce in (("rowwise", True), ("rowwise", False), ("blockwise", True)):
        got, want = _run(recipe, rank, world, group, reduce), _reference(recipe)
        want["dw1"] = want["dw1"][rank * n:(rank + 1) * n]
        want["dw2"] = want["dw2"][:, rank * n:(rank + 1) * n]
        out[(recipe, reduce)] = {k: _rel(got[k], want[k]) for k in got}
    return out


def test_tp_rowwise_reduces_spanning_rows_and_blockwise_is_shard_local():
    results = run_distributed(_suite, 2, timeout=200)
    # the outlier channel lies in rank 0's half: rank 1's own row amaxes are smaller
    assert any(r["bytes"]["rows_local_differ"] for r in results)
    for rank, r in enumerate(results):
        assert r["bytes"]["rows"] and r["bytes"]["cols"], (rank, r["bytes"])
        for key in (("rowwise", True), ("blockwise", True), ("rowwise", False)):
            assert r[key]["dw1"] == r[key]["dw2"] == 0.0, (rank, key, r[key])
        for key in (("rowwise", True), ("blockwise", True)):
            assert max(r[key].values()) < 1e-6, (rank, key, r[key])
        # shard-local row scales round differently from one process: the oracle sees it
        local, reduced = max(r[("rowwise", False)].values()), max(r[("rowwise", True)].values())
        assert local > max(1e-6, 10 * reduced), (rank, local, reduced)
