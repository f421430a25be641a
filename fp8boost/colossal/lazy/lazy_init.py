"""``colossalai.lazy.lazy_init``: ``LazyInitContext`` and ``LazyTensor`` (see
:mod:`fp8boost.colossal.lazy`).

Example:
    >>> from fp8boost.colossal.lazy.lazy_init import LazyInitContext
"""
from fp8boost.colossal.lazy import LazyInitContext, LazyTensor

__all__ = ["LazyInitContext", "LazyTensor"]
