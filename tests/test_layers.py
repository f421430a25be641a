"""The package's folders are layers and its imports point down (DESIGN.md "Layers"), with no
import cycle between modules.

Checked statically with ``ast`` over every module of ``fp8boost/``, imports inside functions
included, so a lazy import cannot hide an upward arrow or a circle. Only imports under
``if TYPE_CHECKING:`` (never executed) are left out of the cycle check; they still count for
the layer order. ``from package import name`` is an import of the submodule ``package.name``
where that is a module, else of the package.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fp8boost"
# Upper layers first; a module may import its own layer and the layers after it. Modules
# directly under fp8boost/ (_state, hf_model, compile, ...) and fp8boost/data are shared
# utilities any layer may use; they are checked for cycles only.
LAYERS = ("colossal", "booster", "export", "plugins", "parallel", "loss", "fp8")
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
    assert "fp8boost.fp8.moe.experts" in graph["fp8boost.parallel.comm.expert_gather"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert RANK["plugins"] > RANK["parallel"] > RANK["fp8"]
