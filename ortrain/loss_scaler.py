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

A scale that cannot move any more (static, or dynamic at ``min_scale``) while every update
overflows would skip all of training without a word: after ``SKIPPED_WARNING_AFTER``
skipped updates in a row, the scaler says so once, naming the scale.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

# updates skipped in a row, at a scale that no longer moves, before the scaler says so
SKIPPED_WARNING_AFTER = 10


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
        self.skipped_in_a_row = 0  # this process's: not part of the saved state
        self._warned = False

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
            self.skipped_in_a_row += 1
            self.good_steps = 0
            if cfg is not None:
                self.overflows_left -= 1
                if self.overflows_left <= 0:
                    self.scale = max(self.scale / cfg.factor, cfg.min_scale)
                    self.overflows_left = cfg.hysteresis
            self._warn_if_stuck()
            return
        self.skipped_in_a_row = 0
        if cfg is None:
            return
        self.good_steps += 1
        if self.good_steps >= cfg.window:
            self.scale *= cfg.factor
            self.good_steps = 0
            self.overflows_left = cfg.hysteresis

    def _warn_if_stuck(self) -> None:
        cfg = self.config
        stuck = cfg is None or self.scale <= cfg.min_scale
        if self._warned or not stuck or self.skipped_in_a_row < SKIPPED_WARNING_AFTER:
            return
        self._warned = True
        if cfg is None:
            why = (
                f"at the static loss scale {self.scale:g}; lower it, or use "
                "loss_scale='dynamic' (it halves on overflow)"
            )
        else:
            why = (
                f"even at the loss scale {self.scale:g} (DynamicLossScale.min_scale): the "
                "loss or the model itself gives infinite or NaN gradients"
            )
        warnings.warn(
            f"ortrain: the last {self.skipped_in_a_row} updates were all skipped, their "
            f"gradients overflowing {why}; the parameters have not changed since",
            RuntimeWarning,
            stacklevel=6,  # the caller of ORTTrainer.train_step
        )

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
