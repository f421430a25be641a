"""``colossalai.accelerator``: the current device behind one object (CUDA or CPU).

``get_accelerator()`` returns a ``CudaAccelerator`` when CUDA is available, else a
``CpuAccelerator``; both answer Colossal-AI's accelerator methods by delegating to
``torch.cuda`` (CUDA) or doing the CPU equivalent (CPU: memory counters read 0, synchronize
and empty_cache do nothing; what only CUDA has, the compute capability and streams, raises a
``RuntimeError`` saying so).

Example:
    >>> from fp8boost.colossal.accelerator import get_accelerator
    >>> get_accelerator().get_current_device().type in ("cuda", "cpu")
    True
"""
from __future__ import annotations

import os
from types import MappingProxyType
from typing import Any, Optional, Union

import torch

from fp8boost import _state

__all__ = ["BaseAccelerator", "CudaAccelerator", "CpuAccelerator", "get_accelerator",
           "set_accelerator", "auto_set_accelerator"]


class BaseAccelerator:
    """What every accelerator answers; ``name`` is ``"cuda"`` or ``"cpu"``.

    Args:
        name: the device type.
        communication_backend: the process-group backend that suits the device.
        is_synchronous: whether kernels finish before the call returns (the CPU).
    """

    def __init__(self, name: str, communication_backend: str, is_synchronous: bool) -> None:
        self._name = name
        self._communication_backend = communication_backend
        self._is_synchronous = is_synchronous

    @property
    def name(self) -> str:
        return self._name

    @property
    def communication_backend(self) -> str:
        return self._communication_backend

    @property
    def is_synchronous(self) -> bool:
        return self._is_synchronous

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # --- the device
    def get_current_device(self) -> torch.device:
        """The device this process computes on (``cuda:<current>`` or ``cpu``)."""
        return torch.device("cpu")

    def current_device(self) -> int:
        """The index of the current device."""
        return 0

    def set_device(self, device: Optional[Union[torch.device, int]] = None) -> None:
        """Make ``device`` current (default ``LOCAL_RANK``)."""

    def get_device_name(self, device: Optional[Union[torch.device, int]] = None) -> str:
        return self._name

    def synchronize(self, device: Optional[Union[torch.device, int]] = None) -> None:
        """Wait for every kernel queued on ``device``."""

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        """The CUDA compute capability ``(major, minor)``; the CPU has none.

        Raises:
            RuntimeError: on the CPU accelerator (check ``name == "cuda"`` first).
        """
        raise RuntimeError(f"the {self._name} accelerator has no CUDA compute capability; check "
                           "get_accelerator().name == 'cuda' before asking for it")

    # --- streams (CUDA only)
    def current_stream(self, device: Any = None) -> Any:
        """The stream kernels are queued on (CUDA)."""
        raise RuntimeError(f"the {self._name} accelerator has no streams; check "
                           "get_accelerator().name == 'cuda' first")

    def stream(self, stream_: Any) -> Any:
        """A context manager making ``stream_`` current (CUDA)."""
        raise RuntimeError(f"the {self._name} accelerator has no streams; check "
                           "get_accelerator().name == 'cuda' first")

    # --- random numbers
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def seed(self) -> None:
        torch.seed()

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device: Any = "cpu") -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cpu") -> None:
        torch.set_rng_state(new_state)

    # --- memory (the CPU keeps no counters: 0, as Colossal-AI's CPU accelerator)
    def empty_cache(self) -> None:
        """Return cached, unused device memory."""

    def memory_allocated(self, device: Any = None) -> int:
        return 0

    def max_memory_allocated(self, device: Any = None) -> int:
        return 0

    def memory_reserved(self, device: Any = None) -> int:
        return 0

    def max_memory_reserved(self, device: Any = None) -> int:
        return 0

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        """Restart the peak counters."""

    def reset_max_memory_allocated(self, device: Any = None) -> None:
        """Restart the peak of allocated memory."""

    def reset_max_memory_cached(self, device: Any = None) -> None:
        """Restart the peak of memory held by the caching allocator."""

    def memory_summary(self, device: Any = None, abbreviated: bool = False) -> str:
        return ""


class CpuAccelerator(BaseAccelerator):
    """The CPU: gloo, synchronous, no memory counters.

    Example:
        >>> CpuAccelerator().get_current_device()
        device(type='cpu')
    """

    def __init__(self) -> None:
        super().__init__("cpu", "gloo", is_synchronous=True)


class CudaAccelerator(BaseAccelerator):
    """A CUDA GPU: every call goes to ``torch.cuda``.

    Example:
        >>> CudaAccelerator().device_count() >= 0
        True
    """

    def __init__(self) -> None:
        super().__init__("cuda", "nccl", is_synchronous=False)

    def get_current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device: Optional[Union[torch.device, int]] = None) -> None:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) if device is None else device)

    def get_device_name(self, device: Optional[Union[torch.device, int]] = None) -> str:
        return torch.cuda.get_device_name(device)

    def synchronize(self, device: Optional[Union[torch.device, int]] = None) -> None:
        torch.cuda.synchronize(device)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        return torch.cuda.get_device_capability(device)

    def current_stream(self, device: Any = None) -> Any:
        return torch.cuda.current_stream(device)

    def stream(self, stream_: Any) -> Any:
        return torch.cuda.stream(stream_)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def seed(self) -> None:
        torch.cuda.seed()

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return torch.cuda.get_rng_state(device)

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.cuda.set_rng_state(new_state, device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device: Any = None) -> int:
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device: Any = None) -> int:
        return torch.cuda.max_memory_allocated(device)

    def memory_reserved(self, device: Any = None) -> int:
        return torch.cuda.memory_reserved(device)

    def max_memory_reserved(self, device: Any = None) -> int:
        return torch.cuda.max_memory_reserved(device)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def reset_max_memory_allocated(self, device: Any = None) -> None:
        torch.cuda.reset_max_memory_allocated(device)

    def reset_max_memory_cached(self, device: Any = None) -> None:
        torch.cuda.reset_max_memory_cached(device)

    def memory_summary(self, device: Any = None, abbreviated: bool = False) -> str:
        return torch.cuda.memory_summary(device, abbreviated)


_ACCELERATORS = MappingProxyType({"cuda": CudaAccelerator, "cpu": CpuAccelerator})
# One per process, chosen on first use (never at import: that would probe the device); kept
# in fp8boost._state's named cache, like every piece of process-wide state.
_CACHE = "colossal.accelerator"


def set_accelerator(accelerator: Union[str, BaseAccelerator]) -> None:
    """Use ``accelerator`` (``"cuda"``, ``"cpu"`` or an instance) from now on.

    Example:
        >>> set_accelerator("cpu"); get_accelerator().name
        'cpu'
    """
    if isinstance(accelerator, str):
        if accelerator not in _ACCELERATORS:
            raise ValueError(f"unknown accelerator {accelerator!r}; use one of "
                             f"{sorted(_ACCELERATORS)}")
        accelerator = _ACCELERATORS[accelerator]()
    if not isinstance(accelerator, BaseAccelerator):
        raise TypeError(f"accelerator must be a name or a BaseAccelerator, got "
                        f"{type(accelerator).__name__}")
    _state.cache(_CACHE)["current"] = accelerator


def auto_set_accelerator() -> None:
    """CUDA when available, else the CPU."""
    set_accelerator("cuda" if torch.cuda.is_available() else "cpu")


def get_accelerator() -> BaseAccelerator:
    """The accelerator of this process (chosen on the first call: CUDA if available).

    Example:
        >>> get_accelerator().name in ("cuda", "cpu")
        True
    """
    current = _state.cache(_CACHE)
    if "current" not in current:
        auto_set_accelerator()
    return current["current"]
