"""Every bench suite by name (``python bench/suite.py --list``), and the lookup that also takes
a former script's name (``run_moe_step_1gpu.sh``, ``moe_step_1gpu``) so old notes still work."""
from __future__ import annotations

from suites import checks, multi_gpu, one_gpu, runs, scale8
from suites.core import Suite, SuiteError

SUITES: dict[str, Suite] = {s.name: s for m in (one_gpu, multi_gpu, runs, scale8, checks)
                            for s in m.SUITES}


def find(name: str) -> Suite:
    """The suite called ``name`` (or the one replacing the script of that name)."""
    if name in SUITES:
        return SUITES[name]
    stem = name.rsplit("/", 1)[-1].removesuffix(".sh").removeprefix("run_")
    for suite in SUITES.values():
        if suite.former == f"run_{stem}.sh":
            return suite
    raise SuiteError(f"unknown suite {name!r}; known suites: {', '.join(sorted(SUITES))}")
