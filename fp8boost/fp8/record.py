"""The conversion's record: which modules of a model are FP8, decided once by ``convert_to_fp8``.

Every part of fp8boost above ``fp8/`` (the engines in ``parallel/``, ``loss/``, the plugins)
reads this record instead of asking ``isinstance`` again (issue 38 item 5): conversion decides,
downstream code only reads.

Where it lives: ``convert_to_fp8`` sets one frozen :class:`Fp8Entry` on every module it leaves
in FP8 (an instance attribute, :data:`ENTRY_ATTR`), and :func:`fp8_record` gathers those
entries into one :class:`Fp8Record` keyed by the modules' qualified names *as they are when it
is asked*. The entries are keyed by module identity, not by name, because the engines move
modules after conversion: pipeline splitting re-roots layers under stage modules (names change),
expert parallelism replaces an experts module by an ``EpExperts`` holding the FP8 experts
outside its submodules, and FSDP2's ``fully_shard`` swaps a module's class in place. An
attribute in the module's own ``__dict__`` survives all of these, ``copy.deepcopy`` and
pickling; a name-keyed table on the root would go stale, and a ``WeakKeyDictionary`` would be
process-wide state (only ``_state.py`` may hold any) that a deepcopy does not carry over.

A model never converted has an empty record. An FP8 module built by hand (``Fp8Linear(...)``,
``Fp8Linear.from_linear``) carries no entry; :func:`fp8_entry` then answers what conversion
would have recorded for it (from its type), so a missing entry is never a wrong answer and
never an error.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from .config import GRANULAR_RECIPES
from .linear import Fp8Linear
from .moe.experts import Fp8Experts

__all__ = ["ENTRY_ATTR", "LINEAR", "EXPERTS", "Fp8Entry", "Fp8Record", "fp8_entry",
           "fp8_record", "record_module", "recorded_linear", "recorded_experts",
           "recorded_linears", "recorded_experts_modules"]

ENTRY_ATTR = "fp8boost_entry"
"""The instance attribute conversion sets on each FP8 module (an :class:`Fp8Entry`)."""

LINEAR = "linear"
EXPERTS = "experts"


@dataclass(frozen=True)
class Fp8Entry:
    """What conversion decided for one module: an FP8 linear layer or FP8 experts, and its
    recipe (``tensorwise``, ``delayed``, ``rowwise``, ``blockwise``).

    Example:
        >>> Fp8Entry(LINEAR, "blockwise").granular
        True
    """

    kind: str
    recipe: str

    @property
    def granular(self) -> bool:
        """Rowwise or blockwise: scales per row / tile / block rather than per tensor."""
        return self.recipe in GRANULAR_RECIPES


@dataclass(frozen=True)
class Fp8Record:
    """Every FP8 module of a model by qualified name: ``linears`` maps each FP8 linear layer
    to its recipe, ``experts`` lists the FP8 expert modules (both in ``named_modules()``
    order; a shared module once, under its first name). Empty for a model never converted.

    Example:
        >>> import torch
        >>> from fp8boost.fp8 import Fp8Config, convert_to_fp8
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
        >>> _ = convert_to_fp8(model, Fp8Config(backend="emulated", min_numel=0))
        >>> fp8_record(model)
        Fp8Record(linears={'0': 'tensorwise'}, experts=())
    """

    linears: dict = field(default_factory=dict)
    experts: tuple = ()

    @property
    def granular(self) -> tuple:
        """Names of the rowwise/blockwise linear layers."""
        return tuple(n for n, r in self.linears.items() if r in GRANULAR_RECIPES)

    def __bool__(self) -> bool:
        return bool(self.linears or self.experts)


def _derived(module: nn.Module) -> Optional[Fp8Entry]:
    """What conversion records for ``module``, from its type (hand-built FP8 modules)."""
    if isinstance(module, (Fp8Linear, Fp8Experts)):
        return Fp8Entry(LINEAR if isinstance(module, Fp8Linear) else EXPERTS,
                        module.fp8_config.recipe)
    return None


def record_module(module: nn.Module) -> Fp8Entry:
    """Record ``module`` (an FP8 layer or FP8 experts) as FP8; conversion calls this once.

    Raises:
        TypeError: ``module`` is neither an ``Fp8Linear`` nor ``Fp8Experts``.

    Example:
        >>> from fp8boost.fp8 import Fp8Config, Fp8Linear
        >>> record_module(Fp8Linear(32, 32, config=Fp8Config(backend="emulated")))
        Fp8Entry(kind='linear', recipe='tensorwise')
    """
    entry = _derived(module)
    if entry is None:
        raise TypeError(f"only Fp8Linear / Fp8Experts are recorded as FP8, got "
                        f"{type(module).__name__}")
    # object.__setattr__: a plain instance attribute, whatever nn.Module's __setattr__ does.
    object.__setattr__(module, ENTRY_ATTR, entry)
    return entry


def fp8_entry(module: Optional[nn.Module]) -> Optional[Fp8Entry]:
    """The conversion's entry for ``module``, or None when it is not FP8 (or is None).

    Example:
        >>> import torch
        >>> from fp8boost.fp8 import Fp8Config, convert_to_fp8
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64))
        >>> _ = convert_to_fp8(model, Fp8Config(backend="emulated", min_numel=0))
        >>> fp8_entry(model[0]), fp8_entry(torch.nn.Linear(2, 2))
        (Fp8Entry(kind='linear', recipe='tensorwise'), None)
    """
    if module is None:
        return None
    entry = getattr(module, "__dict__", {}).get(ENTRY_ATTR)
    # No entry: never converted, or an FP8 module built by hand; answer what conversion
    # would have recorded rather than a silent "not FP8".
    return entry if entry is not None else _derived(module)


def recorded_linear(module: Optional[nn.Module]) -> bool:
    """Whether the record has ``module`` as an FP8 linear layer (``Fp8Linear``/``Fp8Conv1D``).

    Example:
        >>> import torch
        >>> recorded_linear(torch.nn.Linear(2, 2))
        False
    """
    entry = fp8_entry(module)
    return entry is not None and entry.kind == LINEAR


def recorded_experts(module: Optional[nn.Module]) -> bool:
    """Whether the record has ``module`` as FP8 experts (``fp8.moe.Fp8Experts``).

    Example:
        >>> import torch
        >>> recorded_experts(torch.nn.Linear(2, 2))
        False
    """
    entry = fp8_entry(module)
    return entry is not None and entry.kind == EXPERTS


def recorded_linears(model: nn.Module) -> list[nn.Module]:
    """The FP8 linear layers of ``model`` the record lists, in ``modules()`` order.

    Example:
        >>> import torch
        >>> recorded_linears(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        []
    """
    return [m for m in model.modules() if recorded_linear(m)]


def recorded_experts_modules(model: nn.Module) -> list[nn.Module]:
    """The FP8 expert modules of ``model`` the record lists, in ``modules()`` order.

    Example:
        >>> import torch
        >>> recorded_experts_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        []
    """
    return [m for m in model.modules() if recorded_experts(m)]


def fp8_record(model: nn.Module) -> Fp8Record:
    """The conversion's record of ``model``: its FP8 modules under their current names.

    Read from the entries conversion set on the modules themselves (module docstring), so it
    stays right after engines wrap, split or re-root them. Empty for a model never converted.

    Example:
        >>> import torch
        >>> from fp8boost.fp8 import Fp8Config, convert_to_fp8
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64),
        ...                             torch.nn.Sequential(torch.nn.Linear(64, 64)))
        >>> bool(fp8_record(model))
        False
        >>> _ = convert_to_fp8(model[1], Fp8Config.from_recipe("rowwise", backend="emulated",
        ...                                                     min_numel=0))
        >>> stage = torch.nn.ModuleDict({"last": model[1]})  # re-rooted: the names follow
        >>> fp8_record(model).linears, fp8_record(stage).linears
        ({'1.0': 'rowwise'}, {'last.0': 'rowwise'})
    """
    linears, experts = {}, []
    for name, module in model.named_modules():
        entry = fp8_entry(module)
        if entry is None:
            continue
        if entry.kind == LINEAR:
            linears[name] = entry.recipe
        else:
            experts.append(name)
    return Fp8Record(linears=linears, experts=tuple(experts))
