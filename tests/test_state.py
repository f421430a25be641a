"""Process-wide state lives in ``fp8boost._state`` only, and ``_state.reset()`` clears all of it.

The first test reads every module of the package with ``ast`` and fails on a mutable
module-level container outside ``_state.py``: a dict/list/set literal or comprehension, a call
of a mutable container type (``dict()``, ``defaultdict()``, ``weakref.WeakSet()``, ...), a
``functools.lru_cache``/``cache`` (a hidden dict), or a ``global`` statement (a rebound module
variable). Read-only constants are fine: tuples, frozensets, ``MappingProxyType``, loggers,
strings and numbers, and ``__all__``.
"""
from __future__ import annotations

import ast
import gc
import logging
from pathlib import Path

import pytest
import torch

import fp8boost
from fp8boost import _state

PACKAGE = Path(fp8boost.__file__).parent
STATE_FILE = PACKAGE / "_state.py"

MUTABLE_LITERALS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
MUTABLE_CALLS = {"dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "Counter",
                 "deque", "ChainMap", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary"}
CACHING_DECORATORS = {"lru_cache", "cache", "cached_property"}
ALLOWED_NAMES = {"__all__"}


def _name(node: ast.AST) -> str:
    """``f`` of ``f(...)`` or ``mod.f(...)`` (the last attribute), else ''."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _is_mutable(value: ast.AST) -> bool:
    return isinstance(value, MUTABLE_LITERALS) or (
        isinstance(value, ast.Call) and _name(value) in MUTABLE_CALLS)


def _module_level(body: list[ast.stmt]):
    """Statements run at import: the module body and its if/try/with blocks."""
    for stmt in body:
        yield stmt
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(stmt, field, None)
            if isinstance(inner, list) and not isinstance(
                    stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from _module_level(inner)


def mutable_module_state(source: str, rel: str) -> list[str]:
    """``"rel:line name"`` of every module-level mutable container in a module's ``source``."""
    tree = ast.parse(source, filename=rel)
    found = []
    for stmt in _module_level(tree.body):
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        else:
            continue
        names = [ast.unparse(t) for t in targets]
        if _is_mutable(value) and not set(names) <= ALLOWED_NAMES:
            found.append(f"{rel}:{stmt.lineno} {', '.join(names)} = {ast.unparse(value)[:50]}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                if _name(dec) in CACHING_DECORATORS:
                    found.append(f"{rel}:{node.lineno} @{ast.unparse(dec)} {node.name}")
        elif isinstance(node, ast.Global):
            found.append(f"{rel}:{node.lineno} global {', '.join(node.names)}")
    return found


def test_no_mutable_module_state_outside_state_module():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != STATE_FILE
             for hit in mutable_module_state(path.read_text(),
                                             str(path.relative_to(PACKAGE.parent)))]
    assert not found, ("process-wide state belongs in fp8boost/_state.py (a named cache, a "
                       "probe, a setting or a tracked object), or make the constant read-only "
                       "(tuple, frozenset, MappingProxyType):\n  " + "\n  ".join(found))


def test_the_checker_finds_what_it_looks_for():
    sample = ("import functools, logging, weakref\nfrom types import MappingProxyType\n"
              "A = {}\nB: list = []\nC = weakref.WeakSet()\nif True:\n    D = set()\n"
              "E = (1, 2)\nF = frozenset({1})\nG = MappingProxyType({1: 2})\n__all__ = ['A']\n"
              "H = logging.getLogger('x')\n"
              "@functools.lru_cache(maxsize=None)\ndef f():\n    global E\n"
              "class K:\n    def m(self):\n        local = {}\n")
    found = [hit.split(" ", 1)[1].split(" ")[0] for hit in mutable_module_state(sample, "m.py")]
    assert found == ["A", "B", "C", "D", "@functools.lru_cache(maxsize=None)", "global"], found


class _Clearable:
    def __init__(self) -> None:
        self.items = [1]

    def clear(self) -> None:
        self.items.clear()


def _fill_everything() -> list:
    """Put something into every kind of state, through the modules that use it."""
    from fp8boost.fp8 import shared_cast
    from fp8boost.fp8.backends import get_backend
    from fp8boost.fp8.kernels import tuning
    from fp8boost.parallel.comm import _utils as comm_utils
    from fp8boost.parallel.zero import fused_step

    with pytest.warns(UserWarning, match="test warning"):
        _state.warn_once("test-state-warn", "fp8boost: test warning")
    _state.log_once(logging.getLogger("fp8boost.test"), "test-state-log", "test log")
    _state.probe("test-state-probe", lambda: 1)
    get_backend("emulated", torch.device("cpu"))  # fills the "fp8.backends" cache
    src = torch.ones(2)
    shared_cast.store(src, ("k",), "fp8-of-src")
    comm_utils.resolve_config(None)  # the default Fp8CommConfig probe
    master = torch.zeros(4)
    fused_step._next_step(master, {"step": torch.tensor(0.0)})
    cache = tuning.ConfigCache("test-state")
    cache.pick(("k",), [1, 2], lambda cfg: None, bench=False)
    tuning.set_autotune(False)
    own = _Clearable()
    _state.track(own)
    epoch, inits = _state.step_epoch(), _state.init_count()
    return [src, master, cache, own, epoch, inits]


def test_reset_clears_every_container_of_the_state_module():
    from fp8boost.fp8 import shared_cast

    src, master, cache, own, epoch, inits = _fill_everything()
    assert shared_cast.holds_cast() and cache.best and own.items
    assert not _state.setting("fp8.kernels.autotune")
    _state.reset()
    # Every container the module holds is empty (or back to its defaults), whatever its name:
    # a container added to _state.py without a line in reset() fails here.
    # (The counters, the hook and the tracked-object registry are kept; the named caches stay,
    # emptied, and the settings hold their defaults: both checked below.)
    kept = {"_STEP_EPOCH", "_STEP_HOOK", "_INIT_COUNT", "_TRACKED", "_SETTINGS", "_CACHES"}
    for name, value in vars(_state).items():
        if name in kept or name.startswith("__") or not isinstance(value, (dict, list, set)):
            continue
        assert not value, f"_state.{name} not cleared by reset(): {value!r}"
    for name, table in _state._CACHES.items():
        assert not table, f"named cache {name!r} not emptied by reset()"
    assert dict(_state._SETTINGS) == dict(_state.SETTING_DEFAULTS)
    assert not shared_cast.holds_cast() and not cache.best and not own.items
    assert _state.setting("fp8.kernels.autotune") is True
    # The counters are never rewound (an old cache entry or store key would match again).
    assert _state.step_epoch() == epoch and _state.init_count() == inits
    # What warned once warns again after reset.
    assert _state.log_once(logging.getLogger("fp8boost.test"), "test-state-log", "again")
    _state.reset()
    del src, master
    gc.collect()


def test_kept_containers_are_the_documented_ones():
    """The containers reset() keeps are exactly the counters, the hook, the tracked-object
    registry and the settings (restored to defaults): the module docstring names them."""
    tree = ast.parse(STATE_FILE.read_text())
    containers = {ast.unparse(t) for stmt in tree.body if isinstance(stmt, (ast.Assign,
                                                                           ast.AnnAssign))
                  for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
                  if stmt.value is not None and _is_mutable(stmt.value)}
    assert containers == {"_WARNED", "_LOGGED", "_PROBES", "_CACHES", "_SETTINGS", "_TRACKED",
                          "_STEP_EPOCH", "_STEP_HOOK", "_INIT_COUNT"}, containers
    doc = _state.__doc__
    for what in ("step epoch", "process groups", "named cache", "tracked", "setting"):
        assert what in doc, what


def test_warn_once_points_at_the_users_line():
    """A one-time warning is attributed to the first frame outside fp8boost and torch (the
    user's call), so Python prints the user's line under it, not a line of fp8boost's source
    (issue 39: a stray ``self._fp8_backend = get_backend(...)`` under the emulation warning)."""
    import warnings

    from fp8boost.fp8 import Fp8Config
    from fp8boost.fp8.moe.gemm import resolve_backend

    _state.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert resolve_backend(Fp8Config(), torch.device("cpu")) == "emulated"  # warns once
    assert len(seen) == 1 and "emulated grouped GEMM" in str(seen[0].message)
    assert seen[0].filename == __file__, seen[0].filename
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _state.warn_once(("test-explicit-level",), "direct", stacklevel=1)
    assert seen[0].filename.endswith("_state.py")  # an explicit level is kept as given
    _state.reset()
