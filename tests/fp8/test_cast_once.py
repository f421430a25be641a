"""``weights_cast_once``: each FP8 weight cast once for the forwards and backwards of one step
(a pipeline schedule's micro-batches), eager and compiled.

* Eager: three micro-batches inside cast each weight exactly once (counted at the backend),
  and outputs, gradients and the weights after two SGD steps are bit-identical to the same
  training without it (the operand is the weight's own cast; weights with outliers).
* On exit the operand is dropped: a forward after the optimizer step sees the new weight.
* Compiled (``aot_eager``: dynamo and AOT autograd, as inductor would get them): bit-identical
  to compiled training without it over two steps; inside, the compiled forward uses the
  operand cast at entry (a ``.data`` write is not seen there); after exit a compiled forward
  matches the eager layer with the stepped weight.
* A layer whose backend is not picked yet (``backend="auto"`` before its first forward).
* Layers it must leave alone: delayed scaling, rowwise, a frozen weight,
  ``cache_weight_cast=False``, and an operand another producer set (kept after exit).
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from fp8boost.fp8 import Fp8Config, Fp8Linear
from fp8boost.fp8.cast_once import weights_cast_once
from tests.fp8.test_linear import CountingBackend

EMU = Fp8Config(backend="emulated")
WEIGHT_SHAPES = [(96, 64), (64, 96)]


def _mlp(cfg: Fp8Config = EMU) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(Fp8Linear(64, 96, config=cfg), nn.GELU(), Fp8Linear(96, 64, config=cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
        model[0].weight[3, 5] = 40.0  # an outlier sets the tensorwise scale
    return model


def _batches(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 64, generator=g) for _ in range(n)]
    xs[0][2, 7] = 300.0
    return xs


def _train(model, forward, cast_once: bool, steps: int = 2) -> list[torch.Tensor]:
    """``steps`` SGD steps of three micro-batches each; the outputs of every forward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs = []
    for _ in range(steps):
        ctx = weights_cast_once([model]) if cast_once else contextlib.nullcontext()
        with ctx:
            for x in _batches():
                y = forward(x)
                outs.append(y.detach())
                (y.float() ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return outs


def _use(model, backend) -> None:
    for layer in model:
        if isinstance(layer, Fp8Linear):
            layer.use_backend(backend, torch.device("cpu"))


def test_eager_one_cast_per_weight_and_bit_identical_training():
    once, plain = _mlp(), _mlp()
    counted = CountingBackend()
    _use(once, counted)
    opt = torch.optim.SGD(once.parameters(), lr=0.05)
    with weights_cast_once([once, once[0]]) as n:  # a layer named twice is cast once
        assert n == 2
        assert all(layer.operands.prequantized is not None for layer in (once[0], once[2]))
        for x in _batches():
            once(x).float().pow(2).mean().backward()
    # the three micro-batches' forwards and backwards cast no weight: one cast each, up front
    assert [counted.shapes.count(s) for s in WEIGHT_SHAPES] == [1, 1], counted.shapes
    assert once[0].operands.prequantized is None and once[2].operands.prequantized is None
    opt.step()
    opt.zero_grad()
    counted.shapes.clear()
    x = _batches()[0]
    after = once(x)  # after exit and a step: the layer casts the new weight itself
    assert [counted.shapes.count(s) for s in WEIGHT_SHAPES] == [1, 1]
    assert torch.equal(after, copy.deepcopy(once)(x))

    once, plain = _mlp(), _mlp()
    got, want = _train(once, once, True), _train(plain, plain, False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(once.parameters(), plain.parameters()))


def test_compiled_bit_identical_and_fresh_after_exit():
    torch._dynamo.reset()
    once, plain = _mlp(), _mlp()
    f_once = torch.compile(once, backend="aot_eager")
    f_plain = torch.compile(plain, backend="aot_eager")
    got, want = _train(once, f_once, True), _train(plain, f_plain, False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(once.parameters(), plain.parameters()))
    x = _batches()[1]
    eager = copy.deepcopy(once)
    assert torch.equal(f_once(x), eager(x))  # no stale operand outside the block
    # Inside the block the compiled forward takes the operand cast at entry, not a cast of its
    # own: a write through .data (invisible to every cache key) is not seen there, and is seen
    # once the block ends.
    before = f_once(x)
    with weights_cast_once([once]):
        once[0].weight.data.mul_(0.5)
        assert torch.equal(f_once(x), before)
    assert not torch.equal(f_once(x), before)


def test_backend_not_picked_yet():
    """Under the default ``backend="auto"`` a CPU layer picks its backend at its first forward
    (the model may still move); the block picks it before casting (a pipeline step's first
    forward runs inside it)."""
    once, plain = _mlp(Fp8Config()), _mlp(Fp8Config())
    assert once[0].casts.backend is None
    got, want = _train(once, once, True, steps=1), _train(plain, plain, False, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("case", ["delayed", "rowwise", "frozen", "uncached", "other producer"])
def test_layers_it_leaves_alone(case):
    cfg = {"delayed": Fp8Config.from_recipe("delayed", backend="emulated"),
           "rowwise": Fp8Config.from_recipe("rowwise", backend="emulated"),
           "uncached": EMU.replace(cache_weight_cast=False)}.get(case, EMU)
    layer = Fp8Linear(64, 32, config=cfg)
    other = None
    if case == "frozen":
        layer.weight.requires_grad_(False)
    if case == "other producer":  # ZeRO's FP8 all-gather hands its own bytes
        op = layer.operands.weight_operand(layer.weight, with_transpose=False)
        layer.set_prequantized_weight(op.data, op.inv_scale)
        other = layer.operands.prequantized
    with weights_cast_once([layer]) as n:
        assert n == 0
        assert layer.operands.prequantized is other
        layer(torch.randn(4, 64))
    assert layer.operands.prequantized is other
