"""Gradient rules of activations and unary math (graph_passes/autodiff/rules/activation.py)
and of Max / Min, against torch.autograd.

Every kink is also checked on inputs that sit exactly on it (``Exact``): torch's backward
kernels decide there (clamp passes min <= x <= max, hardtanh / relu6 only min < x < max,
hardswish is 0 at -3 and 1 at 3, torch.maximum halves a tie, amax spreads it evenly...).
Rules that follow the torch op the exporter translated read the node's
``pkg.torch.onnx.fx_node`` (``_fx``), as the dynamo exporter writes it.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F

from ortrain.graph_passes.autodiff import build_gradient_graph
from ortrain.graph_passes.autodiff.rules.activation import exported_from
from tests import gradcheck
from tests.gradcheck import (
    Const,
    Fixed,
    In,
    Pos,
    Spec,
    TinyGraph,
    X,
    assert_close,
    case,
    check_gradients,
    run_model,
)

F32 = np.float32
BELOW_3, ABOVE_3 = float(np.nextafter(F32(3), F32(0))), float(np.nextafter(F32(3), F32(4)))


def Exact(values, shape: tuple[int, ...] | None = None, grad: bool = True) -> In:
    """A float32 graph input with exactly these values (points on a kink, ties)."""
    arr = np.asarray(values, dtype="float32")
    if shape is not None:
        arr = arr.reshape(shape)
    return dataclasses.replace(Fixed(arr, "float32"), grad=grad)


def Uniform(lo: float, hi: float, *shape: int) -> In:
    """A differentiated float input drawn uniformly from [lo, hi)."""
    return In(tuple(shape), "float32", lambda rng, s: rng.uniform(lo, hi, s), True)


def _fx(aten: str, overload: str = "default") -> dict[str, str]:
    """The exporter's record of the torch op a node came from."""
    return {
        "pkg.torch.onnx.fx_node": f"%{aten} : [num_users=1] = call_function[target=torch.ops."
        f"aten.{aten}.{overload}](args = (%x,), kwargs = {{}})"
    }


def _stack_extremum(fn):
    """n-ary max/min whose tie gradient is spread evenly (torch.amax / amin)."""

    def ref(*xs):
        return fn(torch.stack(torch.broadcast_tensors(*xs)), 0)

    return ref


def _prelu_where(x, slope):
    return torch.where(x > 0, x, slope * x)


def _shrink(bias: float, lambd: float):
    def ref(x):
        return torch.where(x > lambd, x - bias, torch.where(x < -lambd, x + bias, x * 0))

    return ref


def _hard_sigmoid(alpha: float, beta: float):
    def ref(x):  # torch's hardsigmoid is flat at its bounds: hardtanh's backward
        return F.hardtanh(alpha * x + beta, 0.0, 1.0)

    return ref


def _unary(op: str, fn, make, shapes) -> list[Spec]:
    return [case(f"{op}-{'x'.join(map(str, s)) or 'scalar'}", op, [make(*s)], fn) for s in shapes]


SHAPES = [(2, 3, 4), (7,), ()]
KINKS = [-4.0, -3.0, -1.5, -1.0, -0.5, 0.0, 0.0, 0.5, 0.75, 1.0, 3.0, 6.0, 7.0, BELOW_3,
         ABOVE_3, -BELOW_3, -ABOVE_3, 2.0]  # fmt: skip
TIES = Exact(KINKS, (3, 6))

# fmt: off
SPECS: list[Spec] = [
    # Clip, opset 11+: optional scalar min / max inputs, constant or differentiated.
    case("Clip-const-bounds", "Clip", [X(3, 4), Const(-0.5, "float32"), Const(0.7, "float32")],
         torch.clamp),
    case("Clip-min-only", "Clip", [X(2, 3, 4), Const(-0.3, "float32")],
         lambda x, lo: torch.clamp(x, min=lo)),
    case("Clip-max-only", "Clip", [X(5), None, Const(0.2, "float32")],
         lambda x, hi: torch.clamp(x, max=hi)),
    case("Clip-no-bounds", "Clip", [X(3, 4)], lambda x: x),
    case("Clip-ties-const", "Clip", [TIES, Const(-0.5, "float32"), Const(0.75, "float32")],
         torch.clamp),
    case("Clip-ties-tensor-bounds", "Clip", [TIES, Exact(-0.5), Exact(0.75)], torch.clamp),
    case("Clip-tensor-bounds", "Clip", [X(4, 5), Exact(-0.25), Exact(0.4)], torch.clamp),
    case("Clip-tensor-min-only", "Clip", [TIES, Exact(0.0)], lambda x, lo: torch.clamp(x, lo)),
    case("Clip-tensor-max-only", "Clip", [TIES, None, Exact(1.0)],
         lambda x, hi: torch.clamp(x, max=hi)),
    case("Clip-min-above-max", "Clip", [TIES, Exact(0.5), Exact(-0.5)], torch.clamp),
    case("Clip-min-equals-max", "Clip", [TIES, Exact(0.75), Exact(0.75)], torch.clamp),
    case("Clip-bounds-frozen", "Clip", [TIES, Exact(-1.0, grad=False), Exact(1.0, grad=False)],
         torch.clamp),
    # hardtanh / relu6 export to Clip; their backward is 0 on the bounds.
    case("Clip-hardtanh-ties", "Clip", [TIES, Const(-0.5, "float32"), Const(0.75, "float32")],
         lambda x, lo, hi: F.hardtanh(x, -0.5, 0.75), metadata=_fx("hardtanh")),
    case("Clip-relu6-ties", "Clip", [TIES, Const(0.0, "float32"), Const(6.0, "float32")],
         lambda x, lo, hi: F.relu6(x), metadata=_fx("relu6")),
    case("Clip-relu6-2x3x4", "Clip",
         [Uniform(-2, 8, 2, 3, 4), Const(0.0, "float32"), Const(6.0, "float32")],
         lambda x, lo, hi: F.relu6(x), metadata=_fx("relu6")),
    case("Clip-hardtanh-inplace-ties", "Clip", [TIES, Const(-1.0, "float32"),
         Const(1.0, "float32")], lambda x, lo, hi: F.hardtanh(x), metadata=_fx("hardtanh_")),
    # Rectifiers: the negative slope at 0, as torch.
    case("LeakyRelu-default", "LeakyRelu", [X(2, 3, 4)], F.leaky_relu),
    case("LeakyRelu-alpha0.2", "LeakyRelu", [X(7)], lambda x: F.leaky_relu(x, 0.2),
         attrs={"alpha": 0.2}),
    case("LeakyRelu-ties", "LeakyRelu", [TIES], lambda x: F.leaky_relu(x, 0.125),
         attrs={"alpha": 0.125}),
    case("PRelu-channel", "PRelu", [X(2, 3, 4, 5), X(3, 1, 1)],
         lambda x, w: F.prelu(x, w.reshape(3))),
    case("PRelu-2d-features", "PRelu", [X(3, 4), X(1, 4)], lambda x, w: F.prelu(x, w.reshape(4))),
    case("PRelu-single", "PRelu", [X(2, 3, 4), X(1)], F.prelu),
    case("PRelu-last-axis", "PRelu", [X(2, 3, 4), X(4)], _prelu_where),
    case("PRelu-same-shape", "PRelu", [X(3, 4), X(3, 4)], _prelu_where),
    case("PRelu-slope-frozen", "PRelu", [X(2, 3, 4, 5), X(3, 1, 1, grad=False)],
         lambda x, w: F.prelu(x, w.reshape(3))),
    case("PRelu-ties", "PRelu", [Exact(KINKS, (6, 3)), Exact([0.25, -0.5, 2.0])], F.prelu),
    case("ThresholdedRelu-default", "ThresholdedRelu", [Uniform(-1, 3, 2, 3, 4)],
         lambda x: F.threshold(x, 1.0, 0.0)),
    case("ThresholdedRelu-alpha", "ThresholdedRelu", [X(7)], lambda x: F.threshold(x, 0.5, 0.0),
         attrs={"alpha": 0.5}),
    case("ThresholdedRelu-ties", "ThresholdedRelu", [TIES], lambda x: F.threshold(x, 0.75, 0.0),
         attrs={"alpha": 0.75}),
    case("Elu-default", "Elu", [X(2, 3, 4)], F.elu),
    case("Elu-alpha", "Elu", [X(7)], lambda x: F.elu(x, 0.7), attrs={"alpha": 0.7}),
    case("Elu-ties", "Elu", [TIES], lambda x: F.elu(x, 0.5), attrs={"alpha": 0.5}),
    case("Selu-default", "Selu", [X(2, 3, 4)], F.selu),
    case("Selu-attrs", "Selu", [X(7)], lambda x: 1.5 * F.elu(x, 0.5),
         attrs={"alpha": 0.5, "gamma": 1.5}),
    case("Selu-ties", "Selu", [TIES], F.selu),
    case("Celu-default", "Celu", [X(2, 3, 4)], F.celu),
    case("Celu-alpha0.5", "Celu", [X(7)], lambda x: F.celu(x, 0.5), attrs={"alpha": 0.5}),
    case("Celu-alpha2-ties", "Celu", [TIES], lambda x: F.celu(x, 2.0), attrs={"alpha": 2.0}),
    # Smooth and hard sigmoid-like.
    *_unary("Softplus", F.softplus, X, SHAPES),
    case("Softplus-wide", "Softplus", [Uniform(-15, 15, 4, 5)], F.softplus),
    *_unary("Softsign", F.softsign, X, SHAPES),
    case("Softsign-ties", "Softsign", [TIES], F.softsign),
    *_unary("Mish", F.mish, X, SHAPES),
    case("Mish-wide", "Mish", [Uniform(-8, 8, 4, 5)], F.mish),
    case("HardSigmoid-default", "HardSigmoid", [Uniform(-4, 4, 2, 3, 4)], _hard_sigmoid(0.2, 0.5)),
    case("HardSigmoid-torch", "HardSigmoid", [Uniform(-4, 4, 7)], F.hardsigmoid,
         attrs={"alpha": 1 / 6, "beta": 0.5}),
    case("HardSigmoid-torch-ties", "HardSigmoid", [TIES], F.hardsigmoid,
         attrs={"alpha": 1 / 6, "beta": 0.5}),
    case("HardSigmoid-negative-alpha-ties", "HardSigmoid", [TIES], _hard_sigmoid(-0.25, 0.5),
         attrs={"alpha": -0.25, "beta": 0.5}),
    case("HardSwish-2x3x4", "HardSwish", [Uniform(-5, 5, 2, 3, 4)], F.hardswish),
    case("HardSwish-7", "HardSwish", [X(7)], F.hardswish),
    case("HardSwish-ties", "HardSwish", [TIES], F.hardswish),
    case("Shrink-default-hardshrink", "Shrink", [X(2, 3, 4)], lambda x: F.hardshrink(x, 0.5)),
    case("Shrink-softshrink", "Shrink", [X(7)], lambda x: F.softshrink(x, 0.75),
         attrs={"bias": 0.75, "lambd": 0.75}),
    case("Shrink-bias-lambd", "Shrink", [X(3, 4)], _shrink(0.25, 0.5),
         attrs={"bias": 0.25, "lambd": 0.5}),
    case("Shrink-softshrink-ties", "Shrink", [TIES], lambda x: F.softshrink(x, 0.5),
         attrs={"bias": 0.5, "lambd": 0.5}),
    case("Shrink-hardshrink-ties", "Shrink", [TIES], lambda x: F.hardshrink(x, 0.75),
         attrs={"lambd": 0.75}),
    # Variadic Mean.
    case("Mean-1", "Mean", [X(3, 4)], lambda x: x),
    case("Mean-2", "Mean", [X(3, 4), X(3, 4)], lambda a, b: (a + b) / 2),
    case("Mean-3-bcast", "Mean", [X(2, 3, 4), X(4), X(3, 1)], lambda a, b, c: (a + b + c) / 3),
    case("Mean-3-one-frozen", "Mean", [X(3, 4), X(3, 4, grad=False), X()],
         lambda a, b, c: (a + b + c) / 3),
    # Max / Min: torch.maximum halves a tie; n inputs spread it evenly (amax / amin).
    case("Max-1", "Max", [X(3, 4)], lambda x: x),
    case("Max-3-bcast", "Max", [X(2, 3, 4), X(4), X(3, 1)], _stack_extremum(torch.amax)),
    case("Max-2-ties", "Max", [Exact([[1, 2, 3], [-1, 0, 5]]), Exact([[1, 0, 3], [-1, 0, 6]])],
         torch.maximum),
    case("Max-2-ties-bcast", "Max", [Exact([[1, 2, 3], [0, 2, -1]]), Exact([0, 2, 3])],
         torch.maximum),
    case("Max-3-ties", "Max",
         [Exact([1, 2, 3, 4, 0]), Exact([1, 2, 1, 4, 5]), Exact([1, 0, 3, 4, 5])],
         _stack_extremum(torch.amax)),
    case("Max-4-ties-bcast", "Max",
         [Exact([[1, 2], [3, 3]]), Exact([1, 2]), Exact([[1], [3]]), Exact(1.0)],
         _stack_extremum(torch.amax)),
    case("Min-1", "Min", [X(5)], lambda x: x),
    case("Min-3-bcast", "Min", [X(3, 1), X(3, 4), X()], _stack_extremum(torch.amin)),
    case("Min-2-ties", "Min", [Exact([1, 2, 3, 4]), Exact([1, 0, 3, 5])], torch.minimum),
    case("Min-3-ties-one-frozen", "Min",
         [Exact([1, 2, 3, 4]), Exact([1, 2, 3, 5], grad=False), Exact([1, 0, 3, 4])],
         _stack_extremum(torch.amin)),
    # Max / Min of an exported torch.clamp(x, min_t, max_t): x takes the whole tie.
    case("Max-clamp-min-ties", "Max", [TIES, Exact([0.0, 0.5, -1.0, 3.0, 6.0, 7.0])],
         lambda x, lo: torch.clamp(x, min=lo), metadata=_fx("clamp", "Tensor")),
    case("Min-clamp-max-ties", "Min", [TIES, Exact([0.0, 0.5, -1.0, 3.0, 6.0, 7.0])],
         lambda x, hi: torch.clamp(x, max=hi), metadata=_fx("clamp", "Tensor")),
    case("Max-clamp-min-op-ties", "Max", [TIES, Exact(0.0)],
         lambda x, lo: torch.clamp_min(x, lo), metadata=_fx("clamp_min", "Tensor")),
    # Trigonometric and hyperbolic.
    *_unary("Sin", torch.sin, X, SHAPES),
    *_unary("Cos", torch.cos, X, SHAPES),
    case("Sin-ties", "Sin", [TIES], torch.sin),
    case("Cos-ties", "Cos", [TIES], torch.cos),
    *_unary("Tan", torch.tan, lambda *s: Uniform(-1.2, 1.2, *s), SHAPES),
    *_unary("Atan", torch.atan, lambda *s: Uniform(-4, 4, *s), SHAPES),
    *_unary("Asin", torch.asin, lambda *s: Uniform(-0.9, 0.9, *s), SHAPES),
    *_unary("Acos", torch.acos, lambda *s: Uniform(-0.9, 0.9, *s), SHAPES),
    *_unary("Sinh", torch.sinh, lambda *s: Uniform(-3, 3, *s), SHAPES),
    *_unary("Cosh", torch.cosh, lambda *s: Uniform(-3, 3, *s), SHAPES),
    *_unary("Asinh", torch.asinh, lambda *s: Uniform(-4, 4, *s), SHAPES),
    *_unary("Acosh", torch.acosh, lambda *s: Uniform(1.2, 4, *s), SHAPES),
    *_unary("Atanh", torch.atanh, lambda *s: Uniform(-0.9, 0.9, *s), SHAPES),
    case("Atan-ties", "Atan", [TIES], torch.atan),
    case("Asinh-pos", "Asinh", [Pos(3, 4)], torch.asinh),
    # piecewise constant: torch's gradient is zeros (not None), so is the rule's
    case("Sign-zero-gradient", "Sign", [X(2, 3, 4)], torch.sign),
    case("Floor-zero-gradient", "Floor", [X(3, 4)], torch.floor),
    case("Ceil-zero-gradient", "Ceil", [X(3, 4)], torch.ceil),
    case("Round-zero-gradient", "Round", [X(3, 4)], torch.round),
]

# Clip before opset 11: min / max are attributes (absent: unbounded on that side).
CLIP_ATTRIBUTE_SPECS: list[Spec] = [
    case("Clip6-both", "Clip", [X(3, 4)], lambda x: torch.clamp(x, -0.5, 0.75),
         attrs={"min": -0.5, "max": 0.75}),
    case("Clip6-ties", "Clip", [TIES], lambda x: torch.clamp(x, -0.5, 0.75),
         attrs={"min": -0.5, "max": 0.75}),
    case("Clip6-min-only-ties", "Clip", [TIES], lambda x: torch.clamp(x, min=0.0),
         attrs={"min": 0.0}),
    case("Clip6-max-only-ties", "Clip", [TIES], lambda x: torch.clamp(x, max=1.0),
         attrs={"max": 1.0}),
    case("Clip6-none", "Clip", [X(2, 3, 4)], lambda x: x),
    case("Clip6-relu6-ties", "Clip", [TIES], F.relu6, attrs={"min": 0.0, "max": 6.0},
         metadata=_fx("relu6")),
]
# fmt: on

_ids = [s.id for s in SPECS + CLIP_ATTRIBUTE_SPECS]
assert len(_ids) == len(set(_ids)), "duplicate spec ids"


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_rule(spec: Spec) -> None:
    check_gradients(spec)


@pytest.mark.parametrize("spec", CLIP_ATTRIBUTE_SPECS, ids=[s.id for s in CLIP_ATTRIBUTE_SPECS])
def test_clip_attribute_form(spec: Spec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gradcheck.OPSETS, "", 10)
    res, _ = check_gradients(spec)
    # opset 10 has no GreaterOrEqual / LessOrEqual: the rule spells them with Not
    ops = {n.op_type for n in res.model.graph}
    assert not ops & {"GreaterOrEqual", "LessOrEqual"}


def _grad_ops(res) -> list[str]:
    return [n.op_type for n in res.model.graph if n.name != "node_under_test"]


def test_clip_bounds_are_open_only_for_hardtanh_and_relu6() -> None:
    specs = {s.id: s for s in SPECS}
    clamp = _grad_ops(check_gradients(specs["Clip-ties-const"])[0])
    relu6 = _grad_ops(check_gradients(specs["Clip-relu6-ties"])[0])
    assert {"GreaterOrEqual", "LessOrEqual"} <= set(clamp)
    assert {"Greater", "Less"} <= set(relu6) and not {"GreaterOrEqual", "LessOrEqual"} & set(relu6)


def test_max_of_two_does_not_keep_its_output_for_the_backward() -> None:
    # torch's formula compares the inputs: the forward output need not stay alive
    res, _ = check_gradients(next(s for s in SPECS if s.id == "Max-2-ties"))
    node = next(n for n in res.model.graph if n.name == "node_under_test")
    readers = {u.node.op_type for u in node.outputs[0].uses()}
    assert readers == {"Mul"}  # the loss only


def test_exported_from_reads_the_exporter_record() -> None:
    node = ir.Node("", "Clip", [], metadata_props=_fx("hardtanh_"))
    assert exported_from(node) == "hardtanh"
    node = ir.Node("", "Max", [], metadata_props={
        "pkg.torch.onnx.class_hierarchy": "['__main__.M', 'aten.clamp.Tensor']"})  # fmt: skip
    assert exported_from(node) == "clamp"
    assert exported_from(ir.Node("", "Clip", [])) is None


def _clamp_pair(hi_shape: tuple[int, ...], shared: bool) -> tuple[ir.Model, str]:
    """torch.clamp(x, lo, hi) as the exporter writes it: Max(x, lo) then Min(., hi), both
    tagged with the same aten.clamp.Tensor call; loss = sum(clamp * r). ``shared``: the Max
    also feeds the loss directly (CSE merged a torch.clamp(x, min=lo) into it)."""
    g = TinyGraph()
    x, lo, hi = g.input("x", (3, 4)), g.input("lo", (4,)), g.input("hi", hi_shape)
    m = g.op("Max", x, lo, name="clamp_max", shape=(3, 4))
    y = g.op("Min", m, hi, name="clamp_min", shape=(3, 4))
    for node in g.nodes:
        node.metadata_props.update(_fx("clamp", "Tensor"))
    r = g.const("r", np.linspace(-1, 1, 12, dtype=F32).reshape(3, 4))
    p = g.op("Mul", y, r, name="mul", shape=(3, 4))
    if shared:
        p = g.op("Add", p, g.op("Mul", m, r, name="mul_m", shape=(3, 4)), name="add", shape=(3, 4))
    loss = g.op("ReduceSum", p, name="loss", shape=(), keepdims=0)
    return g.model(loss), loss.name


@pytest.mark.parametrize("shared", [False, True], ids=["alone", "max-shared"])
@pytest.mark.parametrize("hi_shape", [(4,), (3, 4)], ids=["hi-4", "hi-3x4"])
def test_exported_clamp_with_tensor_bounds_matches_torch_on_ties(hi_shape, shared) -> None:
    # x == lo and x == hi in places; lo == hi in columns 0 and 2 (torch gives lo nothing
    # there, and x only where x == lo == hi), lo > hi in column 3 (the output is hi)
    xs = np.array([[0, 1, 2, 3], [1, 1, -1, 0], [-2, 0.5, 1.5, 5]], F32)
    lo = np.array([1, 0.5, 1, 2], F32)
    hi = np.broadcast_to(np.array([1, 1.5, 1, 1], F32), hi_shape).copy()
    model, loss = _clamp_pair(hi_shape, shared)
    res = build_gradient_graph(model, loss, ["x", "lo", "hi"])
    got = run_model(model, {"x": xs, "lo": lo, "hi": hi})
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
         for k, v in (("x", xs), ("lo", lo), ("hi", hi))}  # fmt: skip
    r = torch.linspace(-1, 1, 12, dtype=torch.float32).reshape(3, 4).double()
    want = torch.clamp(t["x"], t["lo"], t["hi"]) * r
    if shared:
        want = want + torch.clamp(t["x"], min=t["lo"]) * r
    want.sum().backward()
    for k in ("x", "lo", "hi"):
        assert_close(got[res.grad_outputs[k]], t[k].grad.numpy(), f"d loss / d {k}")
    # the Min's rule found its Max: min == max needs both bounds
    assert [n for n in model.graph if n.op_type == "And"]


# --- what the exporter emits -------------------------------------------------------------------


class _Activations(torch.nn.Module):
    """The torch.nn.functional activations of the brief, summed."""

    def __init__(self) -> None:
        super().__init__()

    def forward(self, x, slope, lo, hi, w) -> torch.Tensor:
        # inputs, not parameters: the exporter folds what reads only initializers
        outs = [
            F.hardtanh(x, -0.5, 0.7), F.relu6(x), F.elu(x, 0.8), F.selu(x), F.celu(x, 1.3),
            F.leaky_relu(x, 0.2), F.prelu(x, slope), F.softplus(x),
            F.softplus(x, beta=2.0, threshold=5.0), F.softsign(x), F.mish(x), F.hardswish(x),
            F.hardsigmoid(x), F.silu(x), F.logsigmoid(x), F.tanhshrink(x),
            F.softshrink(x, 0.3), F.hardshrink(x, 0.3), torch.sin(x), torch.cos(x),
            torch.atan(x), torch.clamp(x, lo, hi), torch.clamp(x, min=lo),
            torch.clamp(x, -0.5, 0.5), torch.maximum(x, hi), torch.minimum(x, lo),
            torch.log1p(x.abs()), torch.expm1(x), torch.log2(x.abs() + 1), torch.rsqrt(x.abs() + 1),
            torch.square(x), F.threshold(x, 0.5, 2.0), F.glu(x, -1).repeat(1, 1, 2), F.relu(x),
        ]  # fmt: skip
        return sum((o * w).sum() for o in outs)


def test_every_op_the_exporter_emits_for_activations_has_a_rule() -> None:
    from ortrain.graph_passes.autodiff import registry

    x = torch.linspace(-4, 4, 24).reshape(2, 3, 4)
    args = (x, torch.full((3,), 0.25), torch.full((4,), -0.5), torch.full((4,), 0.5), x / 4)
    onnx_model = torch.onnx.export(_Activations().eval(), args, dynamo=True, verbose=False).model
    opset = onnx_model.opset_imports[""]
    ops = {(n.op_type, n.version or opset) for n in onnx_model.graph}
    missing = sorted(op for op, v in ops if registry.lookup(op, "", v) is None)
    assert not missing, missing
    names = {op for op, _ in ops}
    assert {"Clip", "Elu", "Selu", "Celu", "LeakyRelu", "PRelu", "Softplus", "Mish",
            "HardSwish", "HardSigmoid", "Sin", "Cos", "Atan", "Max", "Min"} <= names  # fmt: skip
    # the torch ops whose backward differs from the ONNX op's on ties are recognized
    origins = {exported_from(n) for n in onnx_model.graph if n.op_type in ("Clip", "Max", "Min")}
    assert {"hardtanh", "relu6", "clamp", "maximum", "minimum"} <= origins


# --- end to end: ORTTrainer against eager ------------------------------------------------------


class _ActivationMLP(torch.nn.Module):
    """A small classifier whose hidden layers mix most of the activations above (not
    F.logsigmoid: its hidden values reach -20 by step 4, see the xfail test below)."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(12, width), torch.nn.Linear(width, width)
        self.l3, self.out = torch.nn.Linear(width, width), torch.nn.Linear(width, 5)
        self.prelu = torch.nn.PReLU(width, init=0.2)
        self.lo = torch.nn.Parameter(torch.full((width,), -0.6))
        self.hi = torch.nn.Parameter(torch.full((width,), 0.7))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        h = (F.hardtanh(h, -1.5, 1.5) + F.relu6(4 * h) / 4 + F.elu(h) + F.selu(h)
             + F.celu(h, 0.7) + F.leaky_relu(h, 0.1))  # fmt: skip
        h = self.l2(h)
        h = (self.prelu(h) + F.softplus(h, beta=2.0, threshold=1.0) + F.softsign(h) + F.mish(h)
             + F.hardswish(h) + F.hardsigmoid(h) + F.silu(h))  # fmt: skip
        h = self.l3(h)
        h = (F.tanhshrink(h) + F.softshrink(h, 0.2) + F.hardshrink(h, 0.2)
             + torch.sin(h) + torch.cos(h) + torch.atan(h) + torch.clamp(h, self.lo, self.hi)
             + torch.maximum(h, self.lo) + torch.minimum(h, self.hi))  # fmt: skip
        return F.cross_entropy(self.out(h), y)


def _train_both(model: torch.nn.Module, batches: list[dict], first_grads: bool):
    """AdamW on ``model`` through ORTTrainer and on a copy in eager: every loss (1e-4
    relative), the parameters at the end (1e-4), and with ``first_grads`` the first step's
    gradients element-wise at the gradient rules' tolerance."""
    from ortrain import ORTTrainer, TrainerOptions

    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    # "torch" update: the gradients stay readable in trainer.grads after the step
    trainer = ORTTrainer(model, opt, TrainerOptions(update_engine="torch"))
    for step, batch in enumerate(batches):
        ref_opt.zero_grad()
        want = ref(**batch)
        want.backward()
        loss = trainer.train_step(**batch)
        if step == 0 and first_grads:
            for name, p in ref.named_parameters():
                assert_close(trainer.grads[name].numpy(), p.grad.numpy(), f"step 0 grad {name}")
        ref_opt.step()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-4, atol=0, msg=f"loss {step}")
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4 * q.abs().max().item(), msg=name)
    return trainer


def test_activation_mlp_trains_like_eager() -> None:
    g = torch.Generator().manual_seed(3)
    batches = [{"x": torch.randn(16, 12, generator=g), "y": torch.randint(0, 5, (16,), generator=g)}
               for _ in range(8)]  # fmt: skip
    trainer = _train_both(_ActivationMLP(), batches, first_grads=True)
    ops = {n.op_type for n in trainer.train_graphs[0].graph}
    assert {"Clip", "Elu", "Selu", "Celu", "LeakyRelu", "PRelu", "Softplus", "Mish",
            "HardSwish", "HardSigmoid", "Sin", "Cos", "Atan", "Max", "Min"} <= ops  # fmt: skip


class _OnTheKinks(torch.nn.Module):
    """Activations of ``x + shift`` with ``shift`` starting at 0 and x on a half-integer
    grid: the first step's inputs sit exactly on every kink and tie. No two calls export
    to the same ONNX node: CSE would merge them, and one node has one tie rule."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.shift = torch.nn.Parameter(torch.zeros(width))
        self.slope = torch.nn.Parameter(torch.full((width,), 0.25))
        self.lo = torch.nn.Parameter(torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0, 0.0, -3.0, 0.0]))
        self.hi = torch.nn.Parameter(torch.tensor([1.0, 0.5, 0.0, 3.0, 1.0, 6.0, 3.0, -1.0]))

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        h = x + self.shift
        outs = [
            F.relu6(h), F.hardtanh(h), F.hardtanh(h, -0.5, 3.0), F.hardswish(h),
            F.hardsigmoid(h), F.leaky_relu(h, 0.1), F.elu(h), F.selu(h), F.celu(h, 2.0),
            F.prelu(h, self.slope), F.softshrink(h, 0.5), F.hardshrink(h, 1.0), F.relu(h),
            F.threshold(h, 1.0, 0.0), torch.clamp(h, -1.0, 2.5), torch.clamp(h, min=0.5),
            torch.clamp(h, self.lo, self.hi), torch.clamp(h, min=self.hi),
            torch.clamp(h, max=self.lo), torch.maximum(h, 2 * self.lo),
            torch.minimum(h, self.hi + 0.5), torch.maximum(torch.maximum(h, -h), self.hi),
        ]  # fmt: skip
        return sum((o * r[k]).sum() for k, o in enumerate(outs)) / h.numel()


def test_activations_on_their_kinks_train_like_eager() -> None:
    grid = torch.arange(-8, 8, dtype=torch.float32).reshape(2, 8) / 2  # -4 .. 3.5 by 0.5
    x = torch.cat([grid, grid + 3.0, torch.full((1, 8), 6.0)])  # 6: relu6's upper bound
    g = torch.Generator().manual_seed(5)
    batches = [{"x": x, "r": torch.randn(22, 5, 8, generator=g)} for _ in range(8)]
    _train_both(_OnTheKinks(), batches, first_grads=True)


class _LogSigmoid(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.logsigmoid(x * self.w).sum()


def test_logsigmoid_of_large_negative_inputs_trains_like_eager() -> None:
    from ortrain import ORTTrainer

    model = _LogSigmoid()
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.tensor([-30.0, -25.0, -5.0, 2.0])
    # graph_passes/fusions/log_sigmoid.py: Log(Sigmoid(x)) runs as -Softplus(-x)
    torch.testing.assert_close(trainer.train_step(x=x), _LogSigmoid()(x).detach())
    ops = {n.op_type for n in trainer.train_graphs[0].graph}
    assert "Softplus" in ops and "Log" not in ops


def test_a_parameter_read_only_through_round_is_decayed_like_torch() -> None:
    """torch gives a parameter read only through a piecewise-constant op (round, floor,
    sign) a gradient of zeros, not None: AdamW still decays it and moves its moments. The
    trainer reaches it too (its gradient is zeros) and updates it alike."""
    from ortrain import ORTTrainer, TrainerOptions

    class Quantized(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(3, 3)
            self.levels = torch.nn.Parameter(3 * torch.randn(3))

        def forward(self, x):
            scale = torch.round(self.levels) + torch.floor(self.levels) * torch.sign(x.sum())
            return (self.lin(x) * scale).pow(2).mean()

    model = Quantized()
    ref = copy.deepcopy(model)
    start = model.levels.detach().clone()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    options = TrainerOptions(build_progress=False)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1),
                         options)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(4, 3, generator=g)
        opt_ref.zero_grad()
        want = ref(x)
        want.backward()
        opt_ref.step()
        torch.testing.assert_close(trainer.train_step(x), want.detach(), rtol=1e-5, atol=1e-7)
    assert "levels" in trainer.grad_params and torch.equal(ref.levels.grad, torch.zeros(3))
    assert not torch.equal(model.levels.detach(), start)  # decayed, as in eager
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
