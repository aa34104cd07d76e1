"""BatchNormalization: training mode (batch statistics) and inference mode."""

from __future__ import annotations
