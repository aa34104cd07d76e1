"""ONNX LSTM / GRU / RNN nodes unrolled into standard ops before autodiff (to be written)."""

from __future__ import annotations

import onnx_ir as ir


def unroll_rnns(model: ir.Model) -> int:
    """Replace each LSTM / GRU / RNN node; returns how many were replaced."""
    return 0
