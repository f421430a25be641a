"""FP8 experts under ``torch.compile`` (issue 27), on CPU with the emulated backend.

What must hold, as for the dense FP8 layers (tests/test_compile.py): a decoder block compiled the
way ``fp8boost.compile.compile_blocks`` does it traces routing, the grouped FP8 GEMMs and the
combine into one graph (no graph break), keeps that one graph while the routing changes every
step (every shape depends on the token count alone: no recompile), and gives eager's numbers.

Tolerances. ``aot_eager`` runs the traced ops as eager does: forward, input and weight gradients
are bit-identical (``torch.equal``). ``inductor`` generates its own FP32 elementwise code; the
FP8 casts stay bit-identical (checked here on the casts alone) and the emulated GEMMs are the
same custom-op kernels, but the activation's backward (SiLU) may differ from eager in the last
bit, which can move one per-(expert, column) amax, hence one scale, by an ulp: measured up to
1.2e-7 absolute on weight gradients of magnitude ~8 (relative 1e-8). We allow 1e-6 relative.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from fp8boost.compile import compile_blocks
from fp8boost.fp8 import convert_to_fp8
from fp8boost.fp8.moe import fp8_experts, route
from fp8boost.fp8.moe.gemm import emulated_mm, emulated_mm_wgrad
from fp8boost.fp8.moe.quantize import ScaleOptions, quantize_groups_t
from tests.fp8.test_moe import EMU, rel, tiny

FAMILIES = ("mixtral", "qwen3_moe")


@pytest.fixture
def dynamo():
    """Fresh dynamo state and counters; at most one graph per code object (a recompile raises)."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256,
                                    fail_on_recompile_limit_hit=False):
        yield
    torch._dynamo.reset()


def _fp8_model(family: str):
    model = tiny(family)
    model.config.use_cache = False
    convert_to_fp8(model, EMU)
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 + step))


def _expert_inputs(step: int, tokens: int = 24, experts: int = 4):
    """Random tokens with an outlier, and a routing that changes with ``step``."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(tokens, 64, generator=g)
    x[step % tokens, 5] = 40.0
    idx = torch.randint(0, experts, (tokens, 2), generator=g)
    idx[: tokens // 3, 0] = step % experts  # uneven groups; the crowded expert moves each step
    return x, idx, torch.rand(tokens, 2, generator=g).softmax(-1)


def _routing_counts(model) -> list[torch.Tensor]:
    """Hooks recording the tokens per expert of every expert module's calls."""
    seen: list[torch.Tensor] = []
    for m in fp8_experts(model):
        m.register_forward_hook(lambda mod, args, out: seen.append(
            torch.bincount(args[1].reshape(-1), minlength=mod.spec.num_experts)))
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_blocks_equal_eager_over_steps_with_new_routings(dynamo, family):
    model = _fp8_model(family)
    ref = copy.deepcopy(model)
    counts = _routing_counts(ref)  # eager only: a hook in the compiled block would be traced
    assert compile_blocks(model, backend="aot_eager") == 2
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    for step in range(3):
        ids = _batch(step)
        losses = [m(input_ids=ids, labels=ids).loss for m in (model, ref)]
        for loss in losses:
            loss.backward()
        assert torch.equal(losses[0], losses[1]), (step, losses)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), (step, name, rel(p.grad, q.grad))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    # Three steps of two blocks: six routings, which must differ (else no recompile is proven).
    assert len(counts) == 6 and len({tuple(c.tolist()) for c in counts}) == 6, counts
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 1, dict(counters["frames"])


def _check_experts(experts, compiled, exact: bool, tokens: tuple[int, ...]) -> None:
    """One forward + backward per entry of ``tokens`` (its token count), compiled vs eager."""
    ref = copy.deepcopy(experts)
    for step in range(len(tokens)):
        x, idx, w = _expert_inputs(step, tokens[step])
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ys = [compiled(xs[0], idx, w), ref(xs[1], idx, w)]
        dy = torch.randn(ys[1].shape, generator=torch.Generator().manual_seed(50 + step))
        for y in ys:
            y.backward(dy)
        pairs = [("y", *ys), ("dx", xs[0].grad, xs[1].grad)]
        pairs += [(n, p.grad, q.grad) for (n, p), q in zip(experts.named_parameters(),
                                                           ref.parameters())]
        for name, got, want in pairs:
            assert torch.isfinite(got).all() and want.abs().max() > 0, (step, name)
            if exact:
                assert torch.equal(got, want), (step, name, rel(got, want))
            else:
                assert rel(got, want) < 1e-6, (step, name, rel(got, want))
        for p in (*experts.parameters(), *ref.parameters()):
            p.grad = None


def test_fullgraph_experts_equal_eager_one_graph_per_token_count(dynamo):
    experts = fp8_experts(_fp8_model("qwen3_moe"))[0]
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(experts, backend=cnt, fullgraph=True)  # a graph break raises
    _check_experts(experts, compiled, exact=True, tokens=(24, 24, 24))
    assert cnt.frame_count == 1, cnt.frame_count  # three routings, one graph
    code = cnt.graphs[0].print_readable(print_output=False)
    # The FP8 path is in the graph: both projections' emulated grouped GEMMs.
    assert code.count("fp8boost.moe_emulated_mm.default") >= 2, code[-3000:]
    # A new token count marks the token dim dynamic (dynamo's automatic dynamic, one
    # recompile); later counts reuse that graph.
    _check_experts(experts, compiled, exact=True, tokens=(40, 16, 7))
    assert cnt.frame_count == 2, cnt.frame_count


def test_inductor_experts_equal_eager_within_last_bit_with_one_graph(dynamo):
    experts = fp8_experts(_fp8_model("mixtral"))[0]
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(experts, backend=cnt, fullgraph=True)
    _check_experts(experts, compiled, exact=False, tokens=(24, 24, 24))
    assert cnt.frame_count == 1, cnt.frame_count


def test_compiled_forward_does_not_resolve_the_backend(dynamo, monkeypatch):
    """Options are resolved at conversion: resolving them in a traced forward broke the graph
    (the probe's lock, the one-time log's lock) and changed a guarded attribute."""
    experts = fp8_experts(_fp8_model("mixtral"))[0]
    assert experts._grouped_options is not None

    def refuse(*_a, **_k):
        raise AssertionError("resolve_backend called in the forward")

    monkeypatch.setattr("fp8boost.fp8.moe.experts.resolve_backend", refuse)
    x, idx, w = _expert_inputs(0)
    experts.float()  # same device: the options resolved before are kept
    torch.compile(experts, backend="eager", fullgraph=True)(x, idx, w)


def test_route_and_casts_trace_without_breaks_and_equal_eager(dynamo):
    ids = torch.randint(0, 5, (33, 3), generator=torch.Generator().manual_seed(0))
    ids[:20] = 4
    want = route(ids, 5)
    got = torch.compile(route, backend="eager", fullgraph=True)(ids, 5)
    for name in ("pos", "offsets", "group", "local"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.rows == want.rows
    x = torch.zeros(want.rows, 48).index_copy(0, want.pos, torch.randn(99, 48) * 3)
    x[want.pos[0], 1] = 500.0

    def cast(t):
        return quantize_groups_t(t, want.group, 5, torch.float8_e4m3fn, ScaleOptions())

    (d0, i0), (d1, i1) = cast(x), torch.compile(cast, backend="inductor", fullgraph=True)(x)
    assert torch.equal(d0.view(torch.uint8), d1.view(torch.uint8)) and torch.equal(i0, i1)


# opcheck's test_schema compares inputs before and after with ops FP8 tensors lack on CPU.
OPCHECKS = ("test_faketensor", "test_aot_dispatch_dynamic")


def test_emulated_grouped_gemm_ops_pass_opcheck():
    r = route(torch.tensor([[0, 2]] * 5 + [[2, 2]] * 7), 3)
    g = torch.Generator().manual_seed(0)
    e4 = torch.float8_e4m3fn
    a, b = torch.randn(r.rows, 32, generator=g).to(e4), torch.randn(3, 48, 32, generator=g).to(e4)
    a_inv, b_inv = torch.rand(r.rows, generator=g) + 0.5, torch.rand(3, 48, generator=g) + 0.5
    for grouped in (True, False):
        torch.library.opcheck(torch.ops.fp8boost.moe_emulated_mm.default,
                              (a, a_inv, b, b_inv, r.offsets, r.group, r.local, grouped),
                              test_utils=OPCHECKS)
        wa, wb = torch.randn(16, r.rows, generator=g).to(e4), a.t().contiguous()
        wa_inv, wb_inv = torch.rand(3, 16, generator=g) + 0.5, torch.rand(3, 32, generator=g)
        torch.library.opcheck(torch.ops.fp8boost.moe_emulated_mm_wgrad.default,
                              (wa, wa_inv, wb, wb_inv, r.offsets, r.group, r.local, grouped),
                              test_utils=OPCHECKS)
        # The wrappers are the ops: the same numbers as the custom op called directly.
        assert torch.equal(emulated_mm(a, a_inv, b, b_inv, r.offsets, r.group, r.local, grouped),
                           torch.ops.fp8boost.moe_emulated_mm(a, a_inv, b, b_inv, r.offsets,
                                                              r.group, r.local, grouped))
        assert emulated_mm_wgrad(wa, wa_inv, wb, wb_inv, r.offsets, r.group, r.local,
                                 grouped).shape == (3, 16, 32)


# ------------------------------------------------------------------ CUDA's code path, on CPU
# The scaled_grouped_mm backend's code (BF16 GEMM outputs from the custom ops
# fp8boost::moe_scaled_mm / _wgrad, masked and cast in function.py) compiled on CPU: the two
# ops get CPU kernels computing the same contract (FP32 accumulation of the dequantized
# operands, BF16 out), so everything but the CUDA kernel itself runs as on a GPU, the ops' own
# fake implementations included. (Registered for the whole test process: on CPU the real
# kernel, torch._scaled_grouped_mm, cannot run anyway.)
from fp8boost.fp8.moe import gemm as _gemm  # noqa: E402


@_gemm._scaled_mm_op.register_kernel("cpu")
def _scaled_mm_cpu(a, a_inv, b, b_inv, offsets, fast_accum):
    da, db = a.float() * a_inv.view(-1, 1), b.float() * b_inv.unsqueeze(-1)
    return torch._grouped_mm(da, db.transpose(-2, -1), offs=offsets).bfloat16()


@_gemm._scaled_wgrad_op.register_kernel("cpu")
def _scaled_wgrad_cpu(a, a_inv, b, b_inv, offsets, fast_accum):
    e, rows = a_inv.shape[0], a.shape[1]
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    group = torch.repeat_interleave(torch.arange(e), sizes)
    group = torch.cat([group, group.new_full((rows - group.numel(),), e)])  # tail: no group

    def deq(x, inv):
        return x.float() * torch.cat([inv, inv.new_zeros(1, inv.shape[1])])[group].t()

    return torch._grouped_mm(deq(a, a_inv), deq(b, b_inv).t(), offs=offsets).bfloat16()


# torch 2.11's emulate_precision_casts leaves this graph's BF16 intermediates in FP32 (the
# 1.3% of plain inductor remains; measured with torch 2.11 on CPU); 2.13 rounds them as eager.
_EMULATES_PRECISION_CASTS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


@pytest.mark.parametrize("backend,emulate", [("aot_eager", False), ("inductor", True)])
def test_scaled_grouped_mm_code_path_compiles_to_eager_bits(dynamo, backend, emulate):
    """BF16 experts on the GPU backend's code path: ``aot_eager`` and inductor with
    ``emulate_precision_casts`` (BF16 intermediates rounded where eager rounds them) give
    eager's bits for y, dx and both weight gradients. Plain inductor does not, by design: it
    keeps the activation's BF16 intermediates in FP32, which moves some values across an FP8
    rounding step (measured here: 1.3% on y, 2.6% on dx); the GPU test allows that.

    Inductor's vectorized CPU code is off here (``cpp.simdlen=1``): with it, torch 2.13's CPU
    inductor wrote NaN and zeros into one column of the transposed FP8 ``dy^T`` in this
    backward graph (the same graph without vectorization, and the same casts compiled alone,
    are exact). That is a CPU code generator's bug, not this code path's; GPUs run Triton."""
    import dataclasses

    from torch._inductor import config as inductor_config

    experts = fp8_experts(_fp8_model("qwen3_moe"))[0].bfloat16()
    device, opts = experts._grouped_options
    experts._grouped_options = (device, dataclasses.replace(opts, backend="scaled_grouped_mm"))
    ref = copy.deepcopy(experts)
    with inductor_config.patch({"emulate_precision_casts": emulate, "cpp.simdlen": 1}):
        compiled = torch.compile(experts, backend=backend, fullgraph=True)
        for step in range(3):
            x, idx, w = _expert_inputs(step, 32)
            xs = [x.bfloat16().requires_grad_() for _ in range(2)]
            ys = [compiled(xs[0], idx, w.bfloat16()), ref(xs[1], idx, w.bfloat16())]
            dy = torch.randn(ys[1].shape, generator=torch.Generator().manual_seed(7 + step))
            for y in ys:
                y.backward(dy.bfloat16())
            pairs = [("y", *ys), ("dx", xs[0].grad, xs[1].grad)]
            pairs += [(n, p.grad, q.grad) for (n, p), q in zip(experts.named_parameters(),
                                                               ref.parameters())]
            for name, got, want in pairs:
                assert want.abs().max() > 0, (step, name)
                if backend == "inductor" and not _EMULATES_PRECISION_CASTS:
                    assert rel(got, want) < 5e-2, (step, name, rel(got, want))
                else:
                    assert torch.equal(got, want), (step, name, rel(got, want))
            for p in (*experts.parameters(), *ref.parameters()):
                p.grad = None
