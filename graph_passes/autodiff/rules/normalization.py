"""Normalizations beyond LayerNorm: BatchNormalization, InstanceNormalization, GroupNorm."""

from __future__ import annotations
