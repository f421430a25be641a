"""``report_granular_gather`` (parallel/comm/granular.py) on one process: what it counts and
records in a ``CommReport``."""
from __future__ import annotations

from torch import nn

from fp8boost.fp8 import Fp8Config, Fp8Linear
from fp8boost.parallel.comm.report import PARAM_ALL_GATHER, CommReport
from fp8boost.parallel.comm.granular import report_granular_gather


def _layer(recipe: str, rows: int) -> Fp8Linear:
    return Fp8Linear(256, rows, config=Fp8Config.from_recipe(recipe, backend="emulated",
                                                             min_numel=0))


def test_granular_reason_keeps_an_earlier_one():
    """FSDP2's plugins record the FP8 experts' reason first: the rowwise one must not erase
    it (it did: ``comm_report.why_not`` named only the rowwise layers)."""
    model = nn.Sequential(_layer("rowwise", 256), _layer("blockwise", 256),
                          _layer("tensorwise", 256))
    report = CommReport()
    report.not_fp8(PARAM_ALL_GATHER, "2 weights of Fp8Experts ...")
    # 2 shard ranks: the blockwise layer's 128-row shards travel with block scales
    assert report_granular_gather(report, "test", model, shard_ranks=2) == 1
    why = report.why_not[PARAM_ALL_GATHER]
    assert why.startswith("2 weights of Fp8Experts ...; 1 weights of rowwise/blockwise"), why

    fresh = CommReport()
    assert report_granular_gather(fresh, "test", model) == 2  # no shard ranks: no block gather
    assert fresh.why_not[PARAM_ALL_GATHER].startswith("2 weights of rowwise/blockwise")


def test_block_gather_needs_the_layers_wire_format():
    """An e5m2 wire (``Fp8CommConfig.param_dtype``) is not the blockwise GEMM's e4m3 format: the
    block gather does not apply, so the weight stays in the training dtype (and is counted),
    instead of taking the one-scale FP8 wire and being rounded twice."""
    import torch

    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.parallel.comm.granular import block_gathered
    block = _layer("blockwise", 256)
    e5m2 = Fp8CommConfig(param_dtype=torch.float8_e5m2)
    assert block_gathered(block, 2) and block_gathered(block, 2, Fp8CommConfig())
    assert not block_gathered(block, 2, e5m2)
    assert report_granular_gather(CommReport(), "test", nn.Sequential(block), 2, e5m2) == 1
