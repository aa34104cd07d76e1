"""Gradient rules of graph_passes/autodiff/rules/reduce_more.py against torch.autograd.

Reductions over several shapes and axes (negative, several, all, none with
``noop_with_empty_axes``), keepdims 0/1, inputs with ties (integer-valued floats) for
Max/Min, zero rows for L2 and zeros for Prod; axes as input (opset 20) and as attribute
(opset 13, ``OLD_OPSET``). CumSum with exclusive/reverse over positive and negative axes.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from ortrain.graph_passes.autodiff import GradientError, build_gradient_graph
from ortrain.graph_passes.autodiff.rules.reduce_more import FX_NODE
from ortrain.graph_passes.infra.tags import is_backward
from tests import gradcheck
from tests.gradcheck import Const, In, NonZero, Spec, TinyGraph, X, case, check_gradients


def Ties(*shape: int, lo: int = -1, hi: int = 2) -> In:
    """Integer-valued floats in [lo, hi): many ties within every reduced set."""
    return In(tuple(shape), "float32", lambda rng, s: rng.integers(lo, hi, s), grad=True)


def Value(arr: object) -> In:
    """A differentiated float input with a fixed value (zeros where they matter)."""
    a = np.asarray(arr, dtype=np.float32)
    return In(a.shape, "float32", grad=True, value=a)


def _dims(x: torch.Tensor, axes: torch.Tensor | None) -> tuple[int, ...]:
    if axes is None or axes.numel() == 0:
        return tuple(range(x.dim()))
    return tuple(int(a) % x.dim() for a in axes.tolist())


def _prod(x: torch.Tensor, dim: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    # torch.prod takes one dim: reduce the axes one by one (highest first).
    for d in sorted(dim, reverse=True):
        x = torch.prod(x, d, keepdim=keepdim)
    return x


REFS = {
    "ReduceMax": lambda x, d, k: torch.amax(x, d, keepdim=k),
    "ReduceMin": lambda x, d, k: torch.amin(x, d, keepdim=k),
    "ReduceL1": lambda x, d, k: torch.linalg.vector_norm(x, 1, d, keepdim=k),
    "ReduceL2": lambda x, d, k: torch.linalg.vector_norm(x, 2, d, keepdim=k),
    "ReduceLogSumExp": lambda x, d, k: torch.logsumexp(x, d, keepdim=k),
    "ReduceSumSquare": lambda x, d, k: (x * x).sum(d, keepdim=k),
    "ReduceProd": _prod,
}
AXES = [([1], 1), ([1], 0), ([-1], 0), ([0, -1], 0), ([-2, 0], 1), (None, 0), (None, 1)]
SHAPES = [(2, 3, 4), (5, 6)]


def _sample(op: str, shape: tuple[int, ...]) -> In:
    if op in ("ReduceMax", "ReduceMin"):
        return Ties(*shape)
    if op == "ReduceProd":
        return NonZero(*shape)
    return X(*shape)


def _ref(op: str, keep: int):
    def ref(x, axes=None):
        return REFS[op](x, _dims(x, axes), bool(keep))

    return ref


def _reductions() -> list[Spec]:
    out = []
    for op, shape, (axes, keep) in itertools.product(REFS, SHAPES, AXES):
        if len(shape) == 2 and axes == [-2, 0]:
            continue  # the same axis twice
        inputs = [_sample(op, shape)] + ([] if axes is None else [Const(axes)])
        sid = f"{op}-{'x'.join(map(str, shape))}-axes{axes}-keep{keep}"
        out.append(case(sid, op, inputs, _ref(op, keep), attrs={"keepdims": keep}))
    # noop_with_empty_axes=1 and no axes: each element maps on its own (ONNX Runtime's L1
    # and L2 give |x|, SumSquare x*x, the others x).
    elementwise = {"ReduceL1": torch.abs, "ReduceL2": torch.abs, "ReduceSumSquare": torch.square}
    for op in REFS:
        fn = elementwise.get(op, lambda x: x)
        x = Value([[0.0, -1.5, 2.0], [0.5, 0.0, -0.7]]) if op in elementwise else X(3, 4)
        out.append(
            case(f"{op}-noop-empty-axes", op, [x, Const(np.zeros(0, np.int64))],
                 lambda x, axes, fn=fn: fn(x), attrs={"noop_with_empty_axes": 1})
        )  # fmt: skip
    return out


def _max_dim(op: str, keep: int):
    fn = torch.max if op == "ReduceMax" else torch.min

    def ref(x, axes):
        return fn(x, int(axes[0]), keepdim=bool(keep)).values

    return ref


# fmt: off
CORNERS: list[Spec] = [
    # Every element of a set tied: amax spreads the gradient over all of them.
    case("ReduceMax-all-tied", "ReduceMax", [Value(np.ones((3, 4))), Const([1])],
         _ref("ReduceMax", 0), attrs={"keepdims": 0}),
    case("ReduceMin-int-valued-wide", "ReduceMin", [Ties(4, 5, lo=-3, hi=3), Const([0])],
         _ref("ReduceMin", 1), attrs={"keepdims": 1}),
    # L2 of a zero row: torch's gradient is 0 there, not NaN.
    case("ReduceL2-zero-row", "ReduceL2", [Value([[0, 0, 0], [1, -2, 2], [0, 0, 3]]),
         Const([1])], _ref("ReduceL2", 0), attrs={"keepdims": 0}),
    case("ReduceL1-zeros", "ReduceL1", [Value([[0, 0, 1], [1, -2, 0]]), Const([-1])],
         _ref("ReduceL1", 1), attrs={"keepdims": 1}),
    # Prod with zeros: none, one (gradient = product of the others there), two (all 0).
    case("ReduceProd-zeros", "ReduceProd",
         [Value([[1.5, -2, 0.5, 3], [1.5, 0, 2, -1], [0, 2, 0, 1], [0, 0, 0, 0]]), Const([1])],
         _ref("ReduceProd", 0), attrs={"keepdims": 0}),
    case("ReduceProd-zeros-2axes", "ReduceProd",
         [Value(np.array([[[1, 0], [2, 3]], [[0, 0], [1, 2]], [[1, 2], [-1, 0.5]]])),
          Const([0, 2])], _ref("ReduceProd", 1), attrs={"keepdims": 1}),
    case("ReduceLogSumExp-large", "ReduceLogSumExp",
         [Value([[100.0, 101.0, 99.0], [-50.0, 3.0, 0.0]]), Const([1])],
         _ref("ReduceLogSumExp", 0), attrs={"keepdims": 0}),
]
# fmt: on

# torch.max(x, dim) / torch.min(x, dim) export to ReduceMax/ReduceMin tagged by the exporter
# with the aten op; torch sends their gradient to the first extremal index only.
MAX_DIM = [
    case(f"{op}-aten-dim{axis}-keep{keep}", op, [Ties(3, 5, 4), Const([axis])], _max_dim(op, keep),
         attrs={"keepdims": keep},
         metadata={FX_NODE: f"%m : call_function[target=torch.ops.{aten}](args = (%x, {axis}))"})
    for (op, aten), axis, keep in itertools.product(
        (("ReduceMax", "aten.max.dim"), ("ReduceMin", "aten.min.dim")), (1, -1), (0, 1))
]  # fmt: skip


def _cumsum_ref(exclusive: int, reverse: int):
    def ref(x, axis):
        d = int(axis)
        y = x.flip(d) if reverse else x
        c = torch.cumsum(y, d)
        c = c - y if exclusive else c
        return c.flip(d) if reverse else c

    return ref


CUMSUM = [
    case(f"CumSum-{'x'.join(map(str, s))}-axis{a}-{dt}-ex{ex}-rev{rev}", "CumSum",
         [X(*s), Const(a, dt)], _cumsum_ref(ex, rev), attrs={"exclusive": ex, "reverse": rev})
    for (s, a), dt, ex, rev in itertools.product(
        [((2, 5, 3), 1), ((2, 5, 3), -1), ((6,), 0)], ("int64", "int32"), (0, 1), (0, 1))
    if dt == "int64" or s == (6,)
]  # fmt: skip

SPECS: list[Spec] = [*_reductions(), *CORNERS, *MAX_DIM, *CUMSUM]


def _attr_axes(spec: Spec) -> Spec:
    """The same node at opset 13: axes as an attribute."""
    axes = spec.inputs[1].value if len(spec.inputs) > 1 else None
    attrs = dict(spec.attrs)
    if axes is None:
        return dataclasses.replace(spec, id=spec.id + "-opset13")
    attrs["axes"] = [int(a) for a in np.asarray(axes).reshape(-1)]
    const = torch.tensor(attrs["axes"])

    def ref(x, ref=spec.ref):
        return ref(x, const)

    return dataclasses.replace(
        spec, id=spec.id + "-opset13", inputs=spec.inputs[:1], attrs=attrs, ref=ref
    )


OLD_OPSET = [
    _attr_axes(s)
    for s in SPECS
    if s.op.startswith("Reduce") and "noop" not in s.id and "-2x3x4-" in s.id
] + [_attr_axes(s) for s in CORNERS + MAX_DIM[:2]]

_ids = [s.id for s in SPECS + OLD_OPSET]
assert len(_ids) == len(set(_ids)), "duplicate spec ids"


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_rule(spec: Spec) -> None:
    check_gradients(spec)


@pytest.mark.parametrize("spec", OLD_OPSET, ids=[s.id for s in OLD_OPSET])
def test_rule_axes_attribute(spec: Spec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gradcheck.OPSETS, "", 13)
    res, _ = check_gradients(spec)
    # The backward's own reductions take axes the opset-13 way too (ReduceProd by attribute).
    for node in res.model.graph:
        if node.op_type == "ReduceProd" and is_backward(node):
            assert "axes" in node.attributes and len(node.inputs) == 1


def test_ties_get_spread_not_duplicated() -> None:
    # The tie test must really have ties: amax over rows of integer-valued floats.
    spec = next(s for s in SPECS if s.id == "ReduceMax-5x6-axes[1]-keep0")
    rng = np.random.default_rng(gradcheck.seed_of(spec.id))
    x = spec.inputs[0].draw(rng)
    assert ((x == x.max(1, keepdims=True)).sum(1) > 1).any()
    check_gradients(spec)


def test_max_dim_tag_changes_the_gradient() -> None:
    # Without the tag the rule spreads over ties like amax, which torch.max(dim) does not:
    # the tied inputs make the two answers differ.
    tagged = next(s for s in MAX_DIM if s.id == "ReduceMax-aten-dim1-keep0")
    res, _ = check_gradients(tagged)
    assert [n.op_type for n in res.model.graph].count("ArgMax") == 1
    with pytest.raises(AssertionError, match="d loss / d input 0"):
        check_gradients(dataclasses.replace(tagged, metadata={}))


def test_max_dim_over_two_axes_is_refused() -> None:
    g = TinyGraph()
    x = g.input("x", (2, 3, 4))
    m = g.op("ReduceMax", x, g.const("axes", np.array([0, 1])), name="odd_max", shape=(4,),
             keepdims=0)  # fmt: skip
    m.producer().metadata_props[FX_NODE] = "torch.ops.aten.max.dim"
    loss = g.op("ReduceSum", m, name="loss", shape=(), keepdims=0)
    with pytest.raises(GradientError, match="odd_max"):
        build_gradient_graph(g.model(loss), loss.name, ["x"])


def test_exporter_tags_torch_max_dim() -> None:
    # The rule relies on the dynamo exporter's fx_node record; check it is there.
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.max(x, 1).values + torch.amax(x, 1)

    prog = torch.onnx.export(M().eval(), (torch.randn(2, 3),), dynamo=True, verbose=False)
    reduce_max = [n for n in prog.model.graph if n.op_type == "ReduceMax"]
    tags = sorted("aten.max.dim" in n.metadata_props.get(FX_NODE, "") for n in reduce_max)
    assert tags == [False, True]
