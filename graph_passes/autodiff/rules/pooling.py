"""Pooling and spatial ops: MaxPool, AveragePool, global pools, ConvTranspose, Resize."""

from __future__ import annotations
