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

``from_pretrained`` inside the context (Colossal-LLaMA's ``with LazyInitContext(...): model =
AutoModelForCausalLM.from_pretrained(path, torch_dtype=...)``): while the context is active,
``transformers.PreTrainedModel.from_pretrained`` (where every ``AutoModel*.from_pretrained``
ends) is replaced by one that builds the model on the meta device exactly as ``from_pretrained``
would (its own config, dtype, ``_keep_in_fp32_modules``, ties, ``eval()`` mode, generation
config) without reading a weight, and notes the checkpoint folder and each tensor's dtype on
the model. The weights are read when the model is materialized, right after its
initialisation: in ``build_model`` for the replica plugins (each rank reads every tensor), by
the FSDP plugins after ``fully_shard`` (each rank reads only the slices of its own shards), and
by :meth:`LazyInitContext.materialize` (see ``fp8boost.checkpoint_io.pretrained``). Each
tensor is rounded through the dtype ``from_pretrained`` built it in, so the boosted parameters
equal those of eager ``from_pretrained`` followed by ``boost``, bit for bit. Safetensors
checkpoints only (a local folder or one the Hub cache holds); ``device_map``,
``quantization_config``, ``gguf_file``, ``state_dict``, tensor-parallel arguments and adapter
folders are refused inside the context. The original method is put back on exit, also when
the block raises.

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

import os
import weakref
from typing import Any, Optional, Union

import torch
from torch import nn

__all__ = ["LazyInitContext", "LazyTensor"]

#: the attribute (on every module that registered a parameter in the context) naming the
#: device ``LazyInitContext.materialize`` allocates on
DEVICE_MARK = "fp8boost_lazy_init_device"

#: ``from_pretrained`` arguments the lazy ``from_pretrained`` refuses (they place, quantize,
#: split or pick weight files in ways the deferred safetensors read does not follow)
REFUSED_PRETRAINED_ARGS = ("device_map", "quantization_config", "gguf_file", "state_dict",
                           "tp_plan", "tp_size", "distributed_config", "max_memory",
                           "offload_folder", "variant")


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
        try:
            restore = _patch_from_pretrained()
        except BaseException:
            hook.remove()
            meta.__exit__(None, None, None)
            raise
        self.active = [meta, hook, restore]
        return self

    def __exit__(self, *exc: Any) -> None:
        meta, hook, restore = self.active
        self.active = []
        try:
            restore()
        finally:
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

        The device is the context's ``default_device`` (the CPU if none). A model built by
        ``from_pretrained`` inside the context then reads its checkpoint (every tensor whole,
        in the dtype ``from_pretrained`` would give it). Without a plugin:
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
        # lazy: fp8boost.plugins loads every plugin (Triton, torch.compile); this stays light
        from fp8boost.plugins.plugin_base import check_meta, materialize_replica

        if not isinstance(module, nn.Module):
            raise TypeError(f"materialize takes an nn.Module, got {type(module).__name__}")
        check_meta(module)
        device = next((getattr(m, DEVICE_MARK) for m in module.modules()
                       if hasattr(m, DEVICE_MARK)), torch.device("cpu"))
        numel = sum(p.numel() for p in module.parameters() if p.is_meta)
        materialize_replica(module, None, device)  # reads a lazy from_pretrained's weights too
        if verbose:
            print(f"LazyInitContext: materialized {numel} parameter elements on {device}")
        return module


def _patch_from_pretrained():
    """Replace ``PreTrainedModel.from_pretrained`` by :func:`_lazy_from_pretrained`; returns
    the function that puts the original back (a no-op without transformers)."""
    try:
        # lazy: transformers takes seconds to import; a no-op without it
        from transformers import PreTrainedModel
    except ImportError:
        return lambda: None
    original = PreTrainedModel.__dict__["from_pretrained"]  # the classmethod object itself

    def lazy(cls, pretrained_model_name_or_path, *args, **kwargs):
        return _lazy_from_pretrained(original.__func__, cls, pretrained_model_name_or_path,
                                     *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(lazy)

    def restore() -> None:
        PreTrainedModel.from_pretrained = original

    return restore


def _lazy_from_pretrained(original, cls, path, *args, **kwargs):
    """``from_pretrained`` on the meta device: transformers builds the model as it would
    (``device_map="meta"`` reads no weight), and the checkpoint folder is noted on it for
    :func:`fp8boost.checkpoint_io.pretrained.load_remembered`."""
    # lazy: fp8boost.plugins loads every plugin (Triton, torch.compile); this module stays light
    from fp8boost.checkpoint_io.pretrained import remember

    refused = [k for k in REFUSED_PRETRAINED_ARGS if kwargs.get(k) is not None]
    if refused:
        raise ValueError(f"from_pretrained inside LazyInitContext does not take {refused}: "
                         "the weights are read at booster.boost (or LazyInitContext.materialize);"
                         " call from_pretrained outside the context to use them")
    kwargs = {k: v for k, v in kwargs.items() if k not in REFUSED_PRETRAINED_ARGS}  # all None
    if path is None:
        raise ValueError("from_pretrained inside LazyInitContext needs a checkpoint path")
    subfolder = kwargs.get("subfolder") or ""
    local = os.path.join(os.fspath(path), subfolder)
    if os.path.isfile(os.path.join(local, "adapter_config.json")):
        raise ValueError(f"{local} is an adapter (PEFT) folder: LazyInitContext loads base "
                         "models only; load the base model lazily, then apply the adapter")
    out = original(cls, path, *args, device_map="meta", **kwargs)
    model = out[0] if isinstance(out, tuple) else out
    if os.path.isdir(local):
        folder = local
    else:  # a Hub id: from_pretrained has fetched it into the cache
        # lazy: transformers takes seconds to import; only HF models get here
        from transformers.utils import cached_file

        config_file = cached_file(os.fspath(path), "config.json", subfolder=subfolder,
                                  cache_dir=kwargs.get("cache_dir"),
                                  revision=kwargs.get("revision"), token=kwargs.get("token"))
        folder = os.path.dirname(config_file)
    remember(model, folder)
    return out
