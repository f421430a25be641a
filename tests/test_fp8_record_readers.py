"""FP8-ness is decided once (issue 38 item 5): code outside ``fp8boost/fp8/`` reads the
conversion's record (``fp8boost.fp8.record``: ``fp8_entry``, ``fp8_record``,
``recorded_linear``, ...) and never asks again whether a module is FP8.

Checked statically with ``ast`` over every module of ``fp8boost/`` outside ``fp8/``: a call of
one of the probing helpers (:data:`PROBES`, by name or as an attribute) or an ``isinstance`` /
``issubclass`` against an FP8 module class (:data:`FP8_CLASSES`) fails the test. The helpers
stay public for users and for ``fp8/`` itself. :data:`ALLOWED` lists the exceptions, each with
its reason; it is empty today.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fp8boost"

PROBES = frozenset({"is_fp8_layer", "fp8_layers", "is_granular", "is_fp8_experts",
                    "fp8_experts"})
"""Helpers that decide FP8-ness from a module's type or config instead of the record."""

FP8_CLASSES = frozenset({"Fp8Linear", "Fp8Conv1D", "Fp8Experts"})

ALLOWED: dict[tuple[str, str], str] = {}
"""``{(path relative to fp8boost/, probe name): why}``: none needed so far."""


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def probes_in(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every probe in ``source`` (one module's text)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        if name in PROBES:
            found.append((node.lineno, name))
        elif name in ("isinstance", "issubclass") and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            found += [(node.lineno, f"{name}(..., {_name(c)})") for c in classes
                      if _name(c) in FP8_CLASSES]
    return found


def current_probes() -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("fp8/"):
            continue
        for line, what in probes_in(path.read_text()):
            key = what.split("(")[0] if what.startswith(("isinstance", "issubclass")) else what
            if (rel, key) not in ALLOWED:
                out.append(f"fp8boost/{rel}:{line}: {what}")
    return out


def test_rule_finds_probes_and_leaves_record_reads():
    src = ("from fp8boost.fp8 import is_fp8_layer, fp8_record\n"
           "import fp8boost.fp8 as f\n"
           "a = is_fp8_layer(m)\n"                      # probe
           "b = f.fp8_layers(model)\n"                  # probe, as an attribute
           "c = isinstance(m, (nn.Linear, Fp8Linear))\n"  # probe, by class
           "d = fp8_record(model)\n"                    # fine: the record
           "e = opt.bind_fp8_layers(model)\n")          # fine: another name
    assert probes_in(src) == [(3, "is_fp8_layer"), (4, "fp8_layers"),
                              (5, "isinstance(..., Fp8Linear)")]


def test_no_code_outside_fp8_probes_modules_for_fp8():
    bad = current_probes()
    assert not bad, ("code outside fp8boost/fp8/ asks again whether a module is FP8; read the "
                     "conversion's record instead (fp8boost.fp8.record: fp8_entry, "
                     "recorded_linear, recorded_linears, recorded_experts, fp8_record):\n"
                     + "\n".join(bad))


def test_allowed_exceptions_are_still_needed_and_explained():
    for (rel, name), why in ALLOWED.items():
        assert why.strip(), (rel, name)
        assert any(w.split("(")[0] == name for _, w in probes_in((ROOT / rel).read_text())), \
            f"fp8boost/{rel} no longer calls {name}: drop it from ALLOWED"
