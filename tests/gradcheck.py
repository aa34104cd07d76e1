"""Check one ONNX node's gradient rule against torch.autograd.

A :class:`Spec` describes one node (op type, domain, attributes, inputs) and a torch
function computing the same thing. :func:`check_gradients`

1. builds a one-node ``onnx_ir`` graph (differentiable/index inputs as graph inputs,
   constant shape/axes/... inputs as initializers) and runs it forward in ONNX Runtime
   to learn the output shapes and dtypes (so no shape inference is needed, and
   com.microsoft ops work too);
2. adds the scalar loss ``sum_k ReduceSum(out_k * R_k)`` with a fixed random ``R_k`` per
   used output (or, for loss ops, output 0 itself), calls ``build_gradient_graph``
   and runs the gradient model in ONNX Runtime;
3. evaluates the torch reference on the same input values in float64 and compares the
   forward outputs and every gradient element-wise:
   ``|ort - ref| <= RTOL * |ref| + ATOL * max|ref|``.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch

from ortrain.graph_passes.autodiff import GradientGraphResult, build_gradient_graph
from ortrain.graph_passes.infra.emitter import MS_DOMAIN

RTOL = 1e-5
ATOL = 1e-5  # scaled by the largest magnitude of the reference
OPSETS = {"": 20, MS_DOMAIN: 1}
IR_VERSION = 10

Sampler = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]


# --- input specs ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class In:
    """One node input.

    ``sample`` draws the value (ignored when ``value`` is given); ``grad`` marks an input
    the gradient is taken for; ``const`` makes it an initializer instead of a graph input.
    """

    shape: tuple[int, ...]
    dtype: str = "float32"
    sample: Sampler | None = None
    grad: bool = False
    const: bool = False
    value: object = None

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        if self.value is not None:
            return np.asarray(self.value, dtype=self.dtype).reshape(self.shape)
        sample = self.sample or _normal
        return np.asarray(sample(rng, self.shape), dtype=self.dtype)


def _normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape)


def _positive(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.uniform(0.5, 2.0, shape)


def _nonzero(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 2.0, shape)


def X(*shape: int, grad: bool = True, dtype: str = "float32") -> In:
    """A float input drawn from N(0, 1), differentiated by default."""
    return In(tuple(shape), dtype, _normal, grad)


def Pos(*shape: int, grad: bool = True) -> In:
    """A float input in [0.5, 2] (Log, Sqrt, Pow base, class weights)."""
    return In(tuple(shape), "float32", _positive, grad)


def NonZero(*shape: int, grad: bool = True) -> In:
    """A float input with |x| in [0.5, 2] (divisors, Abs, Reciprocal)."""
    return In(tuple(shape), "float32", _nonzero, grad)


def Const(value: object, dtype: str = "int64") -> In:
    """A constant initializer: shape / axes / starts / repeats / pads / scalar exponent."""
    arr = np.asarray(value, dtype=dtype)
    return In(arr.shape, dtype, const=True, value=arr)


def Index(shape: tuple[int, ...], lo: int, hi: int) -> In:
    """An int64 graph input drawn uniformly from [lo, hi)."""
    return In(tuple(shape), "int64", lambda rng, s: rng.integers(lo, hi, s))


def Fixed(value: object, dtype: str = "int64") -> In:
    """A graph input with a fixed value (e.g. GatherND indices)."""
    arr = np.asarray(value, dtype=dtype)
    return In(arr.shape, dtype, value=arr)


def Mask(*shape: int) -> In:
    """A bool graph input (Where condition)."""
    return In(tuple(shape), "bool", lambda rng, s: rng.random(s) < 0.5)


def Labels(shape: tuple[int, ...], classes: int, ignore: int | None = None) -> In:
    """Class labels in [0, classes); with ``ignore``, about a third of them (at least one,
    never all) are set to the ignored index."""

    def sample(rng: np.random.Generator, s: tuple[int, ...]) -> np.ndarray:
        labels = rng.integers(0, classes, s)
        if ignore is not None:
            flat = labels.reshape(-1)
            drop = rng.random(flat.shape) < 0.35
            drop[0], drop[1] = True, False
            flat[drop] = ignore
            if ignore in range(classes):  # keep the valid ones distinct from ignore
                flat[~drop] = np.where(flat[~drop] == ignore, (ignore + 1) % classes, flat[~drop])
        return labels

    return In(tuple(shape), "int64", sample)


# --- the spec --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    id: str
    op: str
    inputs: Sequence[In | None]  # None: an absent optional input
    ref: Callable[..., object]  # torch reference: (*inputs[, ort=outputs]) -> tensor | tuple
    attrs: dict[str, object] = dataclasses.field(default_factory=dict)
    domain: str = ""
    outputs: int = 1  # node outputs declared in the forward graph
    loss_outputs: tuple[int, ...] | None = None  # None: every float output
    direct_loss: bool = False  # output 0 is already the scalar loss: use it as is
    ref_sees_ort: bool = False  # ``ref`` gets the ONNX Runtime outputs (Dropout's mask)
    threads: int = 1  # intra-op threads for the gradient run (races show only with > 1)
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)  # the node's tags

    @property
    def wrt(self) -> list[int]:
        return [i for i, s in enumerate(self.inputs) if s is not None and s.grad]


def case(id: str, op: str, inputs: Sequence[In | None], ref: Callable, **kw) -> Spec:
    return Spec(id, op, inputs, ref, **kw)


# --- graph building --------------------------------------------------------------------------


def _value(name: str, arr_or_shape, dtype: ir.DataType) -> ir.Value:
    shape = arr_or_shape.shape if isinstance(arr_or_shape, np.ndarray) else arr_or_shape
    return ir.Value(name=name, shape=ir.Shape(list(shape)), type=ir.TensorType(dtype))


def _session(model: ir.Model, threads: int = 1) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    proto = ir.serde.serialize_model(model)
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _forward_graph(spec: Spec, arrays: list[np.ndarray | None], out_types=None):
    """The one-node graph; returns (graph inputs, initializers, node)."""
    graph_inputs, inits, node_inputs = [], [], []
    for i, (s, arr) in enumerate(zip(spec.inputs, arrays, strict=True)):
        if s is None:
            node_inputs.append(None)
            continue
        v = _value(f"in{i}", arr, ir.DataType.from_numpy(arr.dtype))
        if s.const:
            v.const_value = ir.tensor(arr, name=v.name)
            inits.append(v)
        else:
            graph_inputs.append(v)
        node_inputs.append(v)
    node = ir.Node(
        spec.domain,
        spec.op,
        node_inputs,
        attributes=ir.convenience.convert_attributes(spec.attrs),
        num_outputs=spec.outputs,
        name="node_under_test",
        metadata_props=dict(spec.metadata),
    )
    for k, o in enumerate(node.outputs):
        o.name = f"out{k}"
        if out_types is not None:
            o.dtype, o.shape = out_types[k][0], ir.Shape(list(out_types[k][1]))
    return graph_inputs, inits, node


def _model(inputs, outputs, nodes, inits) -> ir.Model:
    graph = ir.Graph(inputs, outputs, nodes=nodes, initializers=inits, opset_imports=dict(OPSETS))
    return ir.Model(graph, ir_version=IR_VERSION)


def _feeds(spec: Spec, arrays) -> dict[str, np.ndarray]:
    return {
        f"in{i}": a
        for i, (s, a) in enumerate(zip(spec.inputs, arrays, strict=True))
        if s is not None and not s.const
    }


FLOAT_DTYPES = (np.float16, np.float32, np.float64)


def run_onnx(spec: Spec, arrays, rng: np.random.Generator):
    """Forward outputs, gradients (input index -> array), R per loss output, grad result."""
    # Pass 1: forward only, to learn what the node produces.
    gin, inits, node = _forward_graph(spec, arrays)
    fwd = _session(_model(gin, list(node.outputs), [node], inits))
    first = fwd.run(None, _feeds(spec, arrays))
    out_types = [(ir.DataType.from_numpy(a.dtype), a.shape) for a in first]

    # Pass 2: the same node with typed outputs, a scalar loss, and its gradient graph.
    gin, inits, node = _forward_graph(spec, arrays, out_types)
    nodes = [node]
    used = spec.loss_outputs
    if used is None:
        used = tuple(k for k, a in enumerate(first) if a.dtype in FLOAT_DTYPES)
    rs: dict[int, np.ndarray] = {}
    terms = []
    for k in used:
        out = node.outputs[k]
        if spec.direct_loss and k == 0:
            assert first[0].shape == (), "direct_loss needs a scalar output 0"
            terms.append(out)
            continue
        r = rng.standard_normal(first[k].shape).astype(first[k].dtype)
        rs[k] = r
        rv = _value(f"R{k}", r, out.dtype)
        rv.const_value = ir.tensor(r, name=rv.name)
        inits.append(rv)
        prod = ir.Node("", "Mul", [out, rv], num_outputs=1, name=f"loss_mul{k}")
        prod.outputs[0].name, prod.outputs[0].dtype = f"loss_prod{k}", out.dtype
        prod.outputs[0].shape = ir.Shape(list(first[k].shape))
        red = ir.Node(
            "",
            "ReduceSum",
            [prod.outputs[0]],
            attributes=ir.convenience.convert_attributes({"keepdims": 0}),
            num_outputs=1,
            name=f"loss_sum{k}",
        )
        red.outputs[0].name, red.outputs[0].dtype = f"loss_term{k}", out.dtype
        red.outputs[0].shape = ir.Shape([])
        nodes += [prod, red]
        terms.append(red.outputs[0])
    assert terms, f"{spec.id}: nothing to differentiate"
    loss = terms[0]
    if len(terms) > 1:
        total = ir.Node("", "Sum", terms, num_outputs=1, name="loss_total")
        loss = total.outputs[0]
        loss.dtype, loss.shape = terms[0].dtype, ir.Shape([])
        nodes.append(total)
    outputs = list(node.outputs) if loss in node.outputs else [loss, *node.outputs]
    if loss not in node.outputs:
        loss.name = "loss"
    model = _model(gin, outputs, nodes, inits)
    wrt = [f"in{i}" for i in spec.wrt]
    res = build_gradient_graph(model, loss.name, wrt)
    sess = _session(model, spec.threads)
    names = [o.name for o in sess.get_outputs()]
    got = dict(zip(names, sess.run(None, _feeds(spec, arrays)), strict=True))
    fwd_outs = [got[f"out{k}"] for k in range(spec.outputs)]
    grads = {i: got[res.grad_outputs[f"in{i}"]] for i in spec.wrt if f"in{i}" in res.grad_outputs}
    return fwd_outs, grads, rs, res


# --- the torch reference -----------------------------------------------------------------


def _to_torch(arr: np.ndarray, grad: bool) -> torch.Tensor:
    t = torch.from_numpy(np.array(arr))
    if t.is_floating_point():
        t = t.to(torch.float64)
    return t.requires_grad_(grad)


def run_torch(spec: Spec, arrays, rs: dict[int, np.ndarray], ort_outputs):
    tensors = [
        None if a is None else _to_torch(a, s.grad)
        for s, a in zip(spec.inputs, arrays, strict=True)
    ]
    args = [t for t in tensors if t is not None]
    kw = {"ort": [torch.from_numpy(np.array(o)) for o in ort_outputs]} if spec.ref_sees_ort else {}
    outs = spec.ref(*args, **kw)
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    loss = torch.zeros((), dtype=torch.float64)
    if spec.direct_loss and (spec.loss_outputs is None or 0 in spec.loss_outputs):
        loss = loss + outs[0]
    for k, r in rs.items():
        loss = loss + (outs[k] * torch.from_numpy(r).to(torch.float64)).sum()
    wrt = [tensors[i] for i in spec.wrt]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    grads = {
        i: (torch.zeros_like(t) if g is None else g).detach().numpy()
        for i, t, g in zip(spec.wrt, wrt, grads, strict=True)
    }
    return [o.detach().numpy() for o in outs], grads


# --- comparison ------------------------------------------------------------------------------


def assert_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    assert np.isfinite(e).all(), f"{what}: non-finite reference"
    scale = float(np.abs(e).max()) if e.size else 0.0
    err = np.abs(a - e)
    tol = RTOL * np.abs(e) + ATOL * scale
    bad = ~(err <= tol)
    if bad.any():
        idx = tuple(int(j) for j in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.size} elements differ; first at {idx}: "
            f"onnx {a[idx]!r} vs torch {e[idx]!r} (max|ref| {scale:.3g}, "
            f"max err {float(err.max()):.3g})"
        )


def seed_of(spec_id: str) -> int:
    return zlib.crc32(spec_id.encode())


def check_gradients(spec: Spec) -> tuple[GradientGraphResult, list[np.ndarray]]:
    """Raise AssertionError unless ONNX Runtime and torch agree; return the gradient
    graph result and the node's forward outputs from ONNX Runtime."""
    rng = np.random.default_rng(seed_of(spec.id))
    arrays = [None if s is None else s.draw(rng) for s in spec.inputs]
    fwd, grads, rs, res = run_onnx(spec, arrays, rng)
    ref_fwd, ref_grads = run_torch(spec, arrays, rs, fwd)
    for k, (o, r) in enumerate(zip(fwd, ref_fwd, strict=False)):
        if o.dtype in FLOAT_DTYPES:
            assert_close(o, r, f"{spec.id}: forward output {k}")
    assert sorted(grads) == spec.wrt, f"{spec.id}: gradient outputs {sorted(grads)}"
    for i in spec.wrt:
        assert grads[i].dtype == arrays[i].dtype, f"{spec.id}: grad {i} dtype {grads[i].dtype}"
        assert_close(grads[i], ref_grads[i], f"{spec.id}: d loss / d input {i}")
    return res, fwd


# --- a tiny graph builder for the structural tests -----------------------------------------


class TinyGraph:
    """Hand-built graphs with static shapes: ``x = g.input(...)``, ``y = g.op(...)``."""

    def __init__(self) -> None:
        self.inputs: list[ir.Value] = []
        self.inits: list[ir.Value] = []
        self.nodes: list[ir.Node] = []

    def input(self, name: str, shape, dtype: ir.DataType = ir.DataType.FLOAT) -> ir.Value:
        v = _value(name, tuple(shape), dtype)
        self.inputs.append(v)
        return v

    def const(self, name: str, arr) -> ir.Value:
        arr = np.asarray(arr)
        v = _value(name, arr, ir.DataType.from_numpy(arr.dtype))
        v.const_value = ir.tensor(arr, name=name)
        self.inits.append(v)
        return v

    def op(
        self,
        op_type: str,
        *inputs: ir.Value,
        name: str,
        shape,
        dtype: ir.DataType = ir.DataType.FLOAT,
        domain: str = "",
        **attrs,
    ) -> ir.Value:
        node = ir.Node(
            domain,
            op_type,
            list(inputs),
            attributes=ir.convenience.convert_attributes(attrs),
            num_outputs=1,
            name=name,
        )
        out = node.outputs[0]
        out.name, out.dtype, out.shape = f"{name}_out", dtype, ir.Shape(list(shape))
        self.nodes.append(node)
        return out

    def model(self, *outputs: ir.Value, opsets: dict[str, int] | None = None) -> ir.Model:
        graph = ir.Graph(
            self.inputs,
            list(outputs),
            nodes=self.nodes,
            initializers=self.inits,
            opset_imports=dict(opsets or OPSETS),
        )
        return ir.Model(graph, ir_version=IR_VERSION)


def run_model(model: ir.Model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = _session(model)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds), strict=True))
