"""No module of fp8boost/ reads another module's private (``_name``) names (issue 24, item 5).

The rule, checked statically with ``ast`` over every ``fp8boost/**/*.py``:

A *private name* is an identifier with one or more leading underscores that is not a dunder
(``__x__``). Module A defines

* a private *module name* by binding it at module level (``def``/``class``/assignment, also
  inside a top-level ``if``/``try``);
* a private *attribute* in a class body (method, class attribute, dataclass field), as
  ``self._x = ...`` / ``cls._x = ...``, or, for attributes no class defines, by attaching
  it to another object (``obj._x = ...``, ``setattr(obj, "_x", ...)``): every module that
  attaches it defines it.

A *violation* is a use of a private name in module B that belongs to another module:

* ``from m import _x`` where ``m`` is an fp8boost module other than B and ``_x`` is not a
  submodule (private modules such as ``fp8boost._state`` may be imported; their public
  functions are public API of the package);
* ``mod._x`` where ``mod`` (a name or dotted chain) is bound to an fp8boost module other
  than B (``import ... as``, ``from pkg import mod``), unless ``_x`` is a submodule;
* ``obj._x``, ``getattr/hasattr/setattr/delattr(obj, "_x")`` on any other receiver, when
  ``_x`` is a private attribute defined in some module but not in B. This includes
  ``self._x`` in a subclass whose private ``_x`` comes from a base class in another module;
  ``self._x``/``cls._x`` inside the module that defines ``_x`` is fine.

Not ours, never reported: receivers rooted at an import from outside fp8boost (``torch._C``,
``torch._dynamo``, ``dist._functional_collectives``) and private names fp8boost never defines
(``tensor._local_tensor``, ``module._forward_hooks``: library internals).

Because the receiver's type is unknown, a name defined in both A and B is accepted in B (a
possible miss, never a false alarm).

Run ``python tests/test_private_names.py`` for the current list.
"""
from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict
from dataclasses import dataclass

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fp8boost")
PACKAGE = "fp8boost"
ATTR_FUNCS = {"getattr", "hasattr", "setattr", "delattr"}


@dataclass(frozen=True)
class Violation:
    path: str      # relative to the repository root
    line: int
    module: str    # the module that reads the name
    name: str
    owners: tuple[str, ...]  # the modules that define it
    text: str

    def __str__(self) -> str:
        return (f"{self.path}:{self.line}: {self.name} in `{self.text}` "
                f"(defined in {', '.join(self.owners)})")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_sources(root: str = ROOT) -> dict[str, tuple[str, str]]:
    """``{dotted module name: (path relative to the repo, source)}`` for every file of ``root``."""
    base = os.path.dirname(root)
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            rel = os.path.relpath(path, base)
            parts = rel[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            with open(path, encoding="utf-8") as fh:
                out[".".join(parts)] = (rel, fh.read())
    return out


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute module of ``from <level dots><target> import ...`` inside ``module``."""
    if level == 0:
        return target or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[:len(parts) - (level - 1)] if level > 1 else parts
    return ".".join(parts + ([target] if target else []))


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything but a chain of names."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]


def _attr_uses(tree: ast.AST):
    """``(receiver node, attribute name, is_store, lineno)`` for ``x._n`` and ``getattr(x, "_n")``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            yield node.value, node.attr, isinstance(node.ctx, (ast.Store, ast.Del)), node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ATTR_FUNCS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _is_private(node.args[1].value)):
            yield node.args[0], node.args[1].value, node.func.id in ("setattr", "delattr"), \
                node.lineno


def _is_self(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super")


class _Module:
    def __init__(self, name: str, path: str, source: str, is_package: bool):
        self.name, self.path, self.is_package = name, path, is_package
        self.tree = ast.parse(source, filename=path)
        self.lines = source.splitlines()
        self.imports: dict[str, str] = {}   # local name -> absolute module/object it names
        self.top: set[str] = set()          # private module-level names
        self.defined: set[str] = set()      # private attributes of its classes
        self.attached: set[str] = set()     # private attributes attached to other objects
        self._collect()

    def _bind_targets(self, targets, into: set[str]) -> None:
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name) and _is_private(n.id):
                    into.add(n.id)

    def _scan_block(self, body, in_class: bool) -> None:
        """Module-level and class-body bindings (recursing into if/try/with, not functions)."""
        into = self.defined if in_class else self.top
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if _is_private(node.name):
                    into.add(node.name)
                if isinstance(node, ast.ClassDef):
                    self._scan_block(node.body, in_class=True)
            elif isinstance(node, ast.Assign):
                self._bind_targets(node.targets, into)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                self._bind_targets([node.target], into)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for field in ("body", "orelse", "finalbody"):
                    self._scan_block(getattr(node, field, []) or [], in_class)
                for h in getattr(node, "handlers", []):
                    self._scan_block(h.body, in_class)

    def _collect(self) -> None:
        self._scan_block(self.tree.body, in_class=False)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef):  # nested classes (inside functions) too
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                            and _is_private(item.name):
                        self.defined.add(item.name)
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.imports[a.asname] = a.name
                    else:
                        self.imports[a.name.split(".")[0]] = a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(self.name, self.is_package, node.level, node.module)
                for a in node.names:
                    self.imports[a.asname or a.name] = f"{base}.{a.name}"
        for receiver, name, store, _line in _attr_uses(self.tree):
            if store and _is_self(receiver):
                self.defined.add(name)
            elif store:
                self.attached.add(name)


def find_violations(sources: dict[str, tuple[str, str]]) -> list[Violation]:
    """Apply the module docstring's rule to ``{module: (path, source)}``."""
    modules = {name: _Module(name, path, src, path.endswith("__init__.py"))
               for name, (path, src) in sources.items()}
    owners: dict[str, set[str]] = defaultdict(set)
    for m in modules.values():
        for n in m.defined:
            owners[n].add(m.name)
    for m in modules.values():
        for n in m.attached:
            if not any(n in o.defined for o in modules.values()):
                owners[n].add(m.name)

    def ours(absolute: str) -> bool:
        return absolute == PACKAGE or absolute.startswith(PACKAGE + ".")

    out: list[Violation] = []
    for m in modules.values():
        def report(line: int, name: str, owned_by) -> None:
            text = m.lines[line - 1].strip() if line <= len(m.lines) else name
            out.append(Violation(m.path, line, m.name, name, tuple(sorted(owned_by)), text))

        for node in ast.walk(m.tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(m.name, m.is_package, node.level, node.module)
                if not ours(base) or base == m.name:
                    continue
                for a in node.names:
                    if _is_private(a.name) and f"{base}.{a.name}" not in modules:
                        report(node.lineno, a.name, [base])
        for receiver, name, _store, line in _attr_uses(m.tree):
            root = _root_name(receiver)
            bound = m.imports.get(root) if root else None
            if bound is not None and not ours(bound):
                continue  # torch._C, dist._functional_collectives: not ours
            chain = _dotted(receiver) if bound is not None else None
            target = ".".join([bound] + chain[1:]) if chain else None
            if target in modules:  # a module (alias): exact
                if target != m.name and f"{target}.{name}" not in modules:
                    report(line, name, [target])
                continue
            if name in owners and m.name not in owners[name]:
                report(line, name, owners[name])
    return sorted(out, key=lambda v: (v.path, v.line, v.name))


def current_violations() -> list[Violation]:
    return find_violations(module_sources())


# --------------------------------------------------------------------------------- the rule
def _check(files: dict[str, str]) -> list[tuple[str, str]]:
    sources = {}
    for name, src in files.items():
        pkg = name.endswith(".__init__")
        mod = name[:-len(".__init__")] if pkg else name
        path = name.replace(".", "/") + ".py"
        sources[mod] = (path, src)
    return [(v.module, v.name) for v in find_violations(sources)]


def test_rule_reports_cross_module_private_names():
    files = {
        "fp8boost.__init__": "",
        "fp8boost._state": "def _hidden(): pass\ndef public(): pass\n",
        "fp8boost.a": ("import torch\n_X = 1\ndef _f(): pass\nclass Base:\n"
                       "    def __init__(self): self._v = 1\n    def _m(self): return self._v\n"),
        "fp8boost.b": (
            "import torch\nimport torch.distributed as dist\n"
            "from fp8boost import a as amod\nfrom fp8boost import _state\n"
            "from fp8boost.a import _f, Base\n"          # violation: _f
            "class Sub(Base):\n"
            "    def g(self): return self._m()\n"        # violation: base's private method
            "def h(obj):\n"
            "    amod._X\n"                               # violation: module alias
            "    obj._v\n"                                # violation: attribute defined in a
            "    getattr(obj, '_m')\n"                    # violation: through getattr
            "    _state.public()\n"                       # fine: private module, public name
            "    torch._C, dist._functional_collectives\n"   # fine: not ours
            "    obj._local_tensor\n"                     # fine: fp8boost never defines it
            "    obj.__class__\n"                         # fine: dunder
        ),
        "fp8boost.c": ("def _m(): pass\nclass C:\n    def __init__(self): self._own = 0\n"
                       "    def k(self, other): return self._own + other._own + _m()\n"),
    }
    found = _check(files)
    assert sorted(found) == sorted([("fp8boost.b", "_f"), ("fp8boost.b", "_m"),
                                    ("fp8boost.b", "_X"), ("fp8boost.b", "_v"),
                                    ("fp8boost.b", "_m")]), found


def test_rule_attached_names_belong_to_the_attaching_module():
    files = {
        "fp8boost.__init__": "",
        "fp8boost.a": "def attach(model): model._opts = []\n",
        "fp8boost.b": "def read(model): return model._opts\n",
        "fp8boost.c": ("import fp8boost.a\nfrom . import a\n"
                       "def f(t): return a._nothing, fp8boost.a._version, t._version\n"),
        "fp8boost.d": "def _version(): pass\n",  # a module name, not tensor._version
    }
    assert sorted(_check(files)) == [("fp8boost.b", "_opts"), ("fp8boost.c", "_nothing"),
                                     ("fp8boost.c", "_version")]


# ------------------------------------------------------------------------------ the codebase
def test_no_module_reads_another_modules_private_names():
    found = current_violations()
    assert not found, f"{len(found)} cross-module private names:\n" + "\n".join(map(str, found))


if __name__ == "__main__":
    found = current_violations()
    by_dir: dict[str, int] = defaultdict(int)
    for v in found:
        print(v)
        by_dir[os.path.dirname(v.path)] += 1
    print(f"\n{len(found)} violations", file=sys.stderr)
    for d, n in sorted(by_dir.items()):
        print(f"  {n:4d}  {d}", file=sys.stderr)
