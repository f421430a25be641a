"""``overlap_allgather``: the post-step parameter all-gather overlapped with the next forward.

Without it, ``ZeroOptimizer.step()`` all-gathers every updated parameter and unpacks it
before returning: on 4×H200 (LLaMA2-7B, ZeRO-2) that all-gather ran with no compute beside it,
93 ms of a 611 ms step with BF16 parameters and 199 ms with FP8 (BENCHMARKS.md, "4 GPUs").
With it, ``step()`` only launches the buckets, in parameter order (a bucket of small tensors
goes out with the large one that fills, not at the end); each module unpacks the buckets holding
its own parameters (and the ones launched before them) in a forward pre-hook, so the
all-gathers of later layers run while earlier layers compute. ``LowLevelZeroPlugin
(overlap_allgather=True)`` turns it on; Colossal-AI's argument of the same name maps to it.

What changes for the user: between ``step()`` and the next forward, the working parameters
still hold their old values. ``state_dict()`` and ``load_state_dict()`` of any module, and the
optimizer's next ``step()`` or ``load_state_dict()``, finish the gathers first; code that reads
or writes parameters directly in between calls ``optimizer.wait_params()`` (re-reading masters
from parameters written while a gather is pending raises, naming it). All gathered buckets
exist at once until unpacked: one more copy of the parameters, in their wire dtype (FP8 with
``fp8_communication``).

The forward hooks sit on the repeated blocks (``fp8boost.hf_model.find_blocks``, the modules
``compile_blocks`` compiles) and on the modules outside them, and run eagerly
(``torch._disable_dynamo(recursive=True)``, as FSDP2's hooks do): dynamo calls them without
tracing them, so each compiled block is still one graph.

Example:
    >>> import torch
    >>> gather = OverlappedGather()
    >>> gather.bind(torch.nn.Linear(2, 2), params=[])  # hooks on the modules that own params
    >>> gather.wait()  # nothing launched yet: a no-op
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fp8boost.hf_model import find_blocks

from .buckets import LaunchedGathers


class OverlappedGather:
    """The launched, not yet unpacked, parameter all-gather of the last step, and the hooks
    that unpack it as the forward reaches each module."""

    def __init__(self) -> None:
        self._launched: Optional[LaunchedGathers] = None
        self._handles: list = []

    def hold(self, launched: Optional[LaunchedGathers]) -> None:
        """Keep ``launched`` for the hooks (the previous step's gathers must be finished)."""
        if self.pending:
            raise RuntimeError("overlap_allgather: the previous step's all-gather is still "
                               "pending; wait() before launching the next")
        self._launched = launched

    @property
    def pending(self) -> bool:
        """Whether a launched bucket is still to unpack."""
        return self._launched is not None and self._launched.pending

    def wait(self, indices: Optional[list[int]] = None) -> None:
        """Unpack the buckets holding parameters ``indices`` (optimizer indices) and the ones
        launched before them; every bucket when None."""
        if self._launched is not None:
            self._launched.finish(indices)
            if not self._launched.pending:
                self._launched = None

    def bind(self, model: nn.Module, params: list[torch.Tensor]) -> None:
        """Hook ``model`` so that the parameters among ``params`` (the optimizer's list) are
        unpacked before they are used: before the forward of each repeated block (all of its
        parameters) and of each other module owning some, and before any owning module's
        ``state_dict`` and ``load_state_dict``.

        Forward hooks sit on the blocks, not inside them: ``compile_blocks`` compiles each
        block, and dynamo runs a disabled hook of a module inside a compiled block by
        splitting the block's graph there.
        """
        index = {id(p): i for i, p in enumerate(params)}

        def owned_by(module: nn.Module, recurse: bool) -> list[int]:
            return sorted({index[id(p)] for p in module.parameters(recurse=recurse)
                           if id(p) in index})

        in_blocks: set[int] = set()
        for block in find_blocks(model):
            in_blocks.update(id(m) for m in block.modules())
            owned = owned_by(block, True)
            if owned:
                self._handles.append(block.register_forward_pre_hook(self._forward_hook(owned)))
        for module in model.modules():
            owned = owned_by(module, False)
            if not owned:
                continue
            if id(module) not in in_blocks:
                self._handles.append(module.register_forward_pre_hook(
                    self._forward_hook(owned)))
            self._handles.append(module.register_state_dict_pre_hook(self._state_hook(owned)))
            # before weights are loaded into it: the pending gather must not land on them later
            self._handles.append(module.register_load_state_dict_pre_hook(
                self._state_hook(owned)))

    def remove_hooks(self) -> None:
        """Detach every hook :meth:`bind` registered."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _forward_hook(self, owned: list[int]):
        @torch._disable_dynamo(recursive=True)  # run eagerly, not traced (as FSDP2's hooks)
        def hook(_module, _args) -> None:
            if self._launched is not None:
                self.wait(owned)
        return hook

    def _state_hook(self, owned: list[int]):
        def hook(*_args) -> None:  # state_dict's and load_state_dict's pre-hook signatures
            if self._launched is not None:
                self.wait(owned)
        return hook
