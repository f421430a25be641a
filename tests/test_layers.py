"""The package's folders are layers and its imports point down (DESIGN.md "Layers"), with no
import cycle between modules.

Checked statically with ``ast`` over every module of ``fp8boost/``, imports inside functions
included, so a lazy import cannot hide an upward arrow or a circle. Only imports under
``if TYPE_CHECKING:`` (never executed) are left out of the cycle check; they still count for
the layer order. ``from package import name`` is an import of the submodule ``package.name``
where that is a module, else of the package.

An import inside a function says why it is not at module level: a comment on its line, or on
the line just above it (or above the run of imports it belongs to), e.g. ``# lazy: triton is
optional``. Everything else is imported at the top of its module.
"""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fp8boost"
# Upper layers first; a module may import its own layer and the layers after it. Modules
# directly under fp8boost/ (_state, hf_model, compile, ...) and fp8boost/data are shared
# utilities any layer may use; they are checked for cycles only.
LAYERS = ("colossal", "booster", "export", "plugins", "checkpoint_io", "parallel", "loss",
          "norm", "fp8")
RANK = {name: len(LAYERS) - i for i, name in enumerate(LAYERS)}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in MODULES:
            return ".".join(parts[:i])
    return None


def _type_checking_nodes(tree: ast.AST) -> set:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip |= set(ast.walk(child))
    return skip


def _imports(module: str, path: Path) -> list[tuple[int, str, bool]]:
    """``(line, imported fp8boost module, type-checking only)`` for every import."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_nodes(tree)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] if node.level else [])
            mod = ".".join(p for p in (base, node.module or "") if p)
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                targets.append(sub if sub in MODULES else mod)
        for target in targets:
            resolved = _resolve(target)
            if resolved is not None and resolved != module:
                out.append((node.lineno, resolved, node in skip))
    return out


def _layer(module: str):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


def test_imports_point_down():
    bad = []
    for module, path in sorted(MODULES.items()):
        src = _layer(module)
        for line, target, _ in _imports(module, path):
            dst = _layer(target)
            if src and dst and RANK[dst] > RANK[src]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {src} -> {dst} ({target})")
    assert not bad, "imports running back up a layer:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles():
    graph = {m: {t for _, t, type_only in _imports(m, p) if not type_only}
             for m, p in MODULES.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (modules that import each other, directly or not):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_what_it_must():
    """The checks cannot pass vacuously: the graph holds known arrows, and a made-up cycle and
    a made-up upward import are found."""
    graph = {m: {t for _, t, _ in _imports(m, p)} for m, p in MODULES.items()}
    assert "fp8boost.fp8.config" in graph["fp8boost.plugins.precision"]
    assert "fp8boost.fp8.record" in graph["fp8boost.parallel.comm.expert_gather"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "fp8boost.checkpoint_io.moe" in graph["fp8boost.plugins.moe_hybrid_parallel_plugin"]
    assert "fp8boost.parallel.ep" in graph["fp8boost.checkpoint_io.moe"]
    assert RANK["plugins"] > RANK["checkpoint_io"] > RANK["parallel"] > RANK["fp8"]


def _unexplained_function_imports(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of each import inside a function with no reason comment: none on its
    first line, none on the line just above it or above the run of imports it ends."""
    tree = ast.parse(source)
    comment_only, with_comment = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            (comment_only if tok.line[:tok.start[1]].strip() == "" else with_comment).add(line)
    explained, out = set(), []

    def visit(node, in_function: bool) -> None:
        for field in ("body", "orelse", "finalbody", "handlers"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list):
                continue
            prev = None
            for stmt in stmts:
                if in_function and isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    ok = (stmt.lineno in with_comment or stmt.lineno - 1 in comment_only
                          or (isinstance(prev, (ast.Import, ast.ImportFrom))
                              and id(prev) in explained and stmt.lineno == prev.end_lineno + 1))
                    if ok:
                        explained.add(id(stmt))
                    else:
                        names = [a.name for a in stmt.names] if isinstance(stmt, ast.Import) \
                            else ["." * stmt.level + (stmt.module or "")]
                        out.append((stmt.lineno, ", ".join(names)))
                prev = stmt
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out


def test_function_level_imports_say_why():
    bad = []
    for module, path in sorted(MODULES.items()):
        rel = path.relative_to(ROOT.parent).as_posix()
        for line, name in _unexplained_function_imports(path.read_text(encoding="utf-8")):
            bad.append(f"{rel}:{line}: import {name}")
    assert not bad, ("imports inside functions without a reason comment (hoist them to module "
                     "level, or say why on the line or the line above, e.g. '# lazy: triton "
                     "is optional'):\n" + "\n".join(bad))


def test_the_reason_check_sees_what_it_must():
    src = (
        "import os\n"
        "def f():\n"
        "    import json\n"                                 # 3: no reason
        "    import re  # lazy: a reason on the line\n"
        "    # lazy: a reason above a run of two\n"
        "    import math\n"
        "    from typing import Any\n"
        "    x = '# not a comment'\n"
        "    import sys\n"                                  # 9: a string is not a comment
        "    if x:\n"
        "        # lazy: reason\n"
        "        from . import y\n"
        "    try:\n"
        "        from .z import w\n"                        # 14: try: gives no reason
        "    except ImportError:\n"
        "        pass\n"
        "    g = lambda: __import__('a')\n"
        "class C:\n"
        "    import abc\n"                                  # class body: module-level
        "    def m(self):\n"
        "        from .k import v\n")                       # 21
    assert _unexplained_function_imports(src) == [(3, "json"), (9, "sys"), (14, ".z"),
                                                   (21, ".k")]
