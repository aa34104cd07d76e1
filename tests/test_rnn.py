"""LSTM / GRU / RNN unrolled into standard ops (graph_passes/prepare/unroll_rnn.py).

1. The pass alone on one-node graphs: the unrolled graph against ONNX Runtime's own
   kernel (layout 1, which that kernel refuses, against a layout-0 node between
   transposes), the structure left behind, and the cases it refuses.
2. The unrolled graph's gradients (graph_passes/autodiff) against torch.autograd on the
   equivalent torch module, in float64.
3. End to end: models with ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` trained through
   ``ORTTrainer`` for 8 AdamW steps against eager (tests/test_parity.py's check).
"""

from __future__ import annotations

import collections
import copy
import dataclasses

import numpy as np
import onnx_ir as ir
import pytest
import torch

from ortrain import ORTTrainer
from ortrain.graph_passes.autodiff import GradientError, build_gradient_graph
from ortrain.graph_passes.infra.constant_value import constant_tensor
from ortrain.graph_passes.prepare.unroll_rnn import unroll_rnns
from tests.gradcheck import IR_VERSION, assert_close, run_model
from tests.test_parity import _check, adamw

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
F32 = ir.DataType.FLOAT


@dataclasses.dataclass(frozen=True)
class Rnn:
    """One recurrent node: op, attributes and which optional inputs it has."""

    op: str
    direction: str = "forward"
    layout: int = 0
    bias: bool = True
    h0: bool = True
    c0: bool = True  # LSTM only
    attrs: tuple[tuple[str, object], ...] = ()
    seq: int = 4
    batch: int = 3
    size: int = 4
    hidden: int = 5

    @property
    def id(self) -> str:
        extra = "-".join(f"{k}={v}" for k, v in self.attrs)
        c0 = self.c0 and self.op == "LSTM"
        have = "".join(k for k, on in (("B", self.bias), ("h", self.h0), ("c", c0)) if on)
        return f"{self.op}-{self.direction}-layout{self.layout}-{have or 'none'}-{extra}"

    @property
    def dirs(self) -> int:
        return 2 if self.direction == "bidirectional" else 1

    def state_shape(self, layout: int | None = None) -> tuple[int, ...]:
        layout = self.layout if layout is None else layout
        d, n, h = self.dirs, self.batch, self.hidden
        return (d, n, h) if layout == 0 else (n, d, h)

    def input_shapes(self, layout: int | None = None) -> dict[str, tuple[int, ...] | None]:
        """Node inputs in order (None: absent)."""
        layout = self.layout if layout is None else layout
        g = GATES[self.op] * self.hidden
        d, n, s = self.dirs, self.batch, self.seq
        shapes: dict[str, tuple[int, ...] | None] = {
            "X": (s, n, self.size) if layout == 0 else (n, s, self.size),
            "W": (d, g, self.size),
            "R": (d, g, self.hidden),
            "B": (d, 2 * g) if self.bias else None,
            "sequence_lens": None,
            "initial_h": self.state_shape(layout) if self.h0 else None,
        }
        if self.op == "LSTM":
            shapes["initial_c"] = self.state_shape(layout) if self.c0 else None
        return shapes

    def output_shapes(self, layout: int | None = None) -> list[tuple[int, ...]]:
        layout = self.layout if layout is None else layout
        d, n, s, h = self.dirs, self.batch, self.seq, self.hidden
        y = (s, d, n, h) if layout == 0 else (n, s, d, h)
        return [y] + [self.state_shape(layout)] * (_outputs(self) - 1)


def _outputs(rnn: Rnn) -> int:
    return 3 if rnn.op == "LSTM" else 2


def build(
    rnn: Rnn,
    layout: int | None = None,
    extra: dict[int, ir.Value] | None = None,
    inits: list[ir.Value] | None = None,
) -> ir.Model:
    """A one-node graph: the node's present inputs as graph inputs, every output out."""
    layout = rnn.layout if layout is None else layout
    inits = inits or []
    values: list[ir.Value | None] = []
    for name, shape in rnn.input_shapes(layout).items():
        v = None if shape is None else ir.Value(name=name, shape=ir.Shape(list(shape)))
        if v is not None:
            v.type = ir.TensorType(F32)
        values.append(v)
    for i, v in (extra or {}).items():
        values += [None] * (i + 1 - len(values))
        values[i] = v
    while values[-1] is None:
        values.pop()
    attrs = {"hidden_size": rnn.hidden, "direction": rnn.direction, "layout": layout}
    attrs.update(dict(rnn.attrs))
    node = ir.Node(
        "",
        rnn.op,
        values,
        attributes=ir.convenience.convert_attributes(attrs),
        num_outputs=_outputs(rnn),
        name="rnn_under_test",
    )
    out_shapes = rnn.output_shapes(layout)
    for k, o in enumerate(node.outputs):
        o.name, o.dtype, o.shape = ("Y", "Y_h", "Y_c")[k], F32, ir.Shape(list(out_shapes[k]))
    inputs = [v for v in values if v is not None and v not in inits]
    graph = ir.Graph(
        inputs, list(node.outputs), nodes=[node], initializers=inits, opset_imports={"": 20}
    )
    return ir.Model(graph, ir_version=IR_VERSION)


def feeds_for(rnn: Rnn, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: (0.7 * rng.standard_normal(shape)).astype(np.float32)
        for name, shape in rnn.input_shapes().items()
        if shape is not None
    }


def native(rnn: Rnn, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """ONNX Runtime's kernel; layout 1 as a layout-0 node between transposes."""
    if rnn.layout == 0:
        out = run_model(build(rnn), feeds)
        return [out[k] for k in ("Y", "Y_h", "Y_c")[: _outputs(rnn)]]
    moved = dict(feeds)
    moved["X"] = feeds["X"].transpose(1, 0, 2)
    for k in ("initial_h", "initial_c"):
        if k in feeds:
            moved[k] = feeds[k].transpose(1, 0, 2)
    out = run_model(build(rnn, layout=0), moved)
    ys = [out["Y"].transpose(2, 0, 1, 3)]
    return ys + [out[k].transpose(1, 0, 2) for k in ("Y_h", "Y_c")[: _outputs(rnn) - 1]]


def unrolled(model: ir.Model, feeds: dict[str, np.ndarray], count: int = 1) -> list[np.ndarray]:
    assert unroll_rnns(model) == count
    ops = collections.Counter(n.op_type for n in model.graph)
    assert not {"LSTM", "GRU", "RNN"} & set(ops), ops
    out = run_model(model, feeds)
    return [out[v.name] for v in model.graph.outputs]


def gemms(rnn: Rnn) -> int:
    """Products the unrolled graph needs: one input projection per direction, then the
    recurrent ones per step (GRU: two; none in the first step from a zero state)."""
    per_step = 2 if rnn.op == "GRU" else 1
    steps = rnn.seq if rnn.h0 else rnn.seq - 1
    return rnn.dirs * (1 + per_step * steps)


LBR = (("linear_before_reset", 1),)
CASES = [
    Rnn("LSTM"),
    Rnn("LSTM", "reverse", bias=False),
    Rnn("LSTM", "bidirectional", h0=False, c0=False),
    Rnn("LSTM", "bidirectional", layout=1),
    Rnn("LSTM", "forward", layout=1, h0=False),
    Rnn("LSTM", "reverse", c0=False),
    Rnn("LSTM", attrs=(("activations", ["Sigmoid", "Tanh", "Tanh"]),), seq=1),
    Rnn("LSTM", "bidirectional", attrs=(("activations", ["Sigmoid", "Tanh", "Tanh"] * 2),)),
    Rnn("GRU", attrs=LBR),
    Rnn("GRU"),
    Rnn("GRU", "bidirectional", attrs=LBR, h0=False),
    Rnn("GRU", "reverse", bias=False, h0=False),
    Rnn("GRU", "bidirectional", layout=1, attrs=LBR),
    Rnn("GRU", "forward", layout=1, bias=False),
    Rnn("RNN"),
    Rnn("RNN", "reverse", attrs=(("activations", ["Relu"]),), h0=False),
    Rnn("RNN", "bidirectional", attrs=(("activations", ["Tanh", "Relu"]),), layout=1),
    Rnn("RNN", "bidirectional", bias=False),
]


@pytest.mark.parametrize("rnn", CASES, ids=[c.id for c in CASES])
def test_unrolled_matches_onnxruntime(rnn: Rnn) -> None:
    feeds = feeds_for(rnn)
    model = build(rnn)
    got = unrolled(model, feeds)
    for k, (a, e) in enumerate(zip(got, native(rnn, feeds), strict=True)):
        assert_close(a, e, f"{rnn.id}: output {k}")
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["Gemm"] == gemms(rnn)
    assert ops["MatMul"] == 0 and ops["Loop"] == 0 and ops["Scan"] == 0


def test_only_read_outputs_are_built_and_zero_states_skipped() -> None:
    """Y_h alone read: no Concat of the step outputs; torch's constant zero initial states
    count as absent (no first-step product)."""
    rnn = Rnn("LSTM", h0=False, c0=False)
    zeros = np.zeros(rnn.state_shape(), np.float32)
    consts = []
    for name in ("initial_h", "initial_c"):
        v = ir.Value(name=name, shape=ir.Shape(list(zeros.shape)), type=ir.TensorType(F32))
        v.const_value = ir.tensor(zeros, name=name)
        consts.append(v)
    model = build(rnn, extra={5: consts[0], 6: consts[1]}, inits=consts)
    model.graph.outputs[:] = [model.graph.outputs[1]]
    feeds = feeds_for(rnn)
    want = native(Rnn("LSTM", h0=False, c0=False), feeds)[1]
    (got,) = unrolled(model, feeds)
    assert_close(got, want, "Y_h")
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["Gemm"] == gemms(rnn) and ops["Concat"] == 0


def test_full_sequence_lens_accepted() -> None:
    rnn = Rnn("GRU", attrs=LBR)
    lens = np.full(rnn.batch, rnn.seq, np.int32)
    v = ir.Value(name="lens", shape=ir.Shape([rnn.batch]), type=ir.TensorType(ir.DataType.INT32))
    v.const_value = ir.tensor(lens, name="lens")
    feeds = feeds_for(rnn)
    got = unrolled(build(rnn, extra={4: v}, inits=[v]), feeds)
    for k, (a, e) in enumerate(zip(got, native(rnn, feeds), strict=True)):
        assert_close(a, e, f"output {k}")


def test_two_nodes_in_one_graph() -> None:
    """Two stacked layers (the second reads the first's Y reshaped): both unrolled."""
    rnn = Rnn("LSTM", h0=False, c0=False)
    model = build(rnn)
    first = model.graph.node(0)
    flat = ir.Node("", "Reshape", [first.outputs[0], _ints(model, [rnn.seq, rnn.batch, 5])])
    flat.outputs[0].dtype, flat.outputs[0].shape = F32, ir.Shape([rnn.seq, rnn.batch, 5])
    w2 = ir.Value(name="W2", shape=ir.Shape([1, 20, 5]), type=ir.TensorType(F32))
    r2 = ir.Value(name="R2", shape=ir.Shape([1, 20, 5]), type=ir.TensorType(F32))
    second = ir.Node("", "LSTM", [flat.outputs[0], w2, r2], num_outputs=1, name="second")
    second.attributes["hidden_size"] = ir.AttrInt64("hidden_size", 5)
    out = second.outputs[0]
    out.name, out.dtype, out.shape = "Y2", F32, ir.Shape([rnn.seq, 1, rnn.batch, 5])
    model.graph.extend([flat, second])
    model.graph.inputs.extend([w2, r2])
    model.graph.outputs[:] = [out]
    feeds = feeds_for(rnn)
    rng = np.random.default_rng(3)
    feeds.update(
        {k: (0.7 * rng.standard_normal((1, 20, 5))).astype(np.float32) for k in "W2 R2".split()}
    )
    reference = run_model(copy.deepcopy(model), feeds)["Y2"]
    (got,) = unrolled(model, feeds, count=2)
    assert_close(got, reference, "Y2")


def _ints(model: ir.Model, values: list[int]) -> ir.Value:
    arr = np.asarray(values, np.int64)
    v = ir.Value(name=f"shape{len(model.graph.initializers)}", shape=ir.Shape([len(values)]))
    v.type, v.const_value = ir.TensorType(ir.DataType.INT64), ir.tensor(arr, name=v.name)
    model.graph.register_initializer(v)
    return v


REFUSED = [
    (Rnn("LSTM", attrs=(("clip", 3.0),)), "'clip'"),
    (Rnn("LSTM", attrs=(("input_forget", 1),)), "'input_forget'"),
    (Rnn("LSTM", attrs=(("activations", ["Sigmoid", "Tanh", "Relu"]),)), "activations"),
    (Rnn("GRU", attrs=(("activations", ["HardSigmoid", "Tanh"]),)), "activations"),
    (Rnn("RNN", attrs=(("activations", ["Sigmoid"]),)), "activations"),
    (Rnn("RNN", attrs=(("activation_alpha", [0.5]),)), "'activation_alpha'"),
    (Rnn("RNN", "bidirectional", attrs=(("activations", ["Relu"]),)), "per direction"),
    (Rnn("GRU", "bidirectional", attrs=(("activations", ["Sigmoid", "Tanh"]),)), "per direction"),
]


@pytest.mark.parametrize("rnn,what", REFUSED, ids=[r.id for r, _ in REFUSED])
def test_refused_attributes(rnn: Rnn, what: str) -> None:
    with pytest.raises(GradientError, match=f"{rnn.op} .*rnn_under_test.*{what}"):
        unroll_rnns(build(rnn))


def test_refused_inputs() -> None:
    rnn = Rnn("LSTM")
    p = ir.Value(name="P", shape=ir.Shape([1, 15]), type=ir.TensorType(F32))
    with pytest.raises(GradientError, match=r"LSTM .*rnn_under_test.*peepholes"):
        unroll_rnns(build(rnn, extra={7: p}))
    i32 = ir.TensorType(ir.DataType.INT32)
    lens = ir.Value(name="lens", shape=ir.Shape([rnn.batch]), type=i32)
    with pytest.raises(GradientError, match="sequence_lens that is not a constant"):
        unroll_rnns(build(rnn, extra={4: lens}))
    short = np.array([rnn.seq, rnn.seq - 1, rnn.seq], np.int32)
    lens = ir.Value(name="lens", shape=ir.Shape([rnn.batch]), type=i32)
    lens.const_value = ir.tensor(short, name="lens")
    with pytest.raises(GradientError, match=r"sequence_lens \[4, 3, 4\] shorter than 4"):
        unroll_rnns(build(rnn, extra={4: lens}, inits=[lens]))
    # What the exporter's own function writes for nn.LSTM(proj_size=...) (ortrain's
    # translation writes it out instead): the cell state wider than hidden_size.
    wide = ir.Value(name="c0", shape=ir.Shape([1, rnn.batch, 7]), type=ir.TensorType(F32))
    with pytest.raises(GradientError, match=r"initial_c of shape \(1, 3, 7\).*proj_size"):
        unroll_rnns(build(rnn, extra={6: wide}))


# --- 2. gradients against torch.autograd ---------------------------------------------------

# torch's gate blocks, as indices into ONNX's order (LSTM i,o,f,c; GRU z,r,h).
TORCH_GATES = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2], "RNN": [0]}


def _torch_gates(w: torch.Tensor, op: str, hidden: int) -> torch.Tensor:
    blocks = w.split(hidden, dim=0)
    return torch.cat([blocks[j] for j in TORCH_GATES[op]], dim=0)


def torch_reference(rnn: Rnn, t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The node's outputs from ``torch.nn.LSTM/GRU/RNN`` (float64) on the ONNX inputs."""
    h, g = rnn.hidden, GATES[rnn.op] * rnn.hidden
    lbr = dict(rnn.attrs).get("linear_before_reset", 0)
    if rnn.op == "GRU" and not lbr:
        return _gru_reset_before(rnn, t)
    kwargs = {"bias": rnn.bias, "bidirectional": rnn.dirs == 2}
    if rnn.op == "RNN":
        kwargs["nonlinearity"] = dict(rnn.attrs).get("activations", ["Tanh"])[0].lower()
    module = getattr(torch.nn, rnn.op)(rnn.size, h, **kwargs).double()
    params = {}
    for k in range(rnn.dirs):
        sfx = "_reverse" if k else ""
        params[f"weight_ih_l0{sfx}"] = _torch_gates(t["W"][k], rnn.op, h)
        params[f"weight_hh_l0{sfx}"] = _torch_gates(t["R"][k], rnn.op, h)
        if rnn.bias:
            params[f"bias_ih_l0{sfx}"] = _torch_gates(t["B"][k, :g], rnn.op, h)
            params[f"bias_hh_l0{sfx}"] = _torch_gates(t["B"][k, g:], rnn.op, h)
    x, states = _time_major(rnn, t)
    reverse = rnn.direction == "reverse"  # torch has no reverse-only layer: flip time
    if reverse:
        x = x.flip(0)
    arg = tuple(states) if rnn.op == "LSTM" else states[0]
    y, hn = torch.func.functional_call(module, params, (x, arg))
    if reverse:
        y = y.flip(0)
    y = y.reshape(rnn.seq, rnn.batch, rnn.dirs, h).permute(0, 2, 1, 3)
    finals = list(hn) if rnn.op == "LSTM" else [hn]
    return _onnx_layout(rnn, y, finals)


def _time_major(rnn: Rnn, t: dict[str, torch.Tensor]):
    x = t["X"] if rnn.layout == 0 else t["X"].transpose(0, 1)
    zeros = torch.zeros(rnn.state_shape(0), dtype=torch.float64)
    states = []
    for name in ("initial_h", "initial_c")[: 2 if rnn.op == "LSTM" else 1]:
        s = t.get(name)
        states.append(zeros if s is None else s if rnn.layout == 0 else s.transpose(0, 1))
    return x, states


def _onnx_layout(rnn: Rnn, y: torch.Tensor, finals: list[torch.Tensor]) -> list[torch.Tensor]:
    if rnn.layout == 1:
        return [y.permute(2, 0, 1, 3)] + [s.transpose(0, 1) for s in finals]
    return [y, *finals]


def _gru_reset_before(rnn: Rnn, t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """GRU with linear_before_reset = 0 (torch's GRU has only the other variant):
    h~ = tanh(x Wh + (r * h) Rh + Rbh + Wbh), written out step by step."""
    h_size, g = rnn.hidden, GATES[rnn.op] * rnn.hidden
    x, (h0,) = _time_major(rnn, t)
    ys, finals = [], []
    for k in range(rnn.dirs):
        w, r = t["W"][k], t["R"][k]
        b = t["B"][k] if rnn.bias else torch.zeros(2 * g, dtype=torch.float64)
        wz, wr, wh = w.split(h_size)
        rz, rr, rh = r.split(h_size)
        bz, br, bh = (b[:g] + b[g:]).split(h_size)
        h = h0[k]
        out = [None] * rnn.seq
        reverse = rnn.direction == "reverse" or k == 1
        for step in reversed(range(rnn.seq)) if reverse else range(rnn.seq):
            xt = x[step]
            z = torch.sigmoid(xt @ wz.T + h @ rz.T + bz)
            rg = torch.sigmoid(xt @ wr.T + h @ rr.T + br)
            hh = torch.tanh(xt @ wh.T + (rg * h) @ rh.T + bh)
            h = (1 - z) * hh + z * h
            out[step] = h
        ys.append(torch.stack(out))
        finals.append(h)
    return _onnx_layout(rnn, torch.stack(ys, 1), [torch.stack(finals)])


GRAD_CASES = [
    Rnn("LSTM"),
    Rnn("LSTM", "bidirectional", layout=1),
    Rnn("LSTM", "reverse", bias=False, h0=False),
    Rnn("LSTM", "bidirectional", c0=False),
    Rnn("GRU", attrs=LBR),
    Rnn("GRU", "bidirectional", layout=1, attrs=LBR, h0=False),
    Rnn("GRU", "reverse"),
    Rnn("GRU", "bidirectional", bias=False),
    Rnn("RNN", "bidirectional"),
    Rnn("RNN", "reverse", layout=1, attrs=(("activations", ["Relu"]),)),
]


@pytest.mark.parametrize("rnn", GRAD_CASES, ids=[c.id for c in GRAD_CASES])
def test_unrolled_gradients_match_torch(rnn: Rnn) -> None:
    feeds = feeds_for(rnn, seed=1)
    rng = np.random.default_rng(2)
    model = build(rnn)
    assert unroll_rnns(model) == 1
    outs = list(model.graph.outputs)
    weights = [rng.standard_normal(list(o.shape.dims)).astype(np.float32) for o in outs]
    loss = _weighted_sum(model, outs, weights)
    result = build_gradient_graph(model, loss.name, list(feeds))
    got = run_model(model, feeds)

    t = {k: torch.from_numpy(v).double().requires_grad_() for k, v in feeds.items()}
    ref = torch_reference(rnn, t)
    total = sum((o * torch.from_numpy(w).double()).sum() for o, w in zip(ref, weights))
    grads = torch.autograd.grad(total, list(t.values()))
    for o, r in zip(outs, ref, strict=True):
        assert_close(got[o.name], r.detach().numpy(), f"{rnn.id}: {o.name}")
    for name, g in zip(t, grads, strict=True):
        assert_close(got[result.grad_outputs[name]], g.numpy(), f"{rnn.id}: d/d{name}")


def _weighted_sum(model: ir.Model, outs: list[ir.Value], weights: list[np.ndarray]) -> ir.Value:
    """loss = sum_k ReduceSum(out_k * R_k), added to the graph as its output."""
    terms = []
    for k, (o, w) in enumerate(zip(outs, weights)):
        r = ir.Value(name=f"R{k}", shape=ir.Shape(list(w.shape)), type=ir.TensorType(F32))
        r.const_value = ir.tensor(w, name=r.name)
        model.graph.register_initializer(r)
        mul = ir.Node("", "Mul", [o, r], name=f"loss_mul{k}")
        mul.outputs[0].dtype, mul.outputs[0].shape = F32, o.shape
        red = ir.Node("", "ReduceSum", [mul.outputs[0]], name=f"loss_sum{k}")
        red.attributes["keepdims"] = ir.AttrInt64("keepdims", 0)
        red.outputs[0].dtype, red.outputs[0].shape = F32, ir.Shape([])
        model.graph.extend([mul, red])
        terms.append(red.outputs[0])
    total = ir.Node("", "Sum", terms, name="loss_total")
    loss = total.outputs[0]
    loss.name, loss.dtype, loss.shape = "loss", F32, ir.Shape([])
    model.graph.append(total)
    model.graph.outputs.append(loss)
    return loss


# --- 3. end to end: ORTTrainer against eager ------------------------------------------------

Out = collections.namedtuple("Out", "loss logits")
VOCAB, EMBED, HIDDEN, BATCH, SEQ = 24, 6, 8, 3, 5


class RnnModel(torch.nn.Module):
    """Embedding -> nn.LSTM / nn.GRU / nn.RNN -> Linear: a language model over every
    step's output, or a classifier over the final states (h_n, and c_n for an LSTM)."""

    def __init__(self, kind: str, head: str, **rnn_kwargs) -> None:
        super().__init__()
        self.kind, self.head_kind = kind, head
        self.batch_first = rnn_kwargs.get("batch_first", False)
        self.emb = torch.nn.Embedding(VOCAB, EMBED)
        self.rnn = getattr(torch.nn, kind)(EMBED, HIDDEN, **rnn_kwargs)
        dirs = 2 if rnn_kwargs.get("bidirectional") else 1
        layers = rnn_kwargs.get("num_layers", 1)
        states = 2 if kind == "LSTM" else 1
        width = HIDDEN * dirs if head == "lm" else HIDDEN * dirs * layers * states
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, input_ids, labels, h0=None, c0=None):
        x = self.emb(input_ids)  # [batch, seq, embed]
        if not self.batch_first:
            x = x.transpose(0, 1)
        state = None if h0 is None else (h0, c0) if self.kind == "LSTM" else h0
        y, final = self.rnn(x) if state is None else self.rnn(x, state)
        if self.head_kind == "lm":
            y = y if self.batch_first else y.transpose(0, 1)
            logits = self.head(y)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
            return Out(loss, logits)
        finals = final if self.kind == "LSTM" else (final,)
        feats = torch.cat([s.transpose(0, 1).reshape(input_ids.shape[0], -1) for s in finals], 1)
        logits = self.head(feats)
        return Out(torch.nn.functional.cross_entropy(logits, labels), logits)


def rnn_batches(kind: str, head: str, states: bool, layers: int, dirs: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(8):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = ids if head == "lm" else torch.randint(0, VOCAB, (BATCH,), generator=g)
        item = {"input_ids": ids, "labels": labels}
        if states:
            shape = (layers * dirs, BATCH, HIDDEN)
            item["h0"] = 0.5 * torch.randn(shape, generator=g)
            if kind == "LSTM":
                item["c0"] = 0.5 * torch.randn(shape, generator=g)
        out.append(item)
    return out


E2E = {
    "lstm_lm_2layers_batch_first": ("LSTM", "lm", False, dict(num_layers=2, batch_first=True)),
    "lstm_lm_h0_c0": ("LSTM", "lm", True, dict()),
    "gru_lm_h0": ("GRU", "lm", True, dict()),
    "rnn_tanh_lm_bidirectional": ("RNN", "lm", False, dict(bidirectional=True)),
    "lstm_classifier_bidirectional_2layers_h0_c0": (
        "LSTM", "cls", True, dict(num_layers=2, bidirectional=True),
    ),
    "gru_classifier_bidirectional_batch_first": (
        "GRU", "cls", False, dict(bidirectional=True, batch_first=True),
    ),
    "rnn_relu_classifier_2layers_h0": (
        "RNN", "cls", True, dict(nonlinearity="relu", num_layers=2, batch_first=True),
    ),
}  # fmt: skip


# 13-26 s on 2 shared cores, mostly the export of two LSTM layers
SLOW_E2E = {"lstm_lm_2layers_batch_first", "lstm_classifier_bidirectional_2layers_h0_c0"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_E2E else []) for n in E2E]
)
def test_rnn_model_trains_like_eager(name: str) -> None:
    """8 AdamW steps: every loss within 1e-4 relative, the final parameters within 1e-4;
    the training graph holds no recurrent node, the products of the unrolled steps."""
    kind, head, states, kwargs = E2E[name]

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return RnnModel(kind, head, **kwargs)

    dirs = 2 if kwargs.get("bidirectional") else 1
    batches = rnn_batches(kind, head, states, kwargs.get("num_layers", 1), dirs)
    trainer = _check(make_model, adamw, batches)
    ops = collections.Counter(n.op_type for n in trainer.train_graphs[0].graph)
    assert not {"LSTM", "GRU", "RNN"} & set(ops)
    assert ops["Gemm"] > SEQ


@pytest.mark.slow  # 10-21 s: a training and an evaluation export
def test_dropout_between_layers() -> None:
    """``dropout > 0``: the exporter writes the inter-layer dropout as an ONNX Dropout
    (num_layers - 1 of them, with the module's ratio) on the unrolled layers' outputs,
    so training drops as eager does (same semantics, ONNX Runtime's random stream, so no
    step-by-step parity); the eval graph has no dropout and matches eager's eval."""
    torch.manual_seed(0)
    model = RnnModel("LSTM", "lm", num_layers=2, dropout=0.5)
    with torch.no_grad():
        model.head.weight *= 20  # logits that the dropped units move visibly
    batches = rnn_batches("LSTM", "lm", False, 2, 1)
    with torch.no_grad():
        plain = model.eval()(**batches[0]).loss.item()
    trainer = ORTTrainer(model.train(), adamw(model))
    losses = [trainer.train_step(**b).item() for b in batches[:2]]
    assert all(np.isfinite(losses)) and abs(losses[0] - plain) > 1e-3 * plain
    graph = trainer.train_graphs[0].graph
    drops = [n for n in graph if n.op_type == "Dropout"]
    assert len(drops) == 1
    assert {float(constant_tensor(n.inputs[1]).numpy()) for n in drops} == {0.5}
    assert not {"LSTM", "GRU", "RNN"} & {n.op_type for n in graph}
    trainer.sync_to_module().eval()
    with torch.no_grad():
        want = model(**batches[-1]).logits
    got = trainer.eval_step(**batches[-1])["output_1"]  # Out's second item
    assert_close(got.numpy(), want.numpy(), "eval logits")


class _StackedRnn(torch.nn.Module):
    def __init__(self, nonlinearity: str, bidirectional: bool):
        super().__init__()
        self.rnn = torch.nn.RNN(
            4, 24, num_layers=3, dropout=0.5, nonlinearity=nonlinearity,
            bidirectional=bidirectional, batch_first=True,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0].pow(2).mean()


@pytest.mark.parametrize(
    "nonlinearity, bidirectional", [("tanh", False), ("relu", False), ("tanh", True)]
)
def test_rnn_draws_its_dropout_between_layers(nonlinearity: str, bidirectional: bool) -> None:
    """``nn.RNN``'s inter-layer dropout: torch's decomposition, which the export traces,
    drops it (the graph trained with none); ortrain exports the call layer by layer with
    a Dropout between (``ortrain/export_functional.py``). The graph holds num_layers - 1
    Dropouts of the module's ratio, and its mean loss over 24 draws (lr 0) is eager's
    mean over 24 draws, not the loss without dropout."""
    torch.manual_seed(0)
    model = _StackedRnn(nonlinearity, bidirectional)
    x = torch.randn(16, 5, 4, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model.eval()(x).item()
        model.train()
        eager = np.mean([model(x).item() for _ in range(24)])
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0))
    compiled = np.mean([trainer.train_step(x).item() for _ in range(24)])
    drops = [n for n in trainer.train_graphs[0].graph if n.op_type == "Dropout"]
    assert len(drops) == 2
    assert {float(constant_tensor(n.inputs[1]).numpy()) for n in drops} == {0.5}
    assert abs(compiled - eager) < 0.25 * abs(eager - plain), (plain, eager, compiled)
