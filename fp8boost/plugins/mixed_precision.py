"""``Booster(mixed_precision=...)`` without a plugin: one process, no data parallelism.

* ``"fp32"`` / None: the model as is; the optimizer gets ``backward``/clipping only.
* ``"bf16"`` / ``"fp16"``: parameters cast to BF16/FP16, FP32 master weights kept by the
  optimizer wrapper (FP16 adds dynamic loss scaling); floating inputs are cast on the way in.
* ``"fp8"``: ``"bf16"`` plus ``convert_to_fp8`` (eligible linears run their GEMMs in FP8).
  On a machine without FP8 tensor cores the default ``Fp8Config(backend="auto")`` falls back
  to the emulated backend with a one-time warning.

Defined beside ``LocalPlugin``, which trains it; ``fp8boost.booster`` re-exports it (the
booster holds a plugin, the plugins know nothing of the booster).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from fp8boost.fp8.config import Fp8Config
from fp8boost.loss.causal_lm import FusedLmLossConfig, resolve_fused_lm_loss
from .options import check_fp8_config, check_max_norm, check_precision
from .precision import MIXED_PRECISIONS


@dataclass(frozen=True)
class MixedPrecision:
    """A mixed-precision choice for ``Booster`` with options a bare string cannot carry.

    Example:
        >>> from fp8boost.booster import Booster, MixedPrecision
        >>> from fp8boost.fp8 import Fp8Config
        >>> booster = Booster(mixed_precision=MixedPrecision("fp8", Fp8Config(backend="emulated")))
    """

    precision: str = "bf16"
    """"fp32", "bf16", "fp16" or "fp8" (see the module docstring; trained by
    ``fp8boost.plugins.local_plugin.LocalPlugin``)."""
    fp8_config: Optional[Fp8Config] = None
    """The FP8 recipe for ``"fp8"`` (default ``Fp8Config()``)."""
    max_norm: float = 0.0
    """Clip gradients to this global norm at every step (0 disables)."""
    fused_master_step: Optional[bool] = None
    """For ``"bf16"``/``"fp8"`` with ``torch.optim.AdamW`` (or ``Adam`` without coupled weight
    decay): update the FP32 master from the BF16 gradient and write the BF16 parameter in one
    kernel per tensor, skipping the two dtype copies of the two-pass master-weight step (1.08x
    a compiled 7B-shaped BF16 step on one H100, 1.09x FP8; BENCHMARKS.md 4f). None (default):
    wherever it applies, else the two-pass step without a word; True: a one-time warning says
    why when it cannot apply; False: always the two-pass step."""

    fused_lm_loss: Union[bool, FusedLmLossConfig] = True
    """Fuse an HF causal LM's lm_head with its loss, without the logits; forwards with labels
    in training then return ``logits=None`` (``PluginOptions.fused_lm_loss`` says when it
    applies and why it is on by default)."""

    fused_norm: bool = False
    """Run HF's Llama-formula RMSNorms through ``F.rms_norm`` in eager mode
    (``PluginOptions.fused_norm``)."""

    def __post_init__(self) -> None:
        check_precision(self.precision, MIXED_PRECISIONS)
        if not isinstance(self.fused_norm, bool):
            raise TypeError(f"MixedPrecision.fused_norm must be True or False, got "
                            f"{self.fused_norm!r}")
        resolve_fused_lm_loss(self.fused_lm_loss)  # raises TypeError on anything else
        check_fp8_config(self.fp8_config)
        object.__setattr__(self, "max_norm", check_max_norm(self.max_norm))
        if self.fused_master_step is not None and not isinstance(self.fused_master_step, bool):
            raise TypeError("MixedPrecision.fused_master_step must be None, True or False, got "
                            f"{type(self.fused_master_step).__name__}")
