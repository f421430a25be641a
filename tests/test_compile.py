"""fp8boost.compile.compile_blocks and the KV-cache rule: a 12-block model compiles to one graph
(no recompile, no block left eager), FP8 layers included, and a block that would fall back to
eager raises.

Regression: ``examples/train_llama.py --preset 125m --compile`` (12 blocks) trained with the HF
KV cache on; each compiled block guarded on its own cache layer and blocks past the eighth ran
eager with only a log line (dynamo's recompile limit).
"""
from __future__ import annotations

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from fp8boost.booster import Booster
from fp8boost.compile import compile_blocks
from fp8boost.fp8 import Fp8Config, Fp8Linear, convert_to_fp8


def _model(layers: int = 12):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=layers,
                                   vocab_size=128, max_position_embeddings=64)
    assert cfg.use_cache  # the HF default, which training must not follow
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture
def dynamo_defaults():
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256,
                                    fail_on_recompile_limit_hit=False):
        yield
    torch._dynamo.reset()


def _steps(model, n: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for s in range(n):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def test_twelve_fp8_blocks_compile_to_one_graph(dynamo_defaults):
    model = _model()
    convert_to_fp8(model, Fp8Config(backend="emulated", min_numel=0))
    assert compile_blocks(model, backend="eager") == 12
    assert model.config.use_cache is False
    _steps(model)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 1
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 12 * 7


def test_booster_trains_without_kv_cache_and_user_compile_keeps_one_graph(dynamo_defaults):
    """Blocks compiled by hand (``block.compile()``, as scripts do) and boosted: the Booster
    turns the cache off, so no block guards on a cache layer."""
    model = _model()
    for block in model.model.layers:
        block.compile(backend="eager")
    model, *_ = Booster(mixed_precision="fp32", device="cpu").boost(model)
    assert model.unwrap().config.use_cache is False
    _steps(model)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 1


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.k = 0

    def forward(self, x):
        return self.lin(x) * self.k  # an int attribute: dynamo specializes on it


def test_a_block_falling_back_to_eager_raises(dynamo_defaults):
    model = torch.nn.Sequential(torch.nn.ModuleList([_Block(), _Block()]))
    compile_blocks(model, backend="eager")
    assert torch._dynamo.config.recompile_limit == 2 + 8
    block = model[0][0]
    with pytest.raises(Exception, match="(?i)recompile"):
        for k in range(20):
            block.k = k
            block(torch.randn(2, 8))


def test_no_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="no nn.ModuleList of blocks"):
        compile_blocks(torch.nn.Linear(4, 4), backend="eager")


class _Stack(torch.nn.Module):
    """Blocks that are torch's own ``nn.Sequential`` (not a class of the user's or of HF)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
            for _ in range(3))

    def forward(self, x):
        for block in self.layers:
            x = x + block(x)
        return x


@pytest.mark.parametrize("fp8", [False, True])
def test_torch_container_blocks_compile_whole(dynamo_defaults, fp8):
    """dynamo does not trace a frame of torch.nn's files at the top: on torch 2.13
    ``nn.Sequential.compile(fullgraph=True)`` raised "found no compiled frames", and without
    fullgraph only the FP8 layers compiled (the GELU ran eager). compile_blocks enters such a
    block through a frame of its own, so each block is one graph: both Linears and the GELU."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    model = _Stack()
    if fp8:
        convert_to_fp8(model, Fp8Config(backend="emulated", min_numel=0))
    assert compile_blocks(model, backend=record, fullgraph=True) == 3
    want = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(1)))
    want.sum().backward()
    assert graphs and all(any("gelu" in t for t in g) for g in graphs), graphs
    assert len(graphs) <= 2, len(graphs)  # one graph for every block (a recompile at most)
