"""ONNX ``LSTM`` / ``GRU`` / ``RNN`` nodes unrolled into standard ops before autodiff.

The recurrent ops have no gradient rule; over the static sequence length they are a
chain of products and gate activations that the rule table differentiates, and the
forward stays what ONNX Runtime's kernels compute. Per direction: one ``Gemm`` projects
the inputs of every step at once (both biases folded in, except GRU's recurrent h bias,
which the reset gate scales when ``linear_before_reset``), one ``Split`` cuts it into
steps, then per step a ``Gemm`` adds the recurrent product and the gates follow as
element-wise ops. ``Y`` is a ``Concat`` of the step outputs, ``Y_h`` / ``Y_c`` the last
states; only outputs something reads are built. Every node is unrolled, on a path to
the loss or not. The dynamo exporter writes ``nn.LSTM`` / ``nn.GRU`` as one such node
per layer (dropout between layers as an ONNX ``Dropout``) and ``nn.RNN`` already as
MatMuls and activations; evaluation graphs keep the nodes (ONNX Runtime runs them).

Cases handled:
1. ``LSTM`` (gates i, o, f, c), ``GRU`` (z, r, h) and ``RNN``.
2. ``direction`` forward, reverse (steps from the last to the first; ``Y`` in time
   order) and bidirectional.
3. ``layout`` 0 (time-major) and 1 (batch-major).
4. ``B``, ``initial_h`` and ``initial_c`` given or absent; an absent or all-zero constant
   state makes the first step skip its recurrent product (exact: it adds zeros).
5. GRU ``linear_before_reset`` 1 (torch's) and 0.
6. Activations: LSTM's and GRU's defaults (absent, or listed per direction as ONNX
   Runtime wants them); RNN ``Tanh`` or ``Relu`` per direction.
7. ``sequence_lens`` absent, or a constant whose lengths all equal the sequence length.

Refused with a ``GradientError`` naming the op, the node and the attribute: ``clip``,
``input_forget``, peepholes ``P``, any other activation (or ``activation_alpha`` /
``activation_beta``), ``sequence_lens`` that is not constant or shorter than the
sequence, operands without static shapes or of inconsistent shapes (what the exporter's
own function writes for ``nn.LSTM(proj_size=...)``, which ``ortrain/export_lstm.py``
writes out step by step instead, except with dropout between a training call's layers).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from ortrain.core.names import GradientError
from ortrain.graph_passes.autodiff.builder import describe
from ortrain.graph_passes.infra.constant_value import constant_tensor
from ortrain.graph_passes.infra.emitter import Emitter

_STD = ("", "ai.onnx")
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_DEFAULT_ACTIVATIONS = {"LSTM": ("sigmoid", "tanh", "tanh"), "GRU": ("sigmoid", "tanh")}
_RNN_ACTIVATIONS = {"tanh": "Tanh", "relu": "Relu"}
_State = ir.Value | None  # None: zeros (an absent or all-zero state, no bias)


def unroll_rnns(model: ir.Model) -> int:
    """Replace each LSTM / GRU / RNN node; returns how many were replaced."""
    count = 0
    for node in list(model.graph):
        if node.op_type in _GATES and node.domain in _STD:
            _unroll(model, node, count)
            count += 1
    return count


@dataclasses.dataclass
class _Cell:
    """One recurrent node's static description."""

    op: str
    hidden: int
    seq: int
    batch: int
    layout: int
    reverse: list[bool]  # per direction
    activations: list[str]  # RNN: the ONNX op per direction
    linear_before_reset: bool


def _refuse(node: ir.Node, what: str) -> GradientError:
    return GradientError(f"{describe(node)}: {what} is not supported by ortrain's RNN unrolling")


def _shape(node: ir.Node, v: ir.Value, what: str) -> tuple[int, ...]:
    if v.shape is None or not all(isinstance(d, int) for d in v.shape.dims):
        raise _refuse(node, f"input {what} without a static shape ({v.shape})")
    return tuple(int(d) for d in v.shape.dims)


def _input(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if len(node.inputs) > i else None


def _attr(node: ir.Node, name: str, default: object = None) -> object:
    a = node.attributes.get(name)
    return default if a is None else a.value


def _describe_cell(model: ir.Model, node: ir.Node) -> _Cell:
    """Check what is supported; raise naming the first attribute that is not."""
    op = node.op_type
    if model.opset_imports.get("", 1) < 13:
        raise _refuse(node, "a model opset below 13 (Split with a split input)")
    if _attr(node, "clip") is not None:
        raise _refuse(node, "attribute 'clip'")
    if int(_attr(node, "input_forget", 0)):  # type: ignore[arg-type]
        raise _refuse(node, "attribute 'input_forget'")
    if op == "LSTM" and _input(node, 7) is not None:
        raise _refuse(node, "input P (peepholes)")
    for name in ("activation_alpha", "activation_beta"):
        if _attr(node, name) is not None:
            raise _refuse(node, f"attribute '{name}'")
    layout = int(_attr(node, "layout", 0))  # type: ignore[arg-type]
    direction = str(_attr(node, "direction", "forward"))
    reverse = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}.get(direction)
    if reverse is None or layout not in (0, 1):
        raise _refuse(node, f"direction {direction!r} / layout {layout}")
    x, w, r = (_shape(node, node.inputs[i], n) for i, n in enumerate("XWR"))
    if len(x) != 3 or min(x) < 1:
        raise _refuse(node, f"input X of shape {x}")
    seq, batch = (x[0], x[1]) if layout == 0 else (x[1], x[0])
    hidden = r[-1]
    gh = _GATES[op] * hidden
    if int(_attr(node, "hidden_size", hidden)) != hidden:  # type: ignore[arg-type]
        raise _refuse(node, f"attribute 'hidden_size' {_attr(node, 'hidden_size')} != R's {r}")
    if w != (len(reverse), gh, x[2]) or r != (len(reverse), gh, hidden):
        raise _refuse(node, f"shapes X {x}, W {w}, R {r} (inconsistent)")
    state = (len(reverse), batch, hidden) if layout == 0 else (batch, len(reverse), hidden)
    expected = {3: ("B", (len(reverse), 2 * gh)), 5: ("initial_h", state), 6: ("initial_c", state)}
    for i, (what, shape) in expected.items():
        v = _input(node, i)
        if v is not None and (i != 6 or op == "LSTM") and _shape(node, v, what) != shape:
            # torch exports nn.LSTM(proj_size=p) as a hidden_size=p LSTM, c still full size
            hint = " (nn.LSTM with proj_size?)" if i == 6 else ""
            got = _shape(node, v, what)
            raise _refuse(node, f"input {what} of shape {got} (expected {shape}){hint}")
    _check_sequence_lens(node, seq)
    acts = [str(a).lower() for a in (_attr(node, "activations") or [])]  # type: ignore[union-attr]
    if op == "RNN":
        acts = acts or ["tanh"] * len(reverse)
        if len(acts) != len(reverse) or any(a not in _RNN_ACTIVATIONS for a in acts):
            raise _refuse(node, f"activations {acts} (Tanh or Relu per direction)")
        acts = [_RNN_ACTIVATIONS[a] for a in acts]
    elif acts and acts != list(_DEFAULT_ACTIVATIONS[op]) * len(reverse):
        raise _refuse(node, f"activations {acts} (the defaults, per direction, only)")
    lbr = bool(int(_attr(node, "linear_before_reset", 0)))  # type: ignore[arg-type]
    return _Cell(op, hidden, seq, batch, layout, reverse, acts, lbr)


def _check_sequence_lens(node: ir.Node, seq: int) -> None:
    lens = _input(node, 4)
    if lens is None:
        return
    t = constant_tensor(lens)
    if t is None:
        raise _refuse(node, "input sequence_lens that is not a constant")
    if not np.all(np.asarray(t.numpy()) == seq):
        raise _refuse(node, f"sequence_lens {np.asarray(t.numpy()).tolist()} shorter than {seq}")


def _zero_or_none(v: ir.Value | None) -> bool:
    """Absent, or a constant of zeros (torch's default initial states)."""
    t = constant_tensor(v)
    return v is None or (t is not None and not np.asarray(t.numpy()).any())


class _Builder:
    """Emits the unrolled ops of one node."""

    def __init__(self, em: Emitter, cell: _Cell) -> None:
        self.em, self.cell = em, cell
        self.H = cell.hidden
        self.B = cell.batch

    def op(self, op_type: str, *inputs: ir.Value | None, shape: list[int], **attrs) -> ir.Value:
        return self.em.op(op_type, *inputs, shape=list(shape), **attrs)

    def split(self, v: ir.Value, sizes: list[int], axis: int, shape: list[int]) -> list[ir.Value]:
        outs = self.em.op_multi("Split", v, self.em.ints(sizes), axis=axis, num_outputs=len(sizes))
        for out, size in zip(outs, sizes):
            out.dtype = v.dtype
            out.shape = ir.Shape([size if d == axis else n for d, n in enumerate(shape)])
        return list(outs)

    def reshape(self, v: ir.Value, shape: list[int]) -> ir.Value:
        return self.op("Reshape", v, self.em.ints(list(shape)), shape=shape)

    def per_direction(self, v: _State, axis: int, shape: list[int], part: list[int]) -> list:
        """``v`` with its direction axis taken apart: one value of ``part`` per direction."""
        if v is None:
            return [None] * len(self.cell.reverse)
        if len(self.cell.reverse) == 1:
            return [self.reshape(v, part)]
        return [self.reshape(p, part) for p in self.split(v, [1, 1], axis, shape)]

    def add(self, a: _State, b: _State, shape: list[int]) -> _State:
        if a is None or b is None:
            return a if b is None else b
        return self.op("Add", a, b, shape=shape)

    def gemm(self, a: _State, w: ir.Value, c: _State, shape: list[int]) -> _State:
        """``a @ w^T + c``; ``a`` None (a zero state): ``c`` alone."""
        if a is None:
            return c
        return self.op("Gemm", a, w, *([c] if c is not None else []), transB=1, shape=shape)


def _unroll(model: ir.Model, node: ir.Node, index: int) -> None:
    cell = _describe_cell(model, node)
    em = Emitter(model.graph, node.name or f"{node.op_type}_{index}", dict(node.metadata_props))
    b = _Builder(em, cell)
    x, w, r = node.inputs[:3]
    bias, h0 = _input(node, 3), _input(node, 5)
    c0 = _input(node, 6) if cell.op == "LSTM" else None
    d, gh, seq, n = len(cell.reverse), _GATES[cell.op] * cell.hidden, cell.seq, cell.batch
    x_shape = list(x.shape.dims)  # type: ignore[union-attr]
    if cell.layout == 1:  # time-major, so each step's rows are contiguous
        x_shape = [x_shape[1], x_shape[0], x_shape[2]]
        x = b.op("Transpose", x, perm=[1, 0, 2], shape=x_shape)
    x2 = b.reshape(x, [seq * n, x_shape[2]])
    ws = b.per_direction(w, 0, [d, gh, x_shape[2]], [gh, x_shape[2]])
    rs = b.per_direction(r, 0, [d, gh, cell.hidden], [gh, cell.hidden])
    bs = b.per_direction(bias, 0, [d, 2 * gh], [2 * gh])
    state_axis = 0 if cell.layout == 0 else 1
    state_shape = [d, n, cell.hidden] if cell.layout == 0 else [n, d, cell.hidden]
    part = [n, cell.hidden]
    hs = b.per_direction(None if _zero_or_none(h0) else h0, state_axis, state_shape, part)
    cs = b.per_direction(None if _zero_or_none(c0) else c0, state_axis, state_shape, part)
    ys, last_h, last_c = [], [], []
    for k in range(d):
        steps = _Direction(b, cell, ws[k], rs[k], bs[k])
        y, h, c = steps.run(x2, hs[k], cs[k], cell.reverse[k], k)
        ys.append(y)
        last_h.append(h)
        last_c.append(c)
    built = {0: lambda: _sequence_output(b, ys), 1: lambda: _state_output(b, last_h)}
    built[2] = lambda: _state_output(b, last_c)
    outs = {}
    for i, old in enumerate(node.outputs):
        if old.name and (old.uses() or old.is_graph_output()):
            outs[i] = built[i]()
    em.flush_before(node)
    for i, new in outs.items():
        old = node.outputs[i]
        name, typ = old.name, old.type
        old.name = f"{name}__rnn"
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        new.name, new.type = name, typ or new.type
    model.graph.remove(node, safe=True)


class _Direction:
    """The steps of one direction: the input projection, then the cell per step."""

    def __init__(
        self, b: _Builder, cell: _Cell, w: ir.Value, r: ir.Value, bias: ir.Value | None
    ) -> None:
        self.b, self.cell, self.w, self.r = b, cell, w, r
        self.H, self.N = cell.hidden, cell.batch
        H = self.H
        gh = _GATES[cell.op] * H
        wb, rb = b.split(bias, [gh, gh], 0, [2 * gh]) if bias is not None else (None, None)
        self.x_bias, self.rh_bias = None, None
        if cell.op != "GRU":  # both biases before the gates
            self.x_bias = b.add(wb, rb, [gh])
        else:
            self.r_zr, self.r_h = b.split(r, [2 * H, H], 0, [gh, H])
            if bias is not None:
                wzr, wh = b.split(wb, [2 * H, H], 0, [gh])
                rzr, rh = b.split(rb, [2 * H, H], 0, [gh])
                # h's recurrent bias sits inside r * (...) when linear_before_reset.
                h_bias = wh if cell.linear_before_reset else b.add(wh, rh, [H])
                zr_bias = b.add(wzr, rzr, [2 * H])
                self.x_bias = b.op("Concat", zr_bias, h_bias, axis=0, shape=[gh])
                self.rh_bias = rh if cell.linear_before_reset else None

    def run(self, x2: ir.Value, h: _State, c: _State, reverse: bool, k: int):
        """Returns the step outputs in time order ([seq] of [N, H]) and the last states."""
        b, cell = self.b, self.cell
        gh = _GATES[cell.op] * self.H
        rows = cell.seq * self.N
        proj = b.gemm(x2, self.w, self.x_bias, [rows, gh])
        xs = b.split(proj, [self.N] * cell.seq, 0, [rows, gh]) if cell.seq > 1 else [proj]
        ys = []
        for t in reversed(range(cell.seq)) if reverse else range(cell.seq):
            if cell.op == "LSTM":
                h, c = self.lstm(xs[t], h, c)
            elif cell.op == "GRU":
                h = self.gru(xs[t], h)
            else:
                h = b.op(cell.activations[k], b.gemm(h, self.r, xs[t], [self.N, self.H]),
                         shape=[self.N, self.H])  # fmt: skip
            ys.append(h)
        return (ys[::-1] if reverse else ys), h, c

    def lstm(self, x: ir.Value, h: _State, c: _State) -> tuple[ir.Value, ir.Value]:
        b, N, H = self.b, self.N, self.H
        gates = b.gemm(h, self.r, x, [N, 4 * H])
        ifo_pre, g_pre = b.split(gates, [3 * H, H], 1, [N, 4 * H])
        ifo = b.op("Sigmoid", ifo_pre, shape=[N, 3 * H])
        i, o, f = b.split(ifo, [H, H, H], 1, [N, 3 * H])  # ONNX order: i, o, f, c
        ig = b.op("Mul", i, b.op("Tanh", g_pre, shape=[N, H]), shape=[N, H])
        c = ig if c is None else b.op("Add", b.op("Mul", f, c, shape=[N, H]), ig, shape=[N, H])
        return b.op("Mul", o, b.op("Tanh", c, shape=[N, H]), shape=[N, H]), c

    def gru(self, x: ir.Value, h: _State) -> ir.Value:
        b, N, H = self.b, self.N, self.H
        xzr, xh = b.split(x, [2 * H, H], 1, [N, 3 * H])
        zr = b.op("Sigmoid", b.gemm(h, self.r_zr, xzr, [N, 2 * H]), shape=[N, 2 * H])
        z, r = b.split(zr, [H, H], 1, [N, 2 * H])
        if self.cell.linear_before_reset:  # h~ = g(x Wh + r * (h Rh + Rbh))
            rh = b.gemm(h, self.r_h, self.rh_bias, [N, H])
            pre = xh if rh is None else b.op("Add", xh, b.op("Mul", r, rh, shape=[N, H]),
                                             shape=[N, H])  # fmt: skip
        else:  # h~ = g(x Wh + (r * h) Rh)
            rh_in = None if h is None else b.op("Mul", r, h, shape=[N, H])
            pre = b.gemm(rh_in, self.r_h, xh, [N, H])
        hh = b.op("Tanh", pre, shape=[N, H])
        # (1 - z) * h~ + z * h, written h~ + z * (h - h~) (h~ - z * h~ from a zero state)
        if h is None:
            return b.op("Sub", hh, b.op("Mul", z, hh, shape=[N, H]), shape=[N, H])
        diff = b.op("Sub", h, hh, shape=[N, H])
        return b.op("Add", hh, b.op("Mul", z, diff, shape=[N, H]), shape=[N, H])


def _sequence_output(b: _Builder, ys: list[list[ir.Value]]) -> ir.Value:
    """``Y``: [seq, D, N, H] (layout 0) or [N, seq, D, H] (layout 1)."""
    cell, N, H = b.cell, b.B, b.H
    d, seq = len(ys), cell.seq
    axis = 0 if cell.layout == 0 else 1  # steps stacked along rows or columns
    flat = [N * seq, H] if axis == 0 else [N, seq * H]
    one = [seq, 1, N, H] if cell.layout == 0 else [N, seq, 1, H]
    parts = [
        b.reshape(y[0] if seq == 1 else b.op("Concat", *y, axis=axis, shape=flat), one) for y in ys
    ]
    if d == 1:
        return parts[0]
    full = [seq, d, N, H] if cell.layout == 0 else [N, seq, d, H]
    return b.op("Concat", *parts, axis=1 if cell.layout == 0 else 2, shape=full)


def _state_output(b: _Builder, states: list[ir.Value]) -> ir.Value:
    """``Y_h`` / ``Y_c``: [D, N, H] (layout 0) or [N, D, H] (layout 1)."""
    N, H, d = b.B, b.H, len(states)
    one = [1, N, H] if b.cell.layout == 0 else [N, 1, H]
    parts = [b.reshape(s, one) for s in states]
    if d == 1:
        return parts[0]
    full = [d, N, H] if b.cell.layout == 0 else [N, d, H]
    return b.op("Concat", *parts, axis=0 if b.cell.layout == 0 else 1, shape=full)
