"""Gradient specs of BatchNormalization (graph_passes/autodiff/rules/batch_norm.py).

Inference mode against ``F.batch_norm(training=False)`` (and, for the mean/var inputs that
torch does not differentiate, the same formula written out); training mode against
``F.batch_norm(training=True)``, with the running statistics ONNX defines (biased batch
variance, ONNX momentum = 1 - torch momentum) as the reference of outputs 1/2.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F

from ortrain.core.names import GradientError
from ortrain.graph_passes.autodiff import build_gradient_graph
from tests.gradcheck import IR_VERSION, In, Pos, Spec, TinyGraph, X, case, check_gradients

SHAPES = {"NC": (6, 3), "NCL": (4, 3, 5), "2d": (2, 3, 4, 5), "3d": (2, 3, 2, 3, 2)}


def _channel(v: torch.Tensor, rank: int) -> torch.Tensor:
    return v.reshape(1, -1, *([1] * (rank - 2)))


def _inference_ref(eps: float):
    def ref(x, scale, bias, mean, var):
        return F.batch_norm(x, mean, var, scale, bias, training=False, eps=eps)

    return ref


def _formula_ref(eps: float):
    """Inference mode written out, so torch differentiates mean and var too."""

    def ref(x, scale, bias, mean, var):
        r = x.dim()
        rstd = 1.0 / torch.sqrt(_channel(var, r) + eps)
        return (x - _channel(mean, r)) * rstd * _channel(scale, r) + _channel(bias, r)

    return ref


def _training_ref(eps: float, momentum: float):
    """(Y, running mean, running var) of ONNX training mode; ``momentum`` is ONNX's."""

    def ref(x, scale, bias, mean, var):
        y = F.batch_norm(x, None, None, scale, bias, training=True, eps=eps)
        axes = [0, *range(2, x.dim())]
        batch_mean = x.mean(axes).detach()
        batch_var = x.var(axes, correction=0).detach()
        new_mean = mean * momentum + batch_mean * (1 - momentum)
        new_var = var * momentum + batch_var * (1 - momentum)
        return y, new_mean, new_var

    return ref


def _constant_channel(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """N(0, 1) with channel 1 all equal (zero batch variance: rstd = 1/sqrt(eps))."""
    x = rng.standard_normal(shape)
    x[:, 1] = 0.75
    return x


def _inputs(shape: tuple[int, ...], *, stats_grad: bool = False, x: In | None = None) -> list:
    c = shape[1]
    return [
        x or X(*shape),
        X(c),
        X(c),
        X(c, grad=stats_grad),
        Pos(c, grad=stats_grad),
    ]


def _inference_specs() -> list[Spec]:
    specs = []
    for name, shape in SHAPES.items():
        for eps in (1e-5, 1e-2):
            specs.append(
                case(
                    f"BatchNormalization-infer-{name}-eps{eps:g}",
                    "BatchNormalization",
                    _inputs(shape),
                    _inference_ref(eps),
                    attrs={"epsilon": eps},
                )
            )
        specs.append(
            case(
                f"BatchNormalization-infer-{name}-stats-grad",
                "BatchNormalization",
                _inputs(shape, stats_grad=True),
                _formula_ref(1e-5),
            )
        )
    specs.append(
        case(
            "BatchNormalization-infer-2d-mode0-stats-grad",
            "BatchNormalization",
            _inputs(SHAPES["2d"], stats_grad=True),
            _formula_ref(1e-3),
            attrs={"epsilon": 1e-3, "training_mode": 0},
        )
    )
    return specs


def _training_specs() -> list[Spec]:
    specs = []
    for name, shape in SHAPES.items():
        for eps, momentum in ((1e-5, 0.9), (1e-3, 0.7)):
            specs.append(
                case(
                    f"BatchNormalization-train-{name}-eps{eps:g}-m{momentum:g}",
                    "BatchNormalization",
                    _inputs(shape),
                    _training_ref(eps, momentum),
                    attrs={"epsilon": eps, "momentum": momentum, "training_mode": 1},
                    outputs=3,
                    loss_outputs=(0,),
                )
            )
    specs.append(
        case(
            "BatchNormalization-train-2d-constant-channel",
            "BatchNormalization",
            _inputs(SHAPES["2d"], x=In(SHAPES["2d"], sample=_constant_channel, grad=True)),
            _training_ref(1e-5, 0.9),
            attrs={"training_mode": 1},
            outputs=3,
            loss_outputs=(0,),
        )
    )
    specs.append(
        case(
            "BatchNormalization-train-NCL-only-scale-bias",
            "BatchNormalization",
            [X(4, 3, 5, grad=False), X(3), X(3), X(3, grad=False), Pos(3, grad=False)],
            _training_ref(1e-5, 0.9),
            attrs={"training_mode": 1},
            outputs=3,
            loss_outputs=(0,),
        )
    )
    return specs


SPECS: list[Spec] = [*_inference_specs(), *_training_specs()]


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_rule(spec: Spec) -> None:
    check_gradients(spec)


def test_gradient_into_running_statistics_is_refused() -> None:
    spec = case(
        "BatchNormalization-train-running-mean-in-loss",
        "BatchNormalization",
        _inputs(SHAPES["NCL"]),
        _training_ref(1e-5, 0.9),
        attrs={"training_mode": 1},
        outputs=3,
        loss_outputs=(0, 1),
    )
    with pytest.raises(GradientError, match=r"BatchNormalization.*running mean"):
        check_gradients(spec)


def test_training_mode_before_opset_14_is_refused() -> None:
    """Opsets 9-13 mark training mode by the saved-statistics outputs: not supported."""
    g = TinyGraph()
    x, stats = g.input("x", (4, 3, 5)), [g.input(n, (3,)) for n in ("s", "b", "m", "v")]
    node = ir.Node("", "BatchNormalization", [x, *stats], num_outputs=5, name="bn")
    for k, o in enumerate(node.outputs):
        o.name, o.dtype = f"o{k}", ir.DataType.FLOAT
        o.shape = ir.Shape([4, 3, 5] if k == 0 else [3])
    loss = ir.Node("", "ReduceSum", [node.outputs[0]], num_outputs=1, name="loss")
    loss.outputs[0].name, loss.outputs[0].dtype = "loss", ir.DataType.FLOAT
    loss.outputs[0].shape = ir.Shape([])
    graph = ir.Graph([x, *stats], [loss.outputs[0]], nodes=[node, loss], opset_imports={"": 13})
    model = ir.Model(graph, ir_version=IR_VERSION)
    with pytest.raises(GradientError, match=r"BatchNormalization.*before opset 14"):
        build_gradient_graph(model, "loss", ["x"])
