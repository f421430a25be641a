"""How ZeRO's post-step all-gather groups parameters into buckets (``buckets._gather_buckets``).

A ``direct`` FP8 weight is always a bucket of its own (its gather lands in the weight's own
buffer). The other kinds share buckets of about ``bucket_numel`` elements; in ``together``
mode (the overlapped gather) direct weights count towards the bucket size, so small tensors
between them (norms, biases) are launched at most one bucket's worth of data late, in order.
"""
import torch

from fp8boost.parallel.zero.buckets import _gather_buckets
from fp8boost.parallel.zero.sharding import make_shard

WORLD = 2


def _layer_like():
    """Per "layer": two weights (direct, 8x8), then a norm (plain, 8) and a bias (fp8, 8)."""
    params, kinds = [], []
    for _ in range(3):
        for kind, shape in (("direct", (8, 8)), ("direct", (8, 8)), ("plain", (8,)),
                            ("fp8", (8,))):
            params.append(torch.zeros(shape))
            kinds.append(kind)
    shards = [make_shard(i, p, WORLD, 0) for i, p in enumerate(params)]
    return params, shards, kinds


def test_direct_weights_are_buckets_of_their_own():
    params, shards, kinds = _layer_like()
    got = list(_gather_buckets(params, shards, kinds, WORLD, bucket_numel=1000))
    direct = [i for i, k in enumerate(kinds) if k == "direct"]
    assert [b for b in got if kinds[b[0]] == "direct"] == [[i] for i in direct]
    # everything else in two buckets (one per kind), at the end: nothing filled
    assert got[-2:] == [[2, 6, 10], [3, 7, 11]]
    assert sorted(i for b in got for i in b) == list(range(len(params)))


def test_plain_buckets_still_fill_by_size():
    params, shards, kinds = _layer_like()
    got = list(_gather_buckets(params, shards, kinds, WORLD, bucket_numel=16))
    assert [2, 6] in got and [3, 7] in got  # 8 + 8 elements fill a 16-element bucket
    assert got[-2:] == [[10], [11]]


def test_together_launches_small_tensors_in_parameter_order():
    params, shards, kinds = _layer_like()
    # 128 elements = two weights: a layer's norm and bias go out once the next 128 elements
    # (weights 4 and 5) are under way, before weight 5: at most one bucket late
    got = list(_gather_buckets(params, shards, kinds, WORLD, bucket_numel=128, together=True))
    assert got == [[0], [1], [4], [2], [3], [5], [8], [6], [7], [9], [10], [11]], got
    big = list(_gather_buckets(params, shards, kinds, WORLD, bucket_numel=10_000, together=True))
    assert [b for b in big if len(b) > 1] == [[2, 6, 10], [3, 7, 11]]  # never filled: at the end
