"""docs/colossal.md ("Coming from Colossal-AI", linked from the README) is true (issue 25, items 1 and 2).

* its ``sed`` line is the whole edit: applied to the Colossal-AI original of
  ``colossal_script.py`` it gives that script back;
* its per-plugin table names every Colossal-AI v0.5.0 argument once, each in fp8boost's
  signature; every "INFO" argument logs one INFO line naming it when given a non-default
  value; every "refused" example raises ``ValueError`` (before any process group).
"""
from __future__ import annotations

import ast
import inspect
import logging
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fp8boost import _state
from fp8boost.colossal.booster import plugin as colossal_plugins

ROOT = Path(__file__).resolve().parents[2]
SECTION = (ROOT / "docs" / "colossal.md").read_text()
COLUMNS = ("same", "mapped", "info", "refused")


def _drop_parentheses(text: str) -> str:
    while re.search(r"\([^()]*\)", text):  # innermost first: "(`CPUOffload(...)`)" nests
        text = re.sub(r"\([^()]*\)", "", text)
    return text


def _table() -> dict[str, dict[str, list[str]]]:
    rows = {}
    for line in SECTION.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`") and cells[0].endswith("Plugin`"):
            rows[cells[0].strip("`")] = {
                # names in backticks; backticks inside "(...)" explain a mapping, not a name
                col: re.findall(r"`([^`]+)`", _drop_parentheses(cell))
                for col, cell in zip(COLUMNS, cells[1:])}
    return rows


TABLE = _table()
# Non-default sample values for INFO arguments whose default is None or not a bool/number.
SAMPLES = {"chunk_config_dict": {}, "chunk_init_device": torch.device("cpu"), "hidden_dim": 64,
           "memstats": object(), "inner_ring_size": 2, "scheduler_nodes": [[]],
           "auto_wrap_policy": (lambda *a, **k: False), "backward_prefetch": "BACKWARD_PRE",
           "make_vocab_size_divisible_by": 128, "sync_module_states": True,
           # MoeHybridParallelPlugin's INFO arguments (pipeline options at pp_size=1, the mode
           # without sequence parallelism)
           "num_microbatches": 2, "microbatch_size": 2, "pp_style": "interleaved",
           "num_layers_per_stage": [1, 1], "sequence_parallelism_mode": "all_to_all"}
NEEDS = {"hysteresis": {"precision": "fp16"}, "parallel_output": {"tp_size": 2},
         "sequence_parallelism_mode": {"tp_size": 2, "enable_sequence_parallelism": True}}
# MoeHybridParallelPlugin refuses sequence parallelism: its mode is INFO-ignored without it.
NEEDS_OF = {"MoeHybridParallelPlugin": {"sequence_parallelism_mode": {}}}


def _needs(plugin: str, name: str) -> dict:
    return NEEDS_OF.get(plugin, {}).get(name, NEEDS.get(name, {}))


def test_sed_line_is_the_whole_edit(tmp_path):
    (sed,) = re.findall(r"```bash colossal-edit\n(.*?)\n```", SECTION, re.S)
    script = (ROOT / "tests/colossal/colossal_script.py").read_text()
    original = script.replace("import fp8boost.colossal as colossalai", "import colossalai") \
        .replace("from fp8boost.colossal", "from colossalai")
    tree = ast.parse(original)
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "colossalai" in imported and not any(m.startswith("fp8boost") for m in imported)
    train = tmp_path / "train.py"
    train.write_text(original)
    subprocess.run(["bash", "-c", sed], cwd=tmp_path, check=True)
    assert train.read_text() == script


def test_table_names_every_colossal_argument_once():
    assert sorted(TABLE) == sorted(colossal_plugins.ORDERS)
    for plugin, cols in TABLE.items():
        names = [n.split("=")[0] for col in COLUMNS for n in cols[col]
                 if re.fullmatch(r"[a-z_0-9]+(=.*)?", n)]
        # a name may appear in "refused" as an example value besides its own column
        listed = [n for col in ("same", "mapped", "info") for n in cols[col]
                  if re.fullmatch(r"[a-z_0-9]+", n)]
        assert len(listed) == len(set(listed)), (plugin, listed)
        assert set(names) == set(colossal_plugins.ORDERS[plugin]), (
            plugin, set(colossal_plugins.ORDERS[plugin]) ^ set(names))
        params = inspect.signature(getattr(colossal_plugins, plugin)).parameters
        assert set(names) <= set(params)


def _sample(name: str, default):
    if name in SAMPLES:
        return SAMPLES[name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2 if 0 < default <= 1 else default * 2 + 1
    raise AssertionError(f"no sample value for {name}={default!r}: add one to SAMPLES")


@pytest.mark.parametrize("plugin", sorted(TABLE))
def test_info_arguments_log_one_line_naming_them(plugin, caplog):
    cls = getattr(colossal_plugins, plugin)
    params = inspect.signature(cls).parameters
    for name in [n for n in TABLE[plugin]["info"] if re.fullmatch(r"[a-z_0-9]+", n)]:
        _state.reset()
        caplog.clear()
        value = _sample(name, params[name].default)
        with caplog.at_level(logging.INFO, logger="fp8boost"):
            cls(**{**_needs(plugin, name), name: value})
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO
                 and name in r.getMessage()]
        assert len(lines) == 1, (plugin, name, value, [r.getMessage() for r in caplog.records])
    _state.reset()
    assert not dist.is_initialized()


@pytest.mark.parametrize("plugin", sorted(TABLE))
def test_refused_examples_raise_value_error(plugin):
    cls = getattr(colossal_plugins, plugin)
    examples = [n for n in TABLE[plugin]["refused"] if "=" in n]
    assert examples or plugin == "TorchDDPPlugin"
    for example in examples:
        name, text = example.split("=", 1)
        value = [nn.Linear(1, 1)] if text == "[...]" else _value(text)
        with pytest.raises(ValueError):
            cls(**{**_needs(plugin, name), name: value})
    assert not dist.is_initialized()


def _value(text: str):
    if text in ("NO_SHARD", "HYBRID_SHARD"):
        from torch.distributed.fsdp import ShardingStrategy
        return getattr(ShardingStrategy, text)
    return ast.literal_eval(text)
