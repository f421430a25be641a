"""Dynamic loss scaling for FP16 training (BF16 and FP32 need none).

The loss is multiplied by ``scale`` before backward so small FP16 gradients do not flush to
zero; gradients are divided by it again before the optimizer step. A step whose gradients hold
an Inf or NaN (on any rank) is skipped and the scale is cut by ``backoff_factor``; after
``growth_interval`` clean steps in a row the scale grows by ``growth_factor``.
"""
from __future__ import annotations


class DynamicLossScaler:
    """Loss scale bookkeeping (the caller finds the overflows and skips the step).

    Args:
        initial_scale: starting scale (a power of two keeps scaling exact).
        growth_factor: multiply the scale by this after ``growth_interval`` clean steps.
        backoff_factor: multiply the scale by this after an overflow.
        growth_interval: clean steps in a row before growing.
        min_scale: the scale never drops below this.
        max_scale: the scale never grows above this.

    Example:
        >>> s = DynamicLossScaler(initial_scale=1024, growth_interval=2)
        >>> s.update(found_inf=True); s.scale
        512.0
        >>> s.update(False); s.update(False); s.scale
        1024.0
    """

    def __init__(self, initial_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000,
                 min_scale: float = 1.0, max_scale: float = 2.0 ** 32) -> None:
        if not initial_scale > 0:
            raise ValueError(f"initial_scale must be > 0, got {initial_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval}")
        if not 0 < min_scale <= initial_scale <= max_scale:
            raise ValueError("need 0 < min_scale <= initial_scale <= max_scale, got "
                             f"{min_scale}, {initial_scale}, {max_scale}")
        self.scale = float(initial_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        """Record one step's outcome and adjust the scale."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
