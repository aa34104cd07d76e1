"""Normalizations beyond LayerNorm: InstanceNormalization, GroupNormalization."""

from __future__ import annotations
