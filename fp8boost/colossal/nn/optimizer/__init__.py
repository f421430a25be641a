"""``colossalai.nn.optimizer``: ``HybridAdam`` as a torch AdamW.

Colossal-AI's HybridAdam runs Adam on CPU-offloaded parameters with its own kernels. Here it
is ``torch.optim.AdamW`` with Colossal-AI's constructor: a normal torch optimizer that every
fp8boost plugin accepts (offloading is the plugins' ``cpu_offload`` option).

Example:
    >>> import torch
    >>> from fp8boost.colossal.nn.optimizer import HybridAdam
    >>> opt = HybridAdam(torch.nn.Linear(2, 2).parameters(), lr=1e-3, weight_decay=0.1)
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Tuple

import torch

__all__ = ["HybridAdam"]


class HybridAdam(torch.optim.AdamW):
    """Adam/AdamW with Colossal-AI's ``HybridAdam`` signature, on torch's implementation.

    ``adamw_mode=True`` (default) is torch ``AdamW`` (decoupled weight decay);
    ``adamw_mode=False`` is torch ``Adam`` (L2 weight decay added to the gradient). Each step
    uses torch's fused kernel when every parameter of a group is a plain CUDA tensor, else the
    foreach implementation (the choice is made at ``step``, because Colossal-AI scripts build
    the optimizer before the Booster moves the model to the GPU). ``**defaults`` are torch's
    Adam keywords (``amsgrad``, ``maximize``, ``foreach``, ``fused``...); an explicit
    ``foreach``/``fused`` there wins over the automatic choice.

    Args:
        model_params: the parameters or parameter groups.
        lr: learning rate.
        bias_correction: must be True (torch's Adam always corrects the moments' bias).
        betas: the moments' decay rates.
        eps: added to the denominator.
        weight_decay: decoupled (``adamw_mode``) or L2 weight decay.
        adamw_mode: decoupled weight decay (AdamW) or L2 (Adam).
        nvme_offload_fraction: must be 0 (no NVMe offload; see Raises).
        nvme_offload_dir: must be None.
        **defaults: further torch Adam keywords.

    Raises:
        ValueError: NVMe offload or ``bias_correction=False`` was asked for.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = HybridAdam(model.parameters(), lr=1e-2)
        >>> model(torch.ones(1, 4)).sum().backward(); opt.step()
    """

    def __init__(self, model_params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, adamw_mode: bool = True,
                 nvme_offload_fraction: float = 0.0, nvme_offload_dir: Optional[str] = None,
                 **defaults: Any) -> None:
        if nvme_offload_fraction or nvme_offload_dir is not None:
            raise ValueError(
                "HybridAdam: NVMe offload (nvme_offload_fraction/nvme_offload_dir) is not "
                "supported by fp8boost; offload optimizer state to the CPU with the plugins' "
                "offload options instead (LowLevelZeroPlugin(cpu_offload=True), "
                "GeminiPlugin(offload_optim_frac=...)/its placement options)")
        if not bias_correction:
            raise ValueError("HybridAdam: bias_correction=False is not supported (torch's "
                             "Adam always corrects the moments' bias)")
        defaults.pop("decoupled_weight_decay", None)  # adamw_mode decides it
        # Automatic fused/foreach choice at step() unless the caller named one.
        self._auto_impl = "fused" not in defaults and "foreach" not in defaults
        self.adamw_mode = adamw_mode
        # torch.optim.Adam's constructor (not AdamW's, which forces decoupled decay on).
        torch.optim.Adam.__init__(self, model_params, lr=lr, betas=betas, eps=eps,
                                  weight_decay=weight_decay, decoupled_weight_decay=adamw_mode,
                                  **defaults)

    def __setstate__(self, state: dict) -> None:
        # AdamW.__setstate__ turns decoupled decay on in every group; keep adamw_mode's choice.
        torch.optim.Adam.__setstate__(self, state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = self.__dict__.get("adamw_mode", True)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        """One Adam/AdamW step (fused kernel when a group is all CUDA, else foreach)."""
        if self.__dict__.get("_auto_impl", False):
            for group in self.param_groups:
                fused = _fusable(group["params"])
                group["fused"], group["foreach"] = fused, not fused
                if fused:
                    self._steps_beside_params(group)
        return super().step(closure)

    def _steps_beside_params(self, group: dict) -> None:
        # torch keeps `step` on the CPU for foreach and on the parameter's device (float32)
        # for fused; a state made before the switch (steps taken on the CPU, or a checkpoint
        # loaded before the first step) would otherwise mix devices in the fused kernel.
        for p in group["params"]:
            state = self.state.get(p)
            step = state.get("step") if state else None
            if isinstance(step, torch.Tensor) and step.device != p.device:
                state["step"] = step.to(device=p.device, dtype=torch.float32)


def _fusable(params: Iterable[torch.Tensor]) -> bool:
    """Whether torch's fused Adam takes these parameters: plain floating CUDA tensors (a
    tensor subclass such as DTensor, or a CPU parameter, goes through foreach)."""
    params = list(params)
    return bool(params) and all(
        p.is_cuda and p.dtype.is_floating_point and type(p.data) is torch.Tensor
        for p in params)
