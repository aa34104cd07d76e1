"""``nn.LSTM(proj_size=...)`` exported as its steps (a translation of ``aten::lstm``).

The exporter's own ``aten::lstm`` function writes one ONNX ``LSTM`` node per layer, an op
without a projection: given a projected LSTM's five weights per layer and direction, it
takes them four at a time and its node's shapes disagree (ortrain's RNN unrolling then
refused it and the module ran in eager). Here a projected LSTM is written out step by
step as torch computes it (gates ``i, f, g, o``; ``c = f * c + i * g``;
``h = (o * tanh(c)) @ W_hr^T``), over the static sequence length, layer by layer and
direction by direction; its ops are ones the rule table differentiates. An LSTM
without a projection keeps the exporter's function (``graph_passes/prepare/unroll_rnn.py``
unrolls its node). Dropout between the layers of a training call is an ONNX ``Dropout``,
as the exporter writes it for an LSTM without a projection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _lstm(
    input: Any,
    hx: Sequence[Any],
    params: Sequence[Any],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
) -> Any:
    from onnxscript.function_libs.torch_lib.ops.core import aten_lstm

    dirs = 2 if bidirectional else 1
    per = 4 if has_biases else 2  # w_ih, w_hh (, b_ih, b_hh)
    projected = len(params) == num_layers * dirs * (per + 1)  # and w_hr
    shape = input.shape
    static = shape is not None and all(isinstance(d, int) for d in shape)
    if not projected or not static:
        return aten_lstm(
            input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first
        )
    drop = dropout if train else 0.0
    return _projected(input, hx, params, has_biases, num_layers, dirs, batch_first, drop)


def _projected(
    input: Any,
    hx: Sequence[Any],
    params: Sequence[Any],
    has_biases: bool,
    num_layers: int,
    dirs: int,
    batch_first: bool,
    dropout: float,
) -> tuple[Any, Any, Any]:
    from onnxscript import opset18 as op

    per = 5 if has_biases else 3
    x = op.Transpose(input, perm=[1, 0, 2]) if batch_first else input  # time-major
    steps = list(input.shape)[1 if batch_first else 0]
    h0, c0 = hx
    first = op.Constant(value_ints=[0])
    h_last, c_last = [], []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            w_ih, w_hh, *rest = params[k * per : (k + 1) * per]
            w_hr = rest[-1]
            xs = op.MatMul(x, op.Transpose(w_ih, perm=[1, 0]))  # every step's at once
            if has_biases:
                xs = op.Add(xs, op.Add(rest[0], rest[1]))
            w_hh_t, w_hr_t = op.Transpose(w_hh, perm=[1, 0]), op.Transpose(w_hr, perm=[1, 0])
            index = op.Constant(value_int=k)
            h, c = op.Gather(h0, index, axis=0), op.Gather(c0, index, axis=0)
            ys: list[Any] = [None] * steps
            for t in reversed(range(steps)) if d else range(steps):
                gates = op.Add(
                    op.Gather(xs, op.Constant(value_int=t), axis=0), op.MatMul(h, w_hh_t)
                )
                i, f, g, o = _quarters(op, gates)
                c = op.Add(op.Mul(op.Sigmoid(f), c), op.Mul(op.Sigmoid(i), op.Tanh(g)))
                h = op.MatMul(op.Mul(op.Sigmoid(o), op.Tanh(c)), w_hr_t)
                ys[t] = op.Unsqueeze(h, first)
            outs.append(op.Concat(*ys, axis=0))
            h_last.append(op.Unsqueeze(h, first))
            c_last.append(op.Unsqueeze(c, first))
        x = outs[0] if dirs == 1 else op.Concat(*outs, axis=-1)
        if dropout > 0 and layer < num_layers - 1:  # as the exporter writes it between layers
            x, _ = op.Dropout(x, dropout, True)
    y = op.Transpose(x, perm=[1, 0, 2]) if batch_first else x
    return y, op.Concat(*h_last, axis=0), op.Concat(*c_last, axis=0)


def _quarters(op: Any, gates: Any) -> list[Any]:
    """``gates`` cut into its four equal parts along the last axis (torch's i, f, g, o)."""
    width = list(gates.shape)[-1] // 4 if gates.shape is not None else None
    if width is None:
        return list(op.Split(gates, axis=-1, num_outputs=4))
    axis = op.Constant(value_ints=[-1])
    return [
        op.Slice(
            gates,
            op.Constant(value_ints=[q * width]),
            op.Constant(value_ints=[(q + 1) * width]),
            axis,
        )
        for q in range(4)
    ]


def lstm_translations() -> dict[Any, Any]:
    import torch

    return {torch.ops.aten.lstm.input: _lstm}
