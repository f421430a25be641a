"""``colossalai.lazy``: build a model without memory, materialize it at ``booster.boost``.

Colossal-AI's ``LazyInitContext`` records a model's construction as lazy tensors and replays it
at ``boost``. Here it is fp8boost's meta-device init: inside the context every tensor a module
creates lands on the meta device (no memory), and ``booster.boost`` materializes the model:

* ``GeminiPlugin``/``TorchFSDPPlugin`` allocate only this rank's shards after ``fully_shard``
  (``fp8boost.parallel.fsdp.wiring.materialize``);
* ``LowLevelZeroPlugin``/``TorchDDPPlugin``/``HybridParallelPlugin`` allocate the whole replica
  (only the kept pipeline stages with ``pp_size > 1``) on their device in ``build_model``,
  before FP8 conversion and the broadcast from rank 0.

Initial values: not Colossal-AI's replay. Parameters get the model's own initialisation (HF
``_init_weights``, else ``reset_parameters``) on the real tensors, drawn from a seed taken from
the global RNG, so they follow eager init's distributions and are the same on every rank seeded
alike (the data-parallel plugins broadcast rank 0's replica too); they are not bit-equal to
eager construction under that seed (eager draws in construction order, twice for HF models).
Buffers no checkpoint holds (rotary ``inv_freq``) are rebuilt exactly as eager construction
makes them; tied parameters stay tied. For exact weights, ``booster.load_model(model, folder)``
after ``boost``, as Colossal-AI scripts do.

Example:
    >>> import torch
    >>> from fp8boost.colossal.lazy import LazyInitContext
    >>> with LazyInitContext():
    ...     layer = torch.nn.Linear(4, 4)
    >>> layer.weight.is_meta
    True
    >>> LazyInitContext.materialize(layer).weight.is_meta
    False
"""
from __future__ import annotations

import weakref
from typing import Any, Optional, Union

import torch
from torch import nn

__all__ = ["LazyInitContext", "LazyTensor"]

#: the attribute (on every module that registered a parameter in the context) naming the
#: device ``LazyInitContext.materialize`` allocates on
DEVICE_MARK = "fp8boost_lazy_init_device"


class LazyTensor:
    """Colossal-AI's lazy tensor class, accepted as ``LazyInitContext(tensor_cls=...)``.

    fp8boost records no tensor operations: a lazily built tensor is a meta tensor.

    Example:
        >>> from fp8boost.colossal.lazy import LazyInitContext, LazyTensor
        >>> ctx = LazyInitContext(tensor_cls=LazyTensor)
    """


class LazyInitContext:
    """Build modules on the meta device; ``booster.boost`` (or :meth:`materialize`) allocates
    and initialises them (see the module docstring for which values they get).

    Args:
        tensor_cls: Colossal-AI's lazy tensor class; accepted and unused (no ops are recorded).
        default_device: where :meth:`materialize` allocates (None: the CPU). A plugin allocates
            on its own device at ``boost`` whatever this says.

    Raises:
        RuntimeError: when a context is entered twice at once.

    Example:
        >>> import torch
        >>> from fp8boost.colossal.lazy import LazyInitContext
        >>> from fp8boost.colossal.utils import get_current_device
        >>> with LazyInitContext(default_device=get_current_device()):
        ...     model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> all(p.is_meta for p in model.parameters())
        True
    """

    def __init__(self, tensor_cls: Any = None,
                 default_device: Optional[Union[torch.device, str, int]] = None) -> None:
        if isinstance(default_device, int):
            default_device = torch.device("cuda", default_device)
        self.tensor_cls = tensor_cls
        self.default_device = torch.device(default_device) if default_device is not None else None
        self.modules: weakref.WeakSet = weakref.WeakSet()  # what registered a parameter inside
        self.active: list = []  # (meta device context, hook handle) while entered

    def __enter__(self) -> "LazyInitContext":
        if self.active:
            raise RuntimeError("this LazyInitContext is already entered; use one `with` block")
        meta = torch.device("meta")
        meta.__enter__()
        hook = nn.modules.module.register_module_parameter_registration_hook(self._registered)
        self.active = [meta, hook]
        return self

    def __exit__(self, *exc: Any) -> None:
        meta, hook = self.active
        self.active = []
        hook.remove()
        meta.__exit__(*exc)
        device = self.default_device or torch.device("cpu")
        for module in list(self.modules):
            setattr(module, DEVICE_MARK, device)
        self.modules = weakref.WeakSet()

    def _registered(self, module: nn.Module, name: str, param: Any) -> None:
        self.modules.add(module)

    @staticmethod
    def materialize(module: nn.Module, verbose: bool = False) -> nn.Module:
        """Allocate a lazily built ``module`` in place and initialise it; returns it.

        The device is the context's ``default_device`` (the CPU if none). Without a plugin:
        an optimizer built on the meta parameters keeps them, so build it afterwards.

        Args:
            module: a model built inside ``LazyInitContext`` (or on the meta device).
            verbose: print how many parameters were materialized.

        Raises:
            TypeError: ``module`` is not an ``nn.Module``.
            ValueError: some parameters are real and others meta, or a meta buffer cannot
                be rebuilt (named, with what to do).

        Example:
            >>> import torch
            >>> from fp8boost.colossal.lazy import LazyInitContext
            >>> with LazyInitContext():
            ...     model = torch.nn.Linear(2, 2)
            >>> LazyInitContext.materialize(model).weight.device.type
            'cpu'
        """
        from fp8boost.plugins.plugin_base import check_meta, materialize_replica

        if not isinstance(module, nn.Module):
            raise TypeError(f"materialize takes an nn.Module, got {type(module).__name__}")
        check_meta(module)
        device = next((getattr(m, DEVICE_MARK) for m in module.modules()
                       if hasattr(m, DEVICE_MARK)), torch.device("cpu"))
        numel = sum(p.numel() for p in module.parameters() if p.is_meta)
        materialize_replica(module, None, device)
        if verbose:
            print(f"LazyInitContext: materialized {numel} parameter elements on {device}")
        return module
