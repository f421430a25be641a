"""``colossalai.shardformer.layer``: ``Linear1D_Col`` / ``Linear1D_Row``, importable, refused
when built.

Colossal-AI's hand-placed tensor-parallel linears hold one rank's slice of a weight; fp8boost's
plugins know nothing of such slices (a data-parallel plugin would average them over ranks as if
they were replicas), so a model built from them would train wrong. fp8boost splits the model
itself instead: boost the plain model with ``HybridParallelPlugin(tp_size=...)`` and its
tensor-parallel plan splits every linear (FP8-aware, checkpoints gathered to full weights).
The names import, so modules that only mention them load; building one raises with that fix.

Example:
    >>> from fp8boost.colossal.shardformer.layer import Linear1D_Col
    >>> Linear1D_Col.from_native_module(None)
    Traceback (most recent call last):
    ...
    NotImplementedError: Linear1D_Col is not offered by fp8boost...
"""
from __future__ import annotations

from typing import Any, NoReturn

from torch import nn

__all__ = ["Linear1D_Col", "Linear1D_Row"]


def _refuse(name: str) -> NoReturn:
    raise NotImplementedError(
        f"{name} is not offered by fp8boost: keep the plain nn.Linear layers and boost the model "
        "with HybridParallelPlugin(tp_size=N), whose tensor-parallel plan splits them over the tp "
        "ranks (a hand-split layer would be averaged as a replica by the other plugins)")


class Linear1D_Col(nn.Module):  # noqa: N801 - Colossal-AI's name
    """Colossal-AI's column-parallel linear: refused (see the module docstring).

    Raises:
        NotImplementedError: always, naming ``HybridParallelPlugin(tp_size=...)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse(type(self).__name__)

    @classmethod
    def from_native_module(cls, module: nn.Module, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(cls.__name__)


class Linear1D_Row(Linear1D_Col):  # noqa: N801 - Colossal-AI's name
    """Colossal-AI's row-parallel linear: refused (see the module docstring).

    Raises:
        NotImplementedError: always, naming ``HybridParallelPlugin(tp_size=...)``.
    """
