"""Issue 13: docs/PLUGINS.md documents every plugin argument with its real default, and the
README links it. The tables are compared with the signatures, so they cannot drift."""
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from fp8boost.fp8 import Fp8Config
from fp8boost.plugins import GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin, \
    MoeHybridParallelPlugin, TorchDDPPlugin, TorchFSDPPlugin

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "PLUGINS.md"


def _table(section: str) -> dict[str, str]:
    """{argument: default as written} of the table under ``## section``."""
    text = DOC.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `(.*?)` \|", text, re.M)
    return dict(rows)


def _written(value) -> str:
    return repr(value).replace("'", '"')


@pytest.mark.parametrize("cls", [TorchDDPPlugin, LowLevelZeroPlugin, GeminiPlugin,
                                 TorchFSDPPlugin, HybridParallelPlugin, MoeHybridParallelPlugin])
def test_plugin_table_matches_the_signature(cls):
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    assert _table(cls.__name__) == {p.name: _written(p.default) for p in params}


def test_fp8config_table_matches_the_fields():
    fields = {f.name: _written(f.default) for f in dataclasses.fields(Fp8Config)}
    assert _table("Fp8Config") == fields


def test_readme_links_the_plugin_docs_and_the_environment_report():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/PLUGINS.md)" in readme and "python -m fp8boost" in readme
