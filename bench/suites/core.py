"""What a bench suite is: named steps, each a command with its time limit, environment and the
part of its output worth printing.

A suite is data wherever the former ``bench/run_*.sh`` script was a list of commands; a small
``build`` function stands in where the script had logic (runs chosen by name, a summary
computed from the logs). Templates (``{OUT}``, ``{TAG}``, a positional ``{part}``...) are filled
from the suite's knobs (environment variables, with the script's defaults) and positional
arguments before anything runs, so ``--dry-run`` prints exactly what would run.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import string
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence, Union

# The NVLink multicast switches every multi-GPU script exported (the device notes: NVLS off).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
# Knobs whose value is several words (bash expanded them unquoted, so they split there too).
SPLIT_KNOBS = frozenset({"GEMM_ARGS", "SMOKE_EXTRA", "FP8"})


@dataclass(frozen=True)
class Step:
    """One command of a suite.

    Attributes:
        cmd: The command line, a template over the suite's knobs and arguments; empty for a
            step that is only Python logic (``after``).
        timeout: Seconds (or a template such as ``"{RUN_TIMEOUT}"``) for ``timeout(1)``, which
            the command runs under as in the scripts; ``None`` for no limit.
        env: Variables for this command only (``CUDA_VISIBLE_DEVICES=0``, ``NCCL_P2P_DISABLE``).
        drop: Regex of output lines to leave out (the scripts' ``grep -v``).
        keep: Regex of output lines to keep (their ``grep -E``).
        tail: Print only the last lines (their ``| tail -N``); 0 prints every kept line.
        head: Keep only the first lines (``| head -N``); 0 keeps all.
        log: A file that receives the kept output (their ``> log`` or ``| tee log``).
        append: Add to ``log`` instead of replacing it (``tee -a``).
        show: ``False`` when the output only goes to ``log`` (``> log 2>&1``).
        check: ``False`` for information (nvidia-smi, versions): its failure fails nothing.
        count: Print each distinct line once with its count (``| sort | uniq -c``).
        background: Start it and go on; the next foreground step waits for it (``&`` + ``wait``).
        after: Logic run after it, with the suite context and its exit status.
        note: What ``after`` does, for ``--dry-run``.
    """

    cmd: str
    timeout: Union[int, str, None] = None
    env: Mapping[str, str] = field(default_factory=dict)
    drop: str = ""
    keep: str = ""
    tail: int = 0
    head: int = 0
    log: str = ""
    append: bool = False
    show: bool = True
    check: bool = True
    count: bool = False
    background: bool = False
    after: Optional[Callable[["Ctx", int], None]] = None
    note: str = ""

    def argv(self) -> list[str]:
        """The resolved command as ``timeout N cmd...`` (the scripts' form, exit 124 on expiry)."""
        words = shlex.split(self.cmd)
        return (["timeout", str(self.timeout)] if self.timeout is not None else []) + words


# A part lists steps, or names other parts to run in order ("all" = "tests", "table").
PartItem = Union[Step, str]


@dataclass(frozen=True)
class Suite:
    """A named bench suite: what ``python bench/suite.py NAME`` runs.

    Attributes:
        name: The suite's name on the command line.
        former: The ``bench/run_*.sh`` script it replaces.
        purpose: One line for ``--list``.
        gpus: GPUs it needs, as ``--list`` prints it.
        time: Typical device time.
        knobs: Environment variables it reads, with their defaults (``OUT`` is always one).
        args: Positional arguments ``(name, default)``; with ``parts`` the first picks the part.
        parts: Part name -> its steps; a suite without sub-modes has the one part ``""``.
        build: Logic that returns the steps instead (runs chosen by name, summaries).
        env: Variables exported for every command.
        header: Information steps printed first (the GPU, library versions).
        torchao: Install torchao from a carried ``.whl/`` first (the GPU image has no internet).
        usage: Extra help for ``--list NAME`` (the parts and knobs, from the script's header).
    """

    name: str
    former: str
    purpose: str
    gpus: str
    time: str
    knobs: Mapping[str, str] = field(default_factory=dict)
    args: Sequence[tuple[str, str]] = ()
    parts: Mapping[str, Sequence[PartItem]] = field(default_factory=dict)
    build: Optional[Callable[["Ctx"], list[Step]]] = None
    env: Mapping[str, str] = field(default_factory=lambda: {"PYTHONUNBUFFERED": "1"})
    header: Sequence[Step] = ()
    torchao: bool = False
    usage: str = ""


@dataclass
class Ctx:
    """One invocation: the suite, its resolved knobs and arguments, and where it runs."""

    suite: Suite
    values: dict[str, str]
    root: str
    dry_run: bool = False

    @property
    def out(self) -> str:
        return self.values["OUT"]

    def fmt(self, template: str) -> str:
        """Fill a command template; a value is shell-quoted unless it is a several-word knob."""
        fields = {k: (v if k in SPLIT_KNOBS else shlex.quote(v)) for k, v in self.values.items()}
        return string.Formatter().vformat(template, (), fields)

    def raw(self, template: str) -> str:
        """Fill a template that is not a command line (a path, a variable's value)."""
        return string.Formatter().vformat(template, (), self.values)

    def resolve(self, step: Step) -> Step:
        """The step with every template filled (what runs and what --dry-run prints)."""
        timeout = step.timeout
        if isinstance(timeout, str):
            timeout = int(self.raw(timeout))
        return dataclasses.replace(
            step, cmd=self.fmt(step.cmd), timeout=timeout, log=self.raw(step.log),
            env={k: self.raw(v) for k, v in step.env.items()}, note=self.raw(step.note))

    def steps(self) -> list[Step]:
        """The suite's steps for this invocation, templates filled."""
        if self.suite.build is not None:
            raw = self.suite.build(self)
        else:
            raw = expand(self.suite, self.part())
        return [self.resolve(s) for s in (*self.suite.header, *raw)]

    def part(self) -> str:
        return self.values[self.suite.args[0][0]] if self.suite.args and self.suite.parts \
            and "" not in self.suite.parts else ""


class SuiteError(ValueError):
    """A wrong suite name, part or argument: reported in one line, without a traceback."""


def expand(suite: Suite, part: str) -> list[Step]:
    """The steps of ``part``, with parts that name other parts expanded in order."""
    if part not in suite.parts:
        raise SuiteError(f"{suite.name}: unknown part {part!r}; parts: "
                         f"{', '.join(p for p in suite.parts if p)}")
    steps: list[Step] = []
    for item in suite.parts[part]:
        steps += expand(suite, item) if isinstance(item, str) else [item]
    return steps


def make_ctx(suite: Suite, argv: Sequence[str], root: str, dry_run: bool = False,
             environ: Optional[Mapping[str, str]] = None) -> Ctx:
    """Resolve a suite's knobs (environment, else the defaults) and positional arguments."""
    environ = os.environ if environ is None else environ
    if len(argv) > len(suite.args):
        raise SuiteError(f"{suite.name}: too many arguments {list(argv)}; takes "
                         f"{' '.join(f'[{n}]' for n, _ in suite.args) or 'none'}")
    values = {"OUT": environ.get("OUT") or "bench/results", "ROOT": root}
    values.update({k: environ.get(k, d) for k, d in suite.knobs.items()})
    values.update({n: d for n, d in suite.args})
    values.update({n: v for (n, _), v in zip(suite.args, argv)})
    return Ctx(suite, values, root, dry_run)
