"""Optimizers: ortrain.optim.Lamb."""

from ortrain.optim.lamb import Lamb

__all__ = ["Lamb"]
