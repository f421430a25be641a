"""Fp8CommConfig's field names (issue 24 item 4): one meaning per name across fp8boost's
configs, the former names still accepted with a DeprecationWarning; ``enabled`` is no longer
the switch (the plugins' ``fp8_communication`` is); one typed ``CommReport``."""
from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import pytest
import torch

from fp8boost.parallel.comm import CommReport
from fp8boost.parallel.comm.config import (DEFAULT_MIN_PAYLOAD_NUMEL, RENAMED_FIELDS,
                                           Fp8CommConfig)
from fp8boost.parallel.comm.report import GRAD_REDUCE, PARAM_ALL_GATHER

DOC = Path(__file__).resolve().parents[2] / "docs" / "PLUGINS.md"


def test_current_names_and_defaults():
    cfg = Fp8CommConfig()
    assert cfg.min_payload_numel == DEFAULT_MIN_PAYLOAD_NUMEL and cfg.power_of_2_wire_scale
    names = {f.name for f in dataclasses.fields(Fp8CommConfig)}
    assert not names & set(RENAMED_FIELDS) and set(RENAMED_FIELDS.values()) <= names


@pytest.mark.parametrize("old, new, value", [("min_numel", "min_payload_numel", 0),
                                             ("power_of_2_scale", "power_of_2_wire_scale", False)])
def test_former_names_still_work_with_a_deprecation_warning(old, new, value):
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: use {new}"):
        cfg = Fp8CommConfig(**{old: value})
    assert getattr(cfg, new) == value and cfg == Fp8CommConfig(**{new: value})
    with pytest.warns(DeprecationWarning, match=new):
        assert getattr(cfg, old) == value  # readable too
    with pytest.warns(DeprecationWarning, match=new):
        assert getattr(Fp8CommConfig().replace(**{old: value}), new) == value
    with pytest.raises(TypeError, match=f"both {old}= and {new}="):
        Fp8CommConfig(**{old: value, new: value})


def test_current_names_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = Fp8CommConfig(min_payload_numel=0, power_of_2_wire_scale=False)
        cfg.replace(cast_impl="torch")


def test_enabled_false_is_deprecated_but_still_accepted():
    with pytest.warns(DeprecationWarning, match="fp8_communication=False"):
        cfg = Fp8CommConfig(enabled=False)
    assert not cfg.enabled
    assert "tunes FP8 communication" in Fp8CommConfig.__doc__


def test_docs_table_matches_the_fields():
    text = DOC.read_text().split("\n## Fp8CommConfig\n", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| `(.*?)` \|", text, re.M))
    fields = {f.name: repr(f.default).replace("'", '"')
              for f in dataclasses.fields(Fp8CommConfig)}
    assert rows == fields


def test_comm_report():
    report = CommReport(fp8_param_all_gather=True, fp8_all_gather_modules=["0", "2"])
    report.not_fp8(GRAD_REDUCE, "fp8_reduce_scatter=False")
    assert report.as_dict() == {"fp8_param_all_gather": True,
                                "fp8_all_gather_modules": ["0", "2"], "fp8_grad_reduce": False,
                                "why_not": {"grad_reduce": "fp8_reduce_scatter=False"}}
    assert "grad_reduce stays in the training dtype" in str(report)
    with pytest.raises(ValueError, match="unknown collective"):
        report.not_fp8("reduce_scatter", "old FSDP key")
    with pytest.raises(ValueError, match="why_not keys"):
        CommReport(why_not={"all_gather": "old FSDP key"})
    assert CommReport().why_not == {} and PARAM_ALL_GATHER == "param_all_gather"
    assert torch.float8_e4m3fn == Fp8CommConfig().param_dtype


def test_every_plugin_reports_comm_as_one_type():
    """DDP (one process) fills the same typed CommReport as ZeRO and FSDP."""
    import torch

    from fp8boost.booster import Booster
    from fp8boost.parallel.comm.report import CommReport
    from fp8boost.plugins import TorchDDPPlugin

    import torch.distributed as dist

    try:
        for comm in (True, False):
            plugin = TorchDDPPlugin(fp8_communication=comm)
            model = torch.nn.Linear(16, 16)
            Booster(plugin=plugin, device="cpu").boost(model,
                                                      torch.optim.SGD(model.parameters(), 0.1))
            report = plugin.comm_report
            assert isinstance(report, CommReport)
            assert report.fp8_grad_reduce is comm and not report.fp8_param_all_gather
            assert ("grad_reduce" in report.why_not) is not comm
    finally:  # boost started a one-process group: later tests check that none is left
        if dist.is_initialized():
            dist.destroy_process_group()
