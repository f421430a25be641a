"""``colossalai.testing.comparison``: tensor and state-dict assertions.

Example:
    >>> import torch
    >>> from fp8boost.colossal.testing import check_state_dict_equal
    >>> check_state_dict_equal({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-5})
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch.testing import assert_close

__all__ = ["assert_close", "assert_close_loose", "assert_equal", "assert_equal_in_group",
           "assert_not_equal", "check_state_dict_equal"]


def assert_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Every element of ``a`` equals ``b``'s."""
    assert torch.all(a == b), f"expected equal tensors, got {a} vs {b}"


def assert_not_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Some element of ``a`` differs from ``b``'s."""
    assert not torch.all(a == b), f"expected different tensors, got {a} vs {b}"


def assert_close_loose(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-3,
                       atol: float = 1e-3) -> None:
    """``torch.testing.assert_close`` with Colossal-AI's loose default tolerances."""
    assert_close(a, b, rtol=rtol, atol=atol)


def assert_equal_in_group(tensor: torch.Tensor, process_group: Optional[Any] = None) -> None:
    """``tensor`` is identical on every rank of ``process_group`` (default: the world)."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(gathered, tensor, group=process_group)
    for i, (a, b) in enumerate(zip(gathered, gathered[1:])):
        assert torch.all(a == b), f"rank {i} and rank {i + 1} differ: {a} vs {b}"


def _check_tensor(a: torch.Tensor, b: Any, ignore_device: bool, ignore_dtype: bool) -> None:
    assert isinstance(b, torch.Tensor), f"tensor vs {type(b).__name__}"
    if not ignore_device:  # Colossal-AI's (inverted-looking) meaning: compare on the CPU
        a, b = a.cpu(), b.cpu()
    if ignore_dtype:
        a = a.to(b.dtype)
    assert_close_loose(a, b)


def check_state_dict_equal(d1: Mapping, d2: Mapping, ignore_device: bool = True,
                           ignore_dtype: bool = False) -> None:
    """``d1`` and ``d2`` have the same keys and, recursively through dicts and lists, the same
    values: tensors within :func:`assert_close_loose`, anything else by ``==``.

    Args:
        d1, d2: state dicts (model or optimizer).
        ignore_device: False moves tensors to the CPU before comparing (as in Colossal-AI).
        ignore_dtype: cast ``d1``'s tensors to ``d2``'s dtype first.
    """
    assert len(d1) == len(d2), f"number of keys differs: {len(d1)} vs {len(d2)}"
    for key, v1 in d1.items():
        assert key in d2, f"key {key!r} missing"
        _check_value(v1, d2[key], ignore_device, ignore_dtype)


def _check_value(v1: Any, v2: Any, ignore_device: bool, ignore_dtype: bool) -> None:
    if isinstance(v1, dict):
        assert isinstance(v2, dict), f"dict vs {type(v2).__name__}"
        check_state_dict_equal(v1, v2, ignore_device, ignore_dtype)
    elif isinstance(v1, list):
        assert isinstance(v2, list), f"list vs {type(v2).__name__}"
        for a, b in zip(v1, v2):
            _check_value(a, b, ignore_device, ignore_dtype)
    elif isinstance(v1, torch.Tensor):
        _check_tensor(v1, v2, ignore_device, ignore_dtype)
    else:
        assert v1 == v2, f"{v1} != {v2}"
