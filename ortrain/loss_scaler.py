"""The loss scale the backward is seeded with, and the rule that moves it.

The gradient graph differentiates ``loss * scale``; the update graph unscales, checks
that every gradient is finite and, if not, leaves parameters and optimizer state as
they were (``graph_passes/precision/loss_scaling.py``, ``optimizer/update_graph.py``). The host
only moves the scale, after each update, from the graph's ``grads_finite`` flag:

- dynamic (DeepSpeed's / torch GradScaler's rule): start at ``initial`` (2^16); after
  ``window`` consecutive finite updates multiply by ``factor``; after ``hysteresis``
  overflows (consecutive or not, since the last change) divide by it, never below
  ``min_scale``;
- static: one fixed scale; overflowing steps are still skipped.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Settings of dynamic loss scaling (``TrainerOptions(loss_scale=...)``)."""

    initial: float = 2.0**16
    window: int = 2000  # finite updates before the scale grows
    factor: float = 2.0
    min_scale: float = 1.0
    hysteresis: int = 1  # overflows tolerated before the scale shrinks (DeepSpeed: 2)

    def __post_init__(self) -> None:
        if not self.initial > 0:
            raise ValueError(f"DynamicLossScale.initial must be > 0, got {self.initial}")
        if self.window < 1:
            raise ValueError(f"DynamicLossScale.window must be >= 1, got {self.window}")
        if not self.factor > 1:
            raise ValueError(f"DynamicLossScale.factor must be > 1, got {self.factor}")
        if not 0 < self.min_scale <= self.initial:
            raise ValueError(
                f"DynamicLossScale.min_scale must be in (0, initial], got {self.min_scale}"
            )
        if self.hysteresis < 1:
            raise ValueError(f"DynamicLossScale.hysteresis must be >= 1, got {self.hysteresis}")


class LossScaler:
    """Current scale plus the counters of the dynamic rule (``config`` None: static)."""

    def __init__(self, scale: float, config: DynamicLossScale | None = None):
        self.scale = float(scale)
        self.config = config
        self.good_steps = 0  # finite updates since the last growth or overflow
        self.overflows_left = config.hysteresis if config is not None else 1
        self.skipped_steps = 0

    @classmethod
    def from_option(cls, option: Any) -> LossScaler:
        if isinstance(option, DynamicLossScale):
            return cls(option.initial, option)
        if option == "dynamic":
            return cls(DynamicLossScale().initial, DynamicLossScale())
        return cls(float(option))

    @property
    def dynamic(self) -> bool:
        return self.config is not None

    def update(self, finite: bool) -> None:
        """Record one update's outcome; the next step uses the new ``scale``."""
        cfg = self.config
        if not finite:
            self.skipped_steps += 1
            self.good_steps = 0
            if cfg is None:
                return
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale / cfg.factor, cfg.min_scale)
                self.overflows_left = cfg.hysteresis
            return
        if cfg is None:
            return
        self.good_steps += 1
        if self.good_steps >= cfg.window:
            self.scale *= cfg.factor
            self.good_steps = 0
            self.overflows_left = cfg.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "overflows_left": self.overflows_left,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.overflows_left = int(state["overflows_left"])
        self.skipped_steps = int(state["skipped_steps"])
