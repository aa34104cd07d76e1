"""Reductions beyond Sum/Mean: Max/Min (ties split as torch), L1/L2, LogSumExp, Prod, CumSum."""

from __future__ import annotations
