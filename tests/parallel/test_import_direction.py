"""``fp8boost/parallel/`` imports nothing from the layers above it (DESIGN.md: folders are
layers, arrows point down): not ``plugins``, ``booster``, ``colossal``, ``export`` or
``checkpoint``. Checked statically with ``ast`` (imports inside functions included), so a
lazy import cannot hide an upward arrow. ``parallel/ep`` (expert parallelism, moved out of
``plugins/``) is covered like every other subpackage."""
from __future__ import annotations

import ast
from pathlib import Path

PARALLEL = Path(__file__).resolve().parents[2] / "fp8boost" / "parallel"
ABOVE = ("plugins", "booster", "colossal", "export", "checkpoint")


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``path`` (relative ones resolved)."""
    package = ["fp8boost"] + list(path.relative_to(PARALLEL.parent).parent.parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            out.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
    return out


def test_parallel_imports_point_down():
    assert (PARALLEL / "ep" / "__init__.py").exists()
    bad = [f"{path.relative_to(PARALLEL.parent.parent)}:{line}: {module}"
           for path in sorted(PARALLEL.rglob("*.py")) for line, module in _imports(path)
           if module.split(".")[:2] in (["fp8boost", name] for name in ABOVE)]
    assert not bad, "parallel/ imports a layer above it:\n" + "\n".join(bad)


LOSS = PARALLEL.parent / "loss"


def test_loss_imports_point_down():
    """``fp8boost/loss/`` (the fused lm_head + loss) sits below ``parallel/``, beside ``fp8/``:
    ``parallel/tp`` uses it, so it must import nothing from ``parallel/`` or above (it knows
    distribution only through the process group it is handed)."""
    assert (LOSS / "linear_cross_entropy.py").exists()
    bad = [f"{path.relative_to(PARALLEL.parent.parent)}:{line}: {module}"
           for path in sorted(LOSS.rglob("*.py")) for line, module in _imports(path)
           if module.split(".")[:2] in (["fp8boost", name] for name in ABOVE + ("parallel",))]
    assert not bad, "loss/ imports a layer above it:\n" + "\n".join(bad)
