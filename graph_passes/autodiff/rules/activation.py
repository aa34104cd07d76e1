"""Activations and unary math: Clip, Softplus, Elu, LeakyRelu, HardSwish, Mish, trigonometry, ..."""

from __future__ import annotations
