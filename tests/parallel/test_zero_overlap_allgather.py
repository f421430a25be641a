"""ZeRO's ``overlap_allgather`` (gloo, 2 ranks): the post-step all-gather unpacked by the next
forward, bit-identical to the gather that ``step()`` finishes itself.

One spawn checks, for stage 1 and 2, BF16 and FP8 (direct path bound) parameter gathers:
* after ``step()`` the gather is pending and the parameters still hold their old values;
* the next forward unpacks them (pre-hooks on the repeated blocks and the other modules):
  losses, parameters and the Fp8Linear layers' gathered FP8 operands equal the non-overlapped
  run bit for bit, step after step, also with the blocks compiled (``compile_blocks``,
  ``fullgraph=True``), in as many graphs as without overlap;
* ``state_dict()`` and ``load_state_dict()`` of the model finish the gather first (a load is
  never overwritten by a late unpack); re-reading masters from parameters written while a
  gather is pending raises, naming ``wait_params()``;
* ``LowLevelZeroPlugin`` and ``HybridParallelPlugin(zero_stage=1)`` with
  ``overlap_allgather=True`` bind the hooks and train like the default.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.dist_utils import run_distributed


class _Block(nn.Module):
    def __init__(self, linear) -> None:
        super().__init__()
        self.up, self.down = linear(32, 64), linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _Net(nn.Module):
    """Two repeated blocks in a ModuleList (what compile_blocks compiles) and a head."""

    def __init__(self, linear) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(linear), _Block(linear)])
        self.head = linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x)


def _model(fp8: bool) -> nn.Module:
    from fp8boost.fp8 import Fp8Config, Fp8Linear
    torch.manual_seed(0)
    cfg = Fp8Config(backend="emulated", min_numel=0)
    linear = (lambda i, o: Fp8Linear(i, o, config=cfg)) if fp8 else nn.Linear
    return _Net(linear).to(torch.bfloat16)


def _fp8_weights(model: nn.Module) -> list:
    return [m.weight for m in model.modules() if hasattr(m, "prequantized_weight")]


def _optimizer(model: nn.Module, stage: int, fp8: bool, overlap: bool):
    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.parallel.comm.plan import CommPlan, CommRoute
    from fp8boost.parallel.zero import ZeroOptimizer
    plan = None
    if fp8:
        plan = CommPlan(requested=True, engine="zero", config=Fp8CommConfig(min_payload_numel=0),
                        param_all_gather=CommRoute(fp8=True, why_not=""))
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        dp_group=dist.group.WORLD, stage=stage, comm_plan=plan,
                        fp8_params=_fp8_weights(model) if fp8 else None,
                        reduce_bucket_numel=1500, overlap_allgather=overlap)
    opt.bind_fp8_layers(model)
    opt.bind_overlap(model)
    return opt


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + rank)
    return (torch.randn(8, 32, generator=g) * (1 + rank)).to(torch.bfloat16)


def _operands(model: nn.Module) -> list:
    """The gathered FP8 bytes and inverse scale each layer feeds its GEMM (FP8 direct path)."""
    out = []
    for m in model.modules():
        pre = getattr(m, "prequantized_weight", None)
        if pre is not None:
            out.append((pre.data.view(torch.uint8).clone(), pre.inv_scale.clone()))
    return out


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def _graphs(rank: int, overlap: bool) -> dict:
    """dynamo's counts over 3 steps of the FP8 model, its blocks compiled (fullgraph)."""
    from torch._dynamo.utils import counters

    from fp8boost.compile import compile_blocks
    torch._dynamo.reset()
    counters.clear()
    model = _model(True)
    opt = _optimizer(model, 2, True, overlap)
    compile_blocks(model, backend="aot_eager", fullgraph=True)
    for step in range(3):
        opt.backward(model(_batch(rank, step)).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    opt.remove_hooks()
    return dict(counters["stats"])


def _run_pair(rank: int, stage: int, fp8: bool, compiled: bool = False) -> None:
    from fp8boost.compile import compile_blocks
    ref, ovl = _model(fp8), _model(fp8)
    opt_ref, opt_ovl = _optimizer(ref, stage, fp8, False), _optimizer(ovl, stage, fp8, True)
    if compiled:  # fullgraph: a graph break inside a block raises
        compile_blocks(ovl, backend="aot_eager", fullgraph=True)
    for step in range(3):
        x = _batch(rank, step)
        loss_ref = ref(x).float().pow(2).mean()
        loss_ovl = ovl(x).float().pow(2).mean()  # the pre-hooks unpack the last step's gather
        assert torch.equal(loss_ref, loss_ovl), (stage, fp8, step)
        assert not opt_ovl._overlap.pending
        assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), ovl.parameters()))
        if fp8:
            got, want = _operands(ovl), _operands(ref)
            assert len(got) == len(want) == (5 if step else 0)  # bytes arrive with a step
            assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
                       for g, w in zip(got, want))
        before = [p.detach().clone() for p in ovl.parameters()]
        opt_ref.backward(loss_ref)
        opt_ovl.backward(loss_ovl)
        opt_ref.step()
        opt_ovl.step()
        opt_ref.zero_grad()
        opt_ovl.zero_grad()
        # launched, not unpacked: the working parameters are the old ones until the forward
        assert opt_ovl._overlap.pending
        assert all(torch.equal(p, q) for p, q in zip(ovl.parameters(), before))
        assert not all(torch.equal(p, q) for p, q in zip(ref.parameters(), before))
    # Launch order follows the model: the first block's buckets (its FP8 weights and its
    # biases, two kinds of bucket) all go before the head's (else its forward would wait for
    # the whole gather).
    of = opt_ovl._overlap._launched._bucket_of
    index = {id(p): i for i, p in enumerate(opt_ovl.params)}
    first = [of[index[id(p)]] for p in ovl.layers[0].parameters()]
    last = [of[index[id(p)]] for p in ovl.head.parameters()]
    assert max(first) < min(last), (first, last)
    # state_dict finishes the pending gather first
    assert opt_ovl._overlap.pending and _same(ref, ovl) and not opt_ovl._overlap.pending
    # a load is not overwritten by a late unpack; hand-written params with a pending gather
    # are refused when masters are re-read from them
    snapshot = copy.deepcopy(ref.state_dict())
    x = _batch(rank, 9)
    for model, opt in ((ref, opt_ref), (ovl, opt_ovl)):
        opt.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    assert opt_ovl._overlap.pending
    with pytest.raises(RuntimeError, match="wait_params"):
        opt_ovl.sync_master_from_model()
    ovl.load_state_dict(snapshot)
    assert not opt_ovl._overlap.pending
    assert all(torch.equal(v, snapshot[k]) for k, v in ovl.state_dict().items())
    opt_ovl.sync_master_from_model()  # nothing pending now: accepted
    opt_ovl.wait_params()  # a no-op
    opt_ovl.remove_hooks()
    opt_ref.remove_hooks()


def _plugin(rank: int, world: int) -> None:
    """Both plugins that take the option bind it and train as without it."""
    from fp8boost.booster import Booster
    from fp8boost.plugins import HybridParallelPlugin, LowLevelZeroPlugin
    from tests.plugins import helpers as H
    plugins = {"zero": lambda o: LowLevelZeroPlugin(stage=2, overlap_allgather=o),
               "hybrid": lambda o: HybridParallelPlugin(zero_stage=1, overlap_allgather=o)}
    for name, make in plugins.items():
        losses = {}
        for overlap in (False, True):
            booster = Booster(plugin=make(overlap))
            model = H.make_mlp()
            model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.05))
            assert (opt._overlap is not None) == overlap, name
            losses[overlap] = H.train(booster, model, opt, rank, world, 4)
        assert losses[True] == losses[False], (name, losses)


def _worker(rank: int, world: int) -> None:
    for stage in (2, 1):
        for fp8 in (False, True):
            _run_pair(rank, stage, fp8)
    _run_pair(rank, 2, True, compiled=True)
    # The hooks split no block's graph: as many graphs as without overlap_allgather (a hook
    # on a module inside a compiled block would add frames).
    assert _graphs(rank, True) == _graphs(rank, False)
    _plugin(rank, world)


def test_overlapped_allgather_matches_the_finished_one():
    run_distributed(_worker, 2, timeout=300)


def test_overlap_needs_several_ranks_and_is_off_by_default():
    """One rank copies the masters in place: nothing to overlap, nothing deferred."""
    from fp8boost.parallel.zero import ZeroOptimizer
    model = _model(False)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap_allgather=True)
    assert opt._overlap is None
    opt.bind_overlap(model)  # a no-op
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(model(_batch(0, 0)).float().pow(2).mean())
    opt.step()
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
