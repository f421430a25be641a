"""Wrappers the plugins hand back from ``boost``: the model and the optimizer.

``ModelWrapper`` casts floating-point inputs to the training dtype (so an FP32 batch can feed a
BF16 model) and gives ``unwrap()``; attribute lookups it does not know fall through to the
user's model, so ``model.config`` and friends keep working. ``load_state_dict`` also refreshes
the master weights of the optimizers boosted with it.

``OptimizerWrapper`` is the thin wrapper used where no master weights are needed (FP32
training): it adds ``backward``, ``clip_grad_norm_``, optional clipping in ``step`` and the
checkpoint protocol that ``ZeroOptimizer`` also implements (see ``checkpoint_io/formats.py``).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from types import MappingProxyType
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fp8boost.parallel.boosted_optimizer import BoostedOptimizer, DirectOptimizerProxy
from fp8boost.parallel.fsdp.full_state_dict import full_of
from fp8boost.parallel.zero.sharding import ParamShard, make_shard

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = MappingProxyType({"fp32": torch.float32, "bf16": torch.bfloat16,
                           "fp16": torch.float16})


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor inside (nested) tuples/lists/dicts to ``dtype``."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)):
        out = [cast_floating(o, dtype) for o in obj]
        return type(obj)(*out) if hasattr(obj, "_fields") else type(obj)(out)
    if isinstance(obj, dict):
        return type(obj)((k, cast_floating(v, dtype)) for k, v in obj.items())
    return obj


def cast_params_(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating-point parameters in place, keeping the Parameter objects (see
    :func:`cast_buffers_` for the buffers)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


# Buffers that stay FP32 whatever the training dtype: HF's rotary frequency tables (the angles
# are computed from them in FP32; a BF16 table would move every position's angle).
FP32_BUFFER_NAMES = frozenset({"inv_freq", "original_inv_freq"})
_CASTABLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def cast_buffers_(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating-point buffers to ``dtype`` (the dtype the forward computes in), as
    Colossal-AI's module cast does: a BatchNorm's running statistics must match its input.

    Kept as they are: :data:`FP32_BUFFER_NAMES` (rotary tables), every buffer of an fp8boost
    module (FP8 scaling state stays FP32) and FP8/integer/bool buffers.

    Example:
        >>> bn = nn.BatchNorm1d(4)
        >>> cast_buffers_(bn, torch.bfloat16)
        >>> bn.running_mean.dtype, bn.num_batches_tracked.dtype
        (torch.bfloat16, torch.int64)
    """
    for module in model.modules():
        if type(module).__module__.startswith("fp8boost."):
            continue
        for name, buf in module._buffers.items():
            if (buf is not None and buf.dtype in _CASTABLE and buf.dtype != dtype
                    and name not in FP32_BUFFER_NAMES):
                module._buffers[name] = buf.to(dtype)


class ModelWrapper(nn.Module):
    """The model returned by ``Booster.boost``: forwards to ``module``, casting float inputs.

    Args:
        module: the user's model, or an engine wrapper around it (e.g. ``DistributedDataParallel``).
        input_dtype: cast floating-point inputs to this dtype (None: leave inputs alone).

    Attributes:
        boosted_optimizers: the optimizers ``boost`` built over this model's parameters, held
            here so that checkpoint IO can take their exact weights when it saves the model
            (``Plugin.exact_weights``) and refresh their masters when it loads it
            (``Plugin.after_load_model``, and :meth:`load_state_dict`).
        boosted_by: the class of the plugin whose ``boost`` built this wrapper (None when
            built by hand).
    """

    def __init__(self, module: nn.Module, input_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.module = module
        self.input_dtype = input_dtype
        # Set by the plugin's configure, once the optimizer over these parameters exists.
        self.boosted_optimizers: list[BoostedOptimizer] = []
        self.boosted_by: Optional[type] = None

    def forward(self, *args, **kwargs):
        if self.input_dtype is not None and self.input_dtype != torch.float32:
            args, kwargs = cast_floating(args, self.input_dtype), cast_floating(kwargs, self.input_dtype)
        return self.module(*args, **kwargs)

    def unwrap(self, unwrap_peft: bool = False) -> nn.Module:
        """The user's own model object (its state_dict keys have no wrapper prefix).

        Args:
            unwrap_peft: Colossal-AI's flag (default True there, where a peft model comes back
                as a checkpoint view of its base model). Here the model is returned as given
                to ``boost``; True is refused for a peft model, naming what to call instead.

        Raises:
            ValueError: ``unwrap_peft=True`` and the model is a peft ``PeftModel``.
        """
        m = self.module
        while isinstance(m, (ModelWrapper, DDP)):
            m = m.module
        if unwrap_peft and hasattr(m, "get_base_model") and hasattr(m, "peft_config"):
            raise ValueError("unwrap(unwrap_peft=True): fp8boost returns the peft model itself; "
                             "call unwrap().get_base_model() for the base model, or "
                             "booster.save_lora_as_pretrained(model, dir) to save the adapters")
        return m

    def state_dict(self, *args, only_rank_0: Optional[bool] = None, **kwargs):
        """``nn.Module.state_dict``: keys with the wrapper's ``module.`` prefix, a sharding
        engine's tensors as it holds them (FSDP2: DTensor shards).

        With ``only_rank_0`` (Colossal-AI's ``GeminiDDP.state_dict`` argument) the whole model
        instead, as ``GeminiDDP`` gives it: the user's model's keys after ``prefix``, every
        sharded tensor gathered to its full shape (collective: call it on every rank), kept
        on every rank (False) or on rank 0 only (True: the other ranks get an empty dict).

        Raises:
            TypeError: ``only_rank_0`` with positional arguments (give ``destination``,
                ``prefix``, ``keep_vars`` by name).
        """
        if only_rank_0 is None:
            return super().state_dict(*args, **kwargs)
        if args:
            raise TypeError("state_dict(only_rank_0=...): give destination, prefix and "
                            "keep_vars by name")
        destination = kwargs.pop("destination", None)
        gathered = {key: full_of(value) for key, value in self.unwrap().state_dict(
            **kwargs).items()}  # the same gathers in the same order on every rank
        out = OrderedDict() if destination is None else destination
        if not (only_rank_0 and dist.is_initialized() and dist.get_rank() != 0):
            out.update(gathered)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` (keys as :meth:`state_dict` writes them, with the
        wrapper's ``module.`` prefix), then the boosted optimizers' master weights are
        re-read from the loaded parameters, so the next step trains from them.

        Raises:
            ValueError: ``assign=True`` while optimizers hold these parameters (the new
                tensors would not be the ones they step).
        """
        if assign and self.boosted_optimizers:
            raise ValueError("load_state_dict(assign=True) would replace the parameters the "
                             "boosted optimizer steps; load with assign=False")
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.update_master_params()
        return result

    def update_master_params(self) -> None:
        """Re-read the boosted optimizers' master weights from the parameters (after they
        were written by hand; Colossal-AI's name)."""
        for opt in self.boosted_optimizers:
            opt.sync_master_from_model()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("module", "input_dtype", "boosted_optimizers", "boosted_by"):
                raise
            return getattr(self.unwrap(), name)


class OptimizerWrapper(DirectOptimizerProxy):
    """A torch optimizer plus ``backward``/clipping and the checkpoint protocol (no sharding).

    Args:
        optimizer: the user's torch optimizer.
        max_norm: clip to this global norm in every ``step()`` (0 disables).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, max_norm: float = 0.0) -> None:
        self.optim = optimizer
        self.max_norm = float(max_norm)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r}, max_norm={self.max_norm})"

    # backward: OptimizerProxy's (the non-finite guard sees the loss; no loss scaler here)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # gradient sync (if any) belongs to the model wrapper (DDP)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        norm = torch.tensor(float("inf")) if self.guard_skips_step() else \
            torch.nn.utils.clip_grad_norm_(self.params, max_norm, norm_type)
        self.record_grad_norm(norm, norm_type)
        return norm

    def step(self, closure=None):
        if self.guard_skips_step():  # the same verdict on every rank: nobody steps
            self.zero_grad()
            return None
        if self.max_norm > 0:  # reads this step's verdict: the gradients are checked once
            self.clip_grad_norm_(self.max_norm)
        out = self.optim.step(closure)
        self.forget_guard_verdict()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.forget_guard_verdict()
        self.optim.zero_grad(set_to_none=set_to_none)

    # checkpoint protocol (see checkpoint_io/formats.py): one replica holds everything
    shard_world_size = 1
    shard_rank = 0

    def checkpoint_layout(self) -> list[ParamShard]:
        return [make_shard(i, p, 1, 0) for i, p in enumerate(self.params)]

    def checkpoint_state(self) -> tuple[dict, dict, list[dict], dict]:
        sd = self.optim.state_dict()
        sharded: dict[int, dict] = {}
        replicated: dict[int, dict] = {}
        for i, p in enumerate(self.params):
            sharded[i], replicated[i] = {}, {}
            for key, value in sd["state"].get(i, {}).items():
                if (torch.is_tensor(value) and value.shape == p.shape and p.dim() > 0
                        and key != "step"):
                    sharded[i][key] = value.reshape(-1)
                else:
                    replicated[i][key] = value
        return sharded, replicated, sd["param_groups"], {}

    def load_checkpoint_state(self, sharded: dict, replicated: dict, param_groups: list[dict],
                              extra: dict) -> None:
        state: dict[int, dict] = {}
        for i, p in enumerate(self.params):
            entry = dict(replicated.get(i, {}))
            for key, piece in sharded.get(i, {}).items():
                if key == "master_param":  # saved by a master-weight optimizer: exact weights
                    with torch.no_grad():
                        p.copy_(piece.view(p.shape))
                else:
                    entry[key] = piece.view(p.shape)
            if entry:
                state[i] = entry
        self.optim.load_state_dict({"state": state, "param_groups": param_groups})
