"""One FP8 cast per input tensor, shared by the layers that read it (eager mode).

In a Llama block, ``q_proj``, ``k_proj`` and ``v_proj`` read the same normed hidden state, and
``gate_proj`` and ``up_proj`` the same MLP input. Each of them would compute the same amaxes
and write the same FP8 bytes (and keep its own transposed copy for backward): one per-tensor
scale under tensorwise scaling, per-row or per-tile scales and the token-axis operand ``x^T``
under the rowwise and blockwise recipes. Here the first layer's cast is remembered and the
next layers that get the very same tensor object, unchanged (same version counter) and cast the
same way (recipe, format, margin, power-of-2 rounding, backend, amax group) reuse it: the
result is exactly the cast they would have made.

Only the most recent input is remembered, and only while that input is alive: the
entry holds a weak reference to the source tensor and is dropped when the source is freed (for
a Llama block, right after the last projection that reads it), so the shared FP8 copy lives no
longer than the layers' own copies would. Under ``torch.compile`` this module is not used (the
compiler's common-subexpression elimination merges identical casts).

Example:
    >>> import torch
    >>> from fp8boost.fp8 import shared_cast
    >>> x = torch.randn(4, 8)
    >>> shared_cast.lookup(x, ("k",), with_transpose=False) is None
    True
    >>> shared_cast.store(x, ("k",), "fp8-of-x")
    >>> shared_cast.lookup(x, ("k",), with_transpose=False)
    'fp8-of-x'
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable, Optional

import torch

from fp8boost import _state

# The one remembered cast of the process lives in this _state cache under _KEY: a lookup checks
# the source's identity, so threads that interleave (nn.DataParallel replicas) only miss, never
# get another tensor's cast.
_CACHE = "fp8.shared_cast"
_KEY = "last"


class _Entry:
    __slots__ = ("src", "version", "key", "fp8", "has_transpose", "__weakref__")

    def __init__(self, version: int, key: Hashable, fp8: Any, has_transpose: bool) -> None:
        self.src: Optional[weakref.ref] = None
        self.version, self.key, self.fp8 = version, key, fp8
        self.has_transpose = has_transpose


def lookup(src: torch.Tensor, key: Hashable, with_transpose: bool) -> Optional[Any]:
    """The remembered cast of ``src`` made with ``key``, or None.

    A cast without its transposed copy does not serve a caller that needs one.
    """
    entry = _state.cache(_CACHE).get(_KEY)
    if entry is None or entry.src() is not src or entry.version != src._version \
            or entry.key != key:
        return None
    if with_transpose and not entry.has_transpose:
        return None
    return entry.fp8


def store(src: torch.Tensor, key: Hashable, fp8: Any,
          has_transpose: Optional[bool] = None) -> None:
    """Remember ``fp8`` as the cast of ``src`` made with ``key`` (replacing the previous one).

    ``has_transpose``: whether ``fp8`` holds the transposed operand too (None: whether it has
    a ``data_t``, as a tensorwise ``Fp8Tensor`` does)."""
    slot = _state.cache(_CACHE)
    if has_transpose is None:
        has_transpose = getattr(fp8, "data_t", None) is not None
    entry = _Entry(src._version, key, fp8, has_transpose)
    entry_ref = weakref.ref(entry)

    def _drop(_src_ref: weakref.ref) -> None:
        # The source died: free the shared copy now, not at the next cast.
        if slot.get(_KEY) is not None and slot.get(_KEY) is entry_ref():
            slot.pop(_KEY, None)

    entry.src = weakref.ref(src, _drop)
    slot[_KEY] = entry


def cast_once(src: torch.Tensor, key: Hashable, with_transpose: bool,
              make: Callable[[], Any], has_transpose: Optional[bool] = None) -> Any:
    """The remembered cast of ``src`` made with ``key``, else ``make()``, remembered
    (``has_transpose``: as :func:`store` takes it)."""
    fp8 = lookup(src, key, with_transpose)
    if fp8 is None:
        fp8 = make()
        store(src, key, fp8, has_transpose)
    return fp8


def clear() -> None:
    """Forget the remembered cast (tests; a model whose weights changed dtype)."""
    _state.cache(_CACHE).pop(_KEY, None)


def holds_cast() -> bool:
    """Whether a cast is remembered now (tests: it must not outlive its source tensor)."""
    return _state.cache(_CACHE).get(_KEY) is not None
