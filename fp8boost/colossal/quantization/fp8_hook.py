"""``colossalai.quantization.fp8_hook``: :class:`FP8Hook`, which routes ``F.linear`` to FP8.

In Colossal-AI the hook is a ``ColoParamOpHook``: its ``rewrite_op`` swaps ``F.linear`` for
:func:`~fp8boost.colossal.quantization.fp8.linear_fp8` in ops on hooked ``ColoParameter``\\ s
(the Gemini/Hybrid plugins' ``use_fp8``). fp8boost has no ``ColoParameter``: the hook is applied
as a context manager instead (a ``torch.overrides.TorchFunctionMode``), and then rewrites every
torch function called inside the ``with`` block, whatever tensors it is called on. Subclasses
override :meth:`FP8Hook.rewrite_op` as in Colossal-AI. To run a whole model's linear layers in
FP8, fp8boost's own route is ``use_fp8=True`` on a plugin (or ``fp8boost.fp8.convert_to_fp8``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .fp8_linear import linear_fp8

__all__ = ["FP8Hook"]


class _RewriteMode(TorchFunctionMode):
    """Calls ``hook.rewrite_op(func)`` in place of each torch function ``func``."""

    def __init__(self, hook: "FP8Hook") -> None:
        super().__init__()
        self.hook = hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # The mode is off while this runs, so linear_fp8's own torch calls are not rewritten.
        return self.hook.rewrite_op(func)(*args, **(kwargs or {}))


class FP8Hook:
    """Parameter-op hook that replaces ``F.linear`` by ``linear_fp8``.

    ``pre_forward`` / ``post_forward`` / ``pre_backward`` / ``post_backward`` are Colossal-AI's
    hook points and do nothing here; ``rewrite_op`` does the work. Used as a context manager it
    is applied to the torch functions called inside the block (not re-entrant: one ``with`` at
    a time per hook object).

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> x, w = torch.randn(4, 32), torch.randn(16, 32)
        >>> with FP8Hook():
        ...     y = F.linear(x, w)                     # runs linear_fp8
        >>> y.shape
        torch.Size([4, 16])
    """

    def __init__(self) -> None:
        self._mode: Optional[_RewriteMode] = None

    def pre_forward(self, params: Any) -> None:
        """Before a hooked op's forward: nothing to do."""

    def post_forward(self, params: Any) -> None:
        """After a hooked op's forward: nothing to do."""

    def pre_backward(self, params: Any) -> None:
        """Before a hooked op's backward: nothing to do."""

    def post_backward(self, params: Any) -> None:
        """After a hooked op's backward: nothing to do."""

    def rewrite_op(self, func: Callable) -> Callable:
        """The function to call instead of ``func``: ``linear_fp8`` for ``F.linear``."""
        if func is F.linear:
            return linear_fp8
        return func

    def __enter__(self) -> "FP8Hook":
        if self._mode is not None:
            raise RuntimeError("this FP8Hook is already active; use a second FP8Hook() to nest")
        self._mode = _RewriteMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)
