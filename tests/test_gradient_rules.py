"""Table-driven gradient tests of the autodiff rule table.

Every row of ``SPECS`` is one ONNX node, its inputs and a torch function computing the
same thing; ``check_gradients`` (tests/gradcheck.py) builds the node's gradient graph with
``build_gradient_graph``, runs it in ONNX Runtime and compares every gradient with
torch.autograd (rtol 1e-5, atol 1e-5 x max|reference|). The structural tests at the end
check what the builder emits (frozen paths, merged contributions, errors).

Input helpers: ``X`` float N(0,1) (differentiated unless ``grad=False``), ``Pos`` in
[0.5, 2], ``NonZero`` |x| in [0.5, 2], ``Const`` an initializer, ``Index`` int64 input,
``Fixed`` a graph input with a fixed value, ``Mask`` bool input, ``Labels`` class labels.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F

from ortrain.graph_passes.autodiff import GradientError, build_gradient_graph, registry
from ortrain.graph_passes.infra.emitter import MS_DOMAIN
from ortrain.graph_passes.infra.tags import PADDING_IDX
from tests.gradcheck import (
    Const,
    Fixed,
    Index,
    Labels,
    Mask,
    NonZero,
    Pos,
    Spec,
    TinyGraph,
    X,
    assert_close,
    case,
    check_gradients,
    run_model,
)

FLOAT, DOUBLE = ir.DataType.FLOAT.value, ir.DataType.DOUBLE.value


def _ids(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


# --- generated families ------------------------------------------------------------------

BINARY_SHAPES = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 4)), ((2, 1, 4), (3, 1)),
                 ((3, 4), ())]  # fmt: skip
BINARY_OPS = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div}


def _binary() -> list[Spec]:
    out = []
    for (op, fn), (sa, sb) in itertools.product(BINARY_OPS.items(), BINARY_SHAPES):
        rhs = NonZero(*sb) if op == "Div" else X(*sb)
        out.append(case(f"{op}-{_ids(sa)}-{_ids(sb)}", op, [X(*sa), rhs], fn))
    return out


def _mod() -> list[Spec]:
    """Floating ``Mod`` is C's fmod (``fmod=1``, ``torch.fmod``): d/db = -trunc(a / b)."""
    shapes = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 4), ())]
    return [
        case(
            f"Mod-{_ids(sa)}-{_ids(sb)}",
            "Mod",
            [X(*sa), NonZero(*sb)],
            torch.fmod,
            attrs={"fmod": 1},
        )
        for sa, sb in shapes
    ]


def _gemm() -> list[Spec]:
    m, k, n = 3, 4, 5
    out = []
    for ta, tb, c in itertools.product((0, 1), (0, 1), ("none", "N", "MN", "1N")):
        alpha, beta = (0.5, 2.0) if c != "MN" else (1.0, 1.0)
        a = X(k, m) if ta else X(m, k)
        b = X(n, k) if tb else X(k, n)
        cs = {"none": [], "N": [X(n)], "MN": [X(m, n)], "1N": [X(1, n)]}[c]

        def ref(a, b, c=None, ta=ta, tb=tb, alpha=alpha, beta=beta):
            y = alpha * (a.T if ta else a) @ (b.T if tb else b)
            return y if c is None else y + beta * c

        attrs = {"transA": ta, "transB": tb, "alpha": alpha, "beta": beta}
        out.append(case(f"Gemm-tA{ta}-tB{tb}-C{c}", "Gemm", [a, b, *cs], ref, attrs=attrs))
    return out


def _fused_matmul() -> list[Spec]:
    def t(v, flag):
        return v.transpose(-1, -2) if flag else v

    out = []
    shapes = [
        ((2, 3, 4), (2, 4, 5)),  # batched
        ((3, 4), (4, 5)),  # 2-D
        ((2, 1, 3, 4), (3, 4, 5)),  # broadcast batch dims
    ]
    for (sa, sb), ta, tb in itertools.product(shapes, (0, 1), (0, 1)):
        if len(sa) != 3 and (ta, tb) not in ((1, 0), (0, 1)):
            continue
        a = (*sa[:-2], sa[-1], sa[-2]) if ta else sa
        b = (*sb[:-2], sb[-1], sb[-2]) if tb else sb

        def ref(x, y, ta=ta, tb=tb):
            return 0.7 * t(x, ta) @ t(y, tb)

        out.append(
            case(
                f"FusedMatMul-{_ids(a)}-{_ids(b)}-tA{ta}-tB{tb}",
                "FusedMatMul",
                [X(*a), X(*b)],
                ref,
                attrs={"transA": ta, "transB": tb, "alpha": 0.7},
                domain=MS_DOMAIN,
            )
        )
    return out


def _ce_ref(kind: str, reduction: str, ignore: int | None, with_logp: bool):
    loss = F.cross_entropy if kind == "sce" else F.nll_loss
    ii = -100 if ignore is None else ignore

    def ref(scores, labels, weight=None):
        value = loss(scores, labels, weight=weight, ignore_index=ii, reduction=reduction)
        return (value, F.log_softmax(scores, 1)) if with_logp else value

    return ref


def _losses() -> list[Spec]:
    out = []
    ops = {"sce": "SoftmaxCrossEntropyLoss", "nll": "NegativeLogLikelihoodLoss"}
    for kind, dims, ignore, weighted, reduction in itertools.product(
        ops, ("2d", "3d"), (None, -100), (False, True), ("mean", "sum", "none")
    ):
        out.append(_loss_case(ops[kind], kind, dims, ignore, weighted, reduction))
    # ignore_index inside the class range; log_prob output used by the loss too.
    for kind, dims in itertools.product(ops, ("2d", "3d")):
        out.append(_loss_case(ops[kind], kind, dims, 2, True, "mean"))
    for dims, reduction in itertools.product(("2d", "3d"), ("mean", "none")):
        out.append(_loss_case(ops["sce"], "sce", dims, -1, True, reduction, with_logp=True))
    only_logp = _loss_case(ops["sce"], "sce", "3d", None, False, "mean", with_logp=True)
    out.append(dataclasses.replace(only_logp, id=only_logp.id + "-only", loss_outputs=(1,)))
    return out


def _loss_case(op, kind, dims, ignore, weighted, reduction, with_logp=False) -> Spec:
    n, c, d = 5, 4, 3
    scores, label_shape = ((n, c), (n,)) if dims == "2d" else ((n, c, d), (n, d))
    inputs = [X(*scores), Labels(label_shape, c, ignore)]
    if weighted:
        inputs.append(Pos(c, grad=False))
    attrs = {"reduction": reduction}
    if ignore is not None:
        attrs["ignore_index"] = ignore
    name = f"{op}-{dims}-{reduction}-ign{ignore}-w{int(weighted)}" + ("-logp" if with_logp else "")
    return case(
        name,
        op,
        inputs,
        _ce_ref(kind, reduction, ignore, with_logp),
        attrs=attrs,
        outputs=2 if with_logp else 1,
        direct_loss=reduction != "none",
    )


def _ln_with_stats(dims: tuple[int, ...]):
    def ref(x, w, b):
        y = F.layer_norm(x, w.shape, w, b, 1e-5)
        mean = x.mean(dims, keepdim=True)
        var = x.var(dims, unbiased=False, keepdim=True)
        return y, mean, 1 / torch.sqrt(var + 1e-5)

    return ref


def _reductions() -> list[Spec]:
    out = []
    fns = {"ReduceSum": torch.sum, "ReduceMean": torch.mean}
    for (op, fn), (axes, keep) in itertools.product(
        fns.items(),
        [([1], 1), ([1], 0), ([0, -1], 0), ([-2, 0], 1), (None, 0), (None, 1), ([], 0)],
    ):
        inputs = [X(2, 3, 4)] + ([] if axes is None else [Const(axes)])

        def ref(x, axes=None, fn=fn, keep=keep):
            empty = axes is None or axes.numel() == 0
            dims = tuple(range(x.dim())) if empty else tuple(axes.tolist())
            return fn(x, dim=dims, keepdim=bool(keep))

        out.append(case(f"{op}-axes{axes}-keep{keep}", op, inputs, ref, attrs={"keepdims": keep}))
    return out


def _fused_matmul_2d_weight() -> list[Spec]:
    """x[..., K] @ op(W) with a 2-D W: the rule folds batch dims into Gemm rows."""
    out = []
    for sa, tb, alpha in itertools.product(((2, 3, 4), (2, 2, 3, 4), (3, 4)), (0, 1), (1.0, 0.7)):
        w = X(5, 4) if tb else X(4, 5)

        def ref(x, y, tb=tb, alpha=alpha):
            return alpha * (x @ (y.T if tb else y))

        attrs = {"transB": tb, "alpha": alpha}
        out.append(
            case(
                f"FusedMatMul-2d-weight-{_ids(sa)}-tB{tb}-alpha{alpha}",
                "FusedMatMul",
                [X(*sa), w],
                ref,
                attrs=attrs,
                domain=MS_DOMAIN,
            )
        )
    frozen_w = case("FusedMatMul-2d-weight-x-only", "FusedMatMul",
                    [X(2, 3, 4), X(5, 4, grad=False)], lambda x, y: x @ y.T,
                    attrs={"transB": 1}, domain=MS_DOMAIN)  # fmt: skip
    return [*out, frozen_w]


def _skip_ln_ref(with_bias: bool, with_beta: bool, eps: float = 1e-5):
    """SkipLayerNormalization as torch ops: s = x + skip (+ bias), y = LayerNorm(s)."""

    def ref(x, skip, gamma, *rest):
        beta = rest[0] if with_beta else None
        bias = rest[-1] if with_bias else None
        s = x + skip if bias is None else x + skip + bias
        y = F.layer_norm(s, gamma.shape, gamma, beta, eps)
        mean = s.mean(-1, keepdim=True)
        rstd = 1 / torch.sqrt(s.var(-1, unbiased=False, keepdim=True) + eps)
        return y, mean, rstd, s

    return ref


def _skip_layer_norm() -> list[Spec]:
    out = []
    for with_beta, with_bias in itertools.product((True, False), (True, False)):
        inputs = [X(2, 3, 8), X(2, 3, 8), X(8), X(8) if with_beta else None]
        if with_bias:
            inputs.append(X(8))
        ref = _skip_ln_ref(with_bias, with_beta)
        name = f"SkipLayerNorm-beta{int(with_beta)}-bias{int(with_bias)}"
        attrs = {"epsilon": 1e-5}
        kw = {"domain": MS_DOMAIN, "attrs": attrs}
        out.append(case(name, "SkipLayerNormalization", inputs, ref, outputs=1, **kw))
        out.append(  # the residual stream also reads s (GPT-2's pre-LN blocks)
            case(
                f"{name}-sum-used",
                "SkipLayerNormalization",
                inputs,
                ref,
                outputs=4,
                loss_outputs=(0, 3),
                **kw,
            )
        )
    full = [X(2, 3, 8), X(2, 3, 8), X(8), X(8), X(8)]
    kw = {"domain": MS_DOMAIN, "attrs": {"epsilon": 1e-5}, "outputs": 4}
    out += [
        case("SkipLayerNorm-stats-used", "SkipLayerNormalization", full,
             _skip_ln_ref(True, True), **kw),
        case("SkipLayerNorm-only-sum-used", "SkipLayerNormalization",
             [*full[:2], X(8, grad=False), X(8, grad=False), full[4]],
             _skip_ln_ref(True, True), loss_outputs=(3,), **kw),
        case("SkipLayerNorm-params-frozen", "SkipLayerNormalization",
             [X(2, 3, 8), X(2, 3, 8, grad=False), X(8, grad=False), X(8, grad=False),
              X(8, grad=False)], _skip_ln_ref(True, True), loss_outputs=(0, 2), **kw),
        case("SkipLayerNorm-eps-1e-12", "SkipLayerNormalization", full[:4],
             _skip_ln_ref(False, True, 1e-12), domain=MS_DOMAIN, attrs={"epsilon": 1e-12}),
    ]  # fmt: skip
    return out


def _quick_gelu(alpha: float):
    def ref(x):
        return x * torch.sigmoid(alpha * x)

    return ref


# --- the table -----------------------------------------------------------------------------


# fmt: off
def _conv_ref(nd: int, stride=1, padding=0, dilation=1, groups=1) -> Callable:
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]

    def ref(x, w, b=None):
        return fn(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)

    return ref


def _same_upper_ref(x, w):
    # ONNX SAME_UPPER for a 2-D conv of stride 2: total pad (out - 1) * 2 + k - in, the odd
    # one at the end (F.pad's order: last axis first).
    k, size = w.shape[-1], x.shape[-1]
    out = -(-size // 2)
    total = max(0, (out - 1) * 2 + k - size)
    lo, hi = total // 2, total - total // 2
    return F.conv2d(F.pad(x, (lo, hi, lo, hi)), w, stride=2)


def _convs() -> list[Spec]:
    """Conv: strides that leave trailing inputs unread, dilation, asymmetric pads, groups
    (and depthwise), 1-D / 3-D, no bias, a frozen input (a ViT's pixels), auto_pad."""
    return [
        case("Conv2d", "Conv", [X(2, 3, 7, 6), X(4, 3, 3, 3), X(4)], _conv_ref(2, padding=1),
             attrs={"pads": [1, 1, 1, 1]}),
        case("Conv2d-stride2-unread-tail", "Conv", [X(2, 3, 8, 7), X(5, 3, 3, 2), X(5)],
             _conv_ref(2, stride=2), attrs={"strides": [2, 2]}),
        case("Conv2d-dilation-stride", "Conv", [X(1, 2, 11, 9), X(3, 2, 3, 3)],
             _conv_ref(2, stride=(2, 1), padding=(2, 1), dilation=(2, 3)),
             attrs={"strides": [2, 1], "dilations": [2, 3], "pads": [2, 1, 2, 1]}),
        case("Conv2d-asymmetric-pads", "Conv", [X(2, 2, 5, 5), X(3, 2, 2, 2), X(3)],
             lambda x, w, b: F.conv2d(F.pad(x, (0, 1, 1, 0)), w, b),
             attrs={"pads": [1, 0, 0, 1]}),
        case("Conv2d-groups", "Conv", [X(2, 6, 6, 5), X(4, 3, 3, 3), X(4)],
             _conv_ref(2, stride=2, padding=1, groups=2),
             attrs={"strides": [2, 2], "pads": [1, 1, 1, 1], "group": 2}),
        case("Conv2d-depthwise", "Conv", [X(2, 4, 6, 6), X(4, 1, 3, 3)],
             _conv_ref(2, padding=1, groups=4), attrs={"pads": [1, 1, 1, 1], "group": 4}),
        case("Conv2d-patch-embedding-frozen-pixels", "Conv",
             [X(2, 3, 8, 8, grad=False), X(6, 3, 4, 4), X(6)], _conv_ref(2, stride=4),
             attrs={"strides": [4, 4]}),
        case("Conv2d-auto-pad-same-upper", "Conv", [X(1, 2, 7, 7), X(3, 2, 4, 4)],
             _same_upper_ref, attrs={"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
        case("Conv1d", "Conv", [X(3, 4, 9), X(6, 4, 3), X(6)],
             _conv_ref(1, stride=2, padding=1), attrs={"strides": [2], "pads": [1, 1]}),
        case("Conv3d", "Conv", [X(1, 2, 4, 5, 4), X(3, 2, 2, 3, 2), X(3)],
             _conv_ref(3, stride=(1, 2, 1), padding=(1, 0, 1)),
             attrs={"strides": [1, 2, 1], "pads": [1, 0, 1, 1, 0, 1]}),
        # stride 1: dx as a convolution of the flipped weight (dilated, grouped, 1-D, 3-D,
        # asymmetric pads); a pad beyond the kernel's extent keeps ConvTranspose
        case("Conv2d-s1-dilated", "Conv", [X(2, 3, 9, 8), X(4, 3, 3, 2), X(4)],
             _conv_ref(2, padding=(2, 1), dilation=(2, 3)),
             attrs={"dilations": [2, 3], "pads": [2, 1, 2, 1]}),
        case("Conv2d-s1-groups", "Conv", [X(2, 6, 5, 6), X(9, 2, 3, 3), X(9)],
             _conv_ref(2, padding=1, groups=3), attrs={"pads": [1, 1, 1, 1], "group": 3}),
        case("Conv2d-s1-asymmetric-pads", "Conv", [X(2, 2, 5, 6), X(3, 2, 3, 2)],
             lambda x, w: F.conv2d(F.pad(x, (1, 0, 2, 0)), w),
             attrs={"pads": [2, 1, 0, 0]}),
        case("Conv2d-s1-pad-beyond-kernel", "Conv", [X(1, 2, 4, 4), X(3, 2, 2, 2), X(3)],
             _conv_ref(2, padding=2), attrs={"pads": [2, 2, 2, 2]}),
        case("Conv1d-s1-k5", "Conv", [X(3, 4, 11), X(5, 4, 5), X(5)],
             _conv_ref(1, padding=2), attrs={"pads": [2, 2]}),
        case("Conv3d-s1", "Conv", [X(2, 2, 4, 3, 4), X(3, 2, 3, 2, 3), X(3)],
             _conv_ref(3, padding=(1, 0, 1)), attrs={"pads": [1, 0, 1, 1, 0, 1]}),
    ]  # fmt: skip


SPECS: list[Spec] = [
    # Element-wise binary (numpy broadcasting) and n-ary.
    *_binary(),
    *_mod(),
    case("Pow-tensor", "Pow", [Pos(3, 4), X(3, 4)], torch.pow),
    case("Pow-tensor-bcast", "Pow", [Pos(2, 3, 4), X(4)], torch.pow),
    case("Pow-scalar-input", "Pow", [Pos(3, 4), X()], torch.pow),
    case("Pow-scalar-const-float", "Pow", [X(3, 4), Const(2.0, "float32")], torch.pow),
    case("Pow-scalar-const-int", "Pow", [X(3, 4), Const(3)], torch.pow),
    case("Sum-3-bcast", "Sum", [X(3, 4), X(4), X(1, 4)], lambda a, b, c: a + b + c),
    case("Sum-3-same", "Sum", [X(2, 3), X(2, 3), X(2, 3)], lambda a, b, c: a + b + c),
    case("Max-2", "Max", [X(3, 4), X(3, 4)], torch.maximum),
    case("Max-2-bcast", "Max", [X(3, 4), X(4)], torch.maximum),
    case("Min-2", "Min", [X(3, 4), X(3, 4)], torch.minimum),
    case("Min-2-bcast", "Min", [X(2, 1), X(2, 5)], torch.minimum),
    case("Where-bcast", "Where", [Mask(3, 1), X(1, 4), X(3, 4)], torch.where),
    case("Where-scalar", "Where", [Mask(3, 4), X(), X(4)], torch.where),
    case("Where-y-only", "Where", [Mask(3, 4), X(3, 4, grad=False), X(3, 4)], torch.where),
    # Element-wise unary.
    case("Neg", "Neg", [X(2, 3, 4)], torch.neg),
    case("Sqrt", "Sqrt", [Pos(2, 3, 4)], torch.sqrt),
    case("Exp", "Exp", [X(2, 3, 4)], torch.exp),
    case("Log", "Log", [Pos(2, 3, 4)], torch.log),
    case("Tanh", "Tanh", [X(2, 3, 4)], torch.tanh),
    case("Erf", "Erf", [X(2, 3, 4)], torch.erf),
    case("Sigmoid", "Sigmoid", [X(2, 3, 4)], torch.sigmoid),
    case("Relu", "Relu", [X(2, 3, 4)], torch.relu),
    case("Reciprocal", "Reciprocal", [NonZero(3, 4)], torch.reciprocal),
    case("Abs", "Abs", [NonZero(3, 4)], torch.abs),
    case("Identity", "Identity", [X(3, 4)], lambda x: x),
    case("Gelu-none", "Gelu", [X(2, 3, 4)], F.gelu, attrs={"approximate": "none"}),
    case("Gelu-default", "Gelu", [X(2, 3, 4)], F.gelu),
    case("Gelu-tanh", "Gelu", [X(2, 3, 4)], lambda x: F.gelu(x, approximate="tanh"),
         attrs={"approximate": "tanh"}),
    case("Cast-f32-f64", "Cast", [X(3, 4)], lambda x: x.to(torch.float64), attrs={"to": DOUBLE}),
    case("Cast-f64-f32", "Cast", [X(3, 4, dtype="float64")], lambda x: x.to(torch.float32),
         attrs={"to": FLOAT}),
    case("CastLike-f32-f64", "CastLike", [X(3, 4), Const([1.0], "float64")],
         lambda x, like: x.to(torch.float64)),
    # MatMul family.
    case("MatMul-2d", "MatMul", [X(3, 4), X(4, 5)], torch.matmul),
    case("MatMul-3d-2d", "MatMul", [X(2, 3, 4), X(4, 5)], torch.matmul),
    case("MatMul-4d-4d", "MatMul", [X(2, 3, 4, 5), X(2, 3, 5, 6)], torch.matmul),
    case("MatMul-bcast-batch", "MatMul", [X(2, 1, 4, 5), X(3, 5, 6)], torch.matmul),
    case("MatMul-2d-3d", "MatMul", [X(4, 5), X(2, 5, 3)], torch.matmul),
    case("MatMul-3d-2d-A-only", "MatMul", [X(2, 3, 4), X(4, 5, grad=False)], torch.matmul),
    *_gemm(),
    *_fused_matmul(),
    *_fused_matmul_2d_weight(),
    # Layout ops.
    case("Transpose-perm", "Transpose", [X(2, 3, 4)], lambda x: x.permute(1, 2, 0),
         attrs={"perm": [1, 2, 0]}),
    case("Transpose-default", "Transpose", [X(2, 3, 4)], lambda x: x.permute(2, 1, 0)),
    case("Reshape", "Reshape", [X(2, 3, 4), Const([6, 4])], lambda x, s: x.reshape(6, 4)),
    case("Reshape-minus1-zero", "Reshape", [X(2, 3, 4), Const([-1, 2, 0])],
         lambda x, s: x.reshape(3, 2, 4)),
    case("Flatten", "Flatten", [X(2, 3, 4)], lambda x: x.reshape(6, 4), attrs={"axis": 2}),
    case("Squeeze", "Squeeze", [X(2, 1, 3, 1), Const([1, -1])], lambda x, a: x.reshape(2, 3)),
    case("Unsqueeze", "Unsqueeze", [X(2, 3), Const([0, 3])], lambda x, a: x.reshape(1, 2, 3, 1)),
    case("Expand", "Expand", [X(3, 1), Const([2, 3, 4])], lambda x, s: x.expand(2, 3, 4)),
    case("Expand-bcast-both", "Expand", [X(1, 4), Const([3, 1])], lambda x, s: x.expand(3, 4)),
    case("Split-equal", "Split", [X(2, 6, 3)], lambda x: torch.chunk(x, 3, dim=1),
         attrs={"axis": 1, "num_outputs": 3}, outputs=3),
    case("Split-sizes", "Split", [X(2, 6, 3), Const([1, 3, 2])],
         lambda x, s: torch.split(x, [1, 3, 2], dim=1), attrs={"axis": 1}, outputs=3),
    case("Split-sizes-some-used", "Split", [X(2, 6, 3), Const([1, 3, 2])],
         lambda x, s: torch.split(x, [1, 3, 2], dim=1), attrs={"axis": 1}, outputs=3,
         loss_outputs=(0, 2)),
    case("Split-equal-one-used-neg-axis", "Split", [X(2, 3, 4)],
         lambda x: torch.chunk(x, 2, dim=-1), attrs={"axis": -1, "num_outputs": 2}, outputs=2,
         loss_outputs=(1,)),
    case("Concat-3-neg-axis", "Concat", [X(2, 3), X(2, 1), X(2, 4)],
         lambda *xs: torch.cat(xs, dim=-1), attrs={"axis": -1}),
    case("Concat-3-axis-minus2", "Concat", [X(1, 3), X(2, 3), X(4, 3)],
         lambda *xs: torch.cat(xs, dim=0), attrs={"axis": -2}),
    case("Concat-3-middle-frozen", "Concat", [X(2, 3), X(2, 1, grad=False), X(2, 4)],
         lambda *xs: torch.cat(xs, dim=1), attrs={"axis": 1}),
    case("Slice-step1-axes", "Slice", [X(4, 6), Const([1]), Const([3]), Const([0])],
         lambda x, *_: x[1:3]),
    case("Slice-no-axes", "Slice", [X(4, 6), Const([1, 2]), Const([3, 5])],
         lambda x, *_: x[1:3, 2:5]),
    case("Slice-step2", "Slice", [X(4, 7), Const([1]), Const([7]), Const([1]), Const([2])],
         lambda x, *_: x[:, 1:7:2]),
    case("Slice-step2-tail", "Slice",
         [X(4, 6), Const([1]), Const([2**62]), Const([1]), Const([2])],
         lambda x, *_: x[:, 1::2]),
    case("Slice-step3-tail", "Slice", [X(2, 10), Const([2]), Const([9]), Const([1]), Const([3])],
         lambda x, *_: x[:, 2:9:3]),
    case("Slice-neg-starts", "Slice", [X(4, 6), Const([-3]), Const([-1]), Const([-1])],
         lambda x, *_: x[:, -3:-1]),
    case("Slice-2-axes-step2", "Slice",
         [X(5, 4, 5), Const([0, 1]), Const([4, 4]), Const([2, 0]), Const([2, 1])],
         lambda x, *_: x[1:4, :, 0:4:2]),
    case("Slice-reverse", "Slice",  # torch.flip as the exporter writes it (bidirectional RNN)
         [X(4, 3), Const([-1]), Const([-(2**63)]), Const([0]), Const([-1])],
         lambda x, *_: x.flip(0)),
    case("Slice-step-neg2", "Slice", [X(3, 7), Const([5]), Const([0]), Const([1]), Const([-2])],
         lambda x, *_: x[:, [5, 3, 1]]),
    case("Slice-step-neg3-clamped", "Slice",
         [X(2, 7, 3), Const([10, 0]), Const([-(2**62), 2]), Const([1, 2]), Const([-3, 1])],
         lambda x, *_: x[:, [6, 3, 0], 0:2]),
    case("Tile", "Tile", [X(2, 3), Const([2, 3])], lambda x, r: x.repeat(2, 3)),
    case("Tile-3d", "Tile", [X(2, 1, 3), Const([1, 4, 2])], lambda x, r: x.repeat(1, 4, 2)),
    case("Pad-constant", "Pad", [X(2, 3), Const([1, 0, 2, 1]), Const(0.5, "float32")],
         lambda x, *_: F.pad(x, (0, 1, 1, 2), value=0.5)),
    case("Pad-axes", "Pad", [X(2, 3, 4), Const([1, 2]), None, Const([-1])],
         lambda x, *_: F.pad(x, (1, 2))),
    case("Pad-negative", "Pad", [X(4, 5), Const([-1, 2, 1, -2])],
         lambda x, *_: F.pad(x, (2, -2, -1, 1))),
    # Gather family (integer indices are never differentiated).
    case("Gather-axis0-embedding", "Gather", [X(10, 4), Index((2, 5), 0, 4)],
         lambda w, i: w[i]),
    case("Gather-axis0-neg-indices", "Gather", [X(5, 4), Index((6,), -5, 5)],
         lambda w, i: w[i]),
    # torch's padding_idx (ortrain/padding_rows.py tags the export's Gather): row 3 gets
    # no gradient however often it is looked up.
    case("Gather-axis0-padding-idx", "Gather", [X(6, 4), Fixed([[3, 1, 3], [0, 3, 5]])],
         lambda w, i: F.embedding(i, w, padding_idx=3), metadata={PADDING_IDX: "3"}),
    case("Gather-axis0-scalar-input", "Gather", [X(5, 4), Index((), 0, 5)], lambda w, i: w[i]),
    case("Gather-axis1-scalar-const", "Gather", [X(3, 5, 4), Const(2)], lambda x, i: x[:, 2],
         attrs={"axis": 1}),
    case("Gather-axis1-neg-scalar-const", "Gather", [X(3, 5, 4), Const(-1)],
         lambda x, i: x[:, -1], attrs={"axis": 1}),
    case("Gather-axis1-tensor", "Gather", [X(3, 5, 4), Index((2, 3), 0, 5)],
         lambda x, i: x[:, i], attrs={"axis": 1}),
    case("Gather-axis-last-tensor", "Gather", [X(3, 4, 5), Index((6,), 0, 5)],
         lambda x, i: x[..., i], attrs={"axis": -1}),
    case("GatherND-repeated", "GatherND", [X(4, 5, 6), Fixed([[0, 1], [3, 4], [0, 1]])],
         lambda x, i: x[i[:, 0], i[:, 1]]),
    case("GatherND-full-depth", "GatherND", [X(4, 5, 6), Fixed([[0, 1, 2], [3, 4, 5]])],
         lambda x, i: x[i[:, 0], i[:, 1], i[:, 2]]),
    # Many repeated rows on 4 threads: ONNX Runtime's ScatterND(add) loses updates there
    # (onnxruntime#18048), so the rules must not rely on it.
    case("Gather-embedding-repeats-4-threads", "Gather", [X(40, 64), Index((32, 128), 0, 6)],
         lambda w, i: w[i], threads=4),
    case("Gather-axis1-repeats-4-threads", "Gather", [X(8, 30, 16), Index((512,), -3, 3)],
         lambda x, i: x[:, i], attrs={"axis": 1}, threads=4),
    case("GatherND-repeats-4-threads", "GatherND", [X(6, 5, 64), Index((4096, 2), 0, 2)],
         lambda x, i: x[i[:, 0], i[:, 1]], threads=4),
    case("GatherND-neg-indices", "GatherND", [X(4, 5, 6), Fixed([[-1, 1], [3, -5], [-1, 1]])],
         lambda x, i: x[i[:, 0], i[:, 1]]),
    # Reductions.
    *_reductions(),
    case("ReduceSum-noop-empty-axes", "ReduceSum", [X(2, 3), Const([], "int64")],
         lambda x, a: x, attrs={"noop_with_empty_axes": 1}),
    # NN ops.
    case("Softmax-axis-1", "Softmax", [X(2, 3, 4)], lambda x: torch.softmax(x, -1),
         attrs={"axis": -1}),
    case("Softmax-axis1", "Softmax", [X(2, 3, 4)], lambda x: torch.softmax(x, 1),
         attrs={"axis": 1}),
    case("LogSoftmax-axis-1", "LogSoftmax", [X(2, 3, 4)], lambda x: torch.log_softmax(x, -1),
         attrs={"axis": -1}),
    case("LogSoftmax-axis1", "LogSoftmax", [X(2, 3, 4)], lambda x: torch.log_softmax(x, 1),
         attrs={"axis": 1}),
    # ONNX Runtime's RMSNorm (the fused form of Llama's / T5's norm), ONNX domain.
    case("RMSNorm-axis-1", "SimplifiedLayerNormalization", [X(2, 3, 8), X(8)],
         lambda x, w: F.rms_norm(x, (8,), w, 1e-6), attrs={"axis": -1, "epsilon": 1e-6}),
    case("RMSNorm-axis-2", "SimplifiedLayerNormalization", [X(2, 3, 8), X(3, 8)],
         lambda x, w: F.rms_norm(x, (3, 8), w, 1e-5), attrs={"axis": -2, "epsilon": 1e-5}),
    case("RMSNorm-scale-frozen", "SimplifiedLayerNormalization", [X(4, 6), X(6, grad=False)],
         lambda x, w: F.rms_norm(x, (6,), w, 1e-6), attrs={"epsilon": 1e-6}),
    case("LayerNorm-axis-1", "LayerNormalization", [X(2, 3, 8), X(8), X(8)],
         lambda x, w, b: F.layer_norm(x, (8,), w, b, 1e-5),
         attrs={"axis": -1, "epsilon": 1e-5}),
    case("LayerNorm-axis-2", "LayerNormalization", [X(2, 3, 8), X(3, 8), X(3, 8)],
         lambda x, w, b: F.layer_norm(x, (3, 8), w, b, 1e-5),
         attrs={"axis": -2, "epsilon": 1e-5}),
    case("LayerNorm-no-bias", "LayerNormalization", [X(4, 6), X(6)],
         lambda x, w: F.layer_norm(x, (6,), w, None, 1e-5), attrs={"epsilon": 1e-5}),
    case("LayerNorm-stats-used", "LayerNormalization", [X(2, 3, 8), X(8), X(8)],
         _ln_with_stats((-1,)), attrs={"axis": -1, "epsilon": 1e-5}, outputs=3),
    case("LayerNorm-axis-2-invstd-used", "LayerNormalization", [X(2, 3, 8), X(3, 8), X(3, 8)],
         _ln_with_stats((-2, -1)), attrs={"axis": -2, "epsilon": 1e-5}, outputs=3,
         loss_outputs=(0, 2)),
    case("LayerNorm-only-mean-used", "LayerNormalization",
         [X(2, 3, 8), X(8, grad=False), X(8, grad=False)],
         _ln_with_stats((-1,)), attrs={"axis": -1, "epsilon": 1e-5}, outputs=3,
         loss_outputs=(1,)),
    case("Dropout-ratio0-train", "Dropout", [X(3, 4), Const(0.0, "float32"), Const(True, "bool")],
         lambda x, *_: x),
    case("Dropout-ratio0.3-train-mask", "Dropout",
         [X(6, 7), Const(0.3, "float32"), Const(True, "bool")],
         lambda x, r, t, ort: (x * ort[1] / (1 - 0.3), ort[1]), attrs={"seed": 7}, outputs=2,
         ref_sees_ort=True),
    case("Dropout-eval", "Dropout", [X(3, 4), Const(0.5, "float32"), Const(False, "bool")],
         lambda x, *_: x),
    case("Dropout-no-training-input", "Dropout", [X(3, 4)], lambda x: x),
    # com.microsoft contrib ops that the fusions emit (graph_passes/fusions/).
    case("ms-Gelu", "Gelu", [X(2, 3, 4)], F.gelu, domain=MS_DOMAIN),
    case("BiasGelu", "BiasGelu", [X(2, 3, 8), X(8)], lambda x, b: F.gelu(x + b),
         domain=MS_DOMAIN),
    case("BiasGelu-bias-frozen", "BiasGelu", [X(4, 8), X(8, grad=False)],
         lambda x, b: F.gelu(x + b), domain=MS_DOMAIN),
    case("FastGelu", "FastGelu", [X(2, 3, 8)], lambda x: F.gelu(x, approximate="tanh"),
         domain=MS_DOMAIN),
    case("FastGelu-bias", "FastGelu", [X(2, 3, 8), X(8)],
         lambda x, b: F.gelu(x + b, approximate="tanh"), domain=MS_DOMAIN),
    case("QuickGelu", "QuickGelu", [X(2, 3, 8)], _quick_gelu(1.702), domain=MS_DOMAIN),
    case("QuickGelu-alpha", "QuickGelu", [X(2, 3, 8)], _quick_gelu(0.5), domain=MS_DOMAIN,
         attrs={"alpha": 0.5}),
    *_skip_layer_norm(),
    *_convs(),
    # Losses (direct_loss for mean/sum: the op's output is the loss itself).
    *_losses(),
]
# fmt: on

_dup = [s.id for s in SPECS if [t.id for t in SPECS].count(s.id) > 1]
assert not _dup, f"duplicate spec ids: {_dup}"


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_gradient_rule(spec: Spec) -> None:
    check_gradients(spec)


def test_table_covers_required_ops() -> None:
    required = {
        "Add", "Sub", "Mul", "Div", "Neg", "Pow", "Sqrt", "Exp", "Log", "Tanh", "Erf", "Gelu",
        "Sigmoid", "Relu", "MatMul", "Gemm", "FusedMatMul", "Transpose", "Reshape", "Split",
        "Concat", "Slice", "Squeeze", "Unsqueeze", "Expand", "Gather", "GatherND", "Where",
        "Cast", "Identity", "LayerNormalization", "Softmax", "LogSoftmax", "Dropout",
        "ReduceMean", "ReduceSum", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
        "Sum", "Max", "Min", "Tile", "Pad",
    }  # fmt: skip
    assert required <= {s.op for s in SPECS}
    # Every op with a rule is in a table: this file's or a family's (tests/test_rules_*.py).
    tested = {s.op for s in SPECS} | {s.op for s in family_specs()}
    ruled = {op for (_, op), regs in registry._TABLE.items() if any(r.kind == "rule" for r in regs)}
    assert ruled <= tested, sorted(ruled - tested)


def family_specs() -> list[Spec]:
    """The spec tables of the per-family gradient test modules (``tests/test_rules_*.py``,
    each with a module-level ``SPECS`` run by its own parametrized test)."""
    specs: list[Spec] = []
    for path in sorted(Path(__file__).parent.glob("test_rules_*.py")):
        module = importlib.import_module(f"tests.{path.stem}")
        specs.extend(module.SPECS)
    return specs


# --- structural tests ------------------------------------------------------------------------


def _grad_of(model: ir.Model) -> list[str]:
    return [
        n.metadata_props["ortrain.grad_of"]
        for n in model.graph
        if "ortrain.grad_of" in n.metadata_props
    ]


def test_frozen_branch_gets_no_gradient_nodes() -> None:
    # loss = sum((tanh(x) + exp(tanh(w_frozen))) * R); only x is trainable.
    g = TinyGraph()
    x, w = g.input("x", (3, 4)), g.input("w_frozen", (3, 4))
    r = g.const("R", np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32))
    tx = g.op("Tanh", x, name="tanh_x", shape=(3, 4))
    tw = g.op("Tanh", w, name="frozen_tanh", shape=(3, 4))
    ew = g.op("Exp", tw, name="frozen_exp", shape=(3, 4))
    s = g.op("Add", tx, ew, name="add", shape=(3, 4))
    m = g.op("Mul", s, r, name="mul", shape=(3, 4))
    loss = g.op("ReduceSum", m, name="loss", shape=(), keepdims=0)
    model = g.model(loss)
    res = build_gradient_graph(model, loss.name, ["x"])
    assert res.grad_outputs == {"x": "grad:x"}
    assert not any(o.name == "grad:w_frozen" for o in model.graph.outputs)
    grad_of = _grad_of(model)
    assert grad_of.count("frozen_tanh") == 0 and grad_of.count("frozen_exp") == 0
    assert {"tanh_x", "mul", "loss"} <= set(grad_of)

    rng = np.random.default_rng(1)
    xv, wv = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
    got = run_model(model, {"x": xv, "w_frozen": wv})
    expected = (1 - np.tanh(xv.astype(np.float64)) ** 2) * r.const_value.numpy()
    assert_close(got["grad:x"], expected, "grad:x")


def test_value_used_three_times_is_merged_by_one_sum() -> None:
    # loss = sum(tanh(x) * R1) + sum(exp(x) * R2) + sum(x * R3)
    g = TinyGraph()
    x = g.input("x", (2, 5))
    rng = np.random.default_rng(2)
    rs = [rng.standard_normal((2, 5)).astype(np.float32) for _ in range(3)]
    branches = [
        g.op("Tanh", x, name="tanh", shape=(2, 5)),
        g.op("Exp", x, name="exp", shape=(2, 5)),
        x,
    ]
    terms = []
    for k, (b, rv) in enumerate(zip(branches, rs, strict=True)):
        prod = g.op("Mul", b, g.const(f"R{k}", rv), name=f"mul{k}", shape=(2, 5))
        terms.append(g.op("ReduceSum", prod, name=f"sum{k}", shape=(), keepdims=0))
    loss = g.op(
        "Add",
        g.op("Add", terms[0], terms[1], name="add0", shape=()),
        terms[2],
        name="add1",
        shape=(),
    )
    model = g.model(loss)
    build_gradient_graph(model, loss.name, ["x"])
    sums = [n for n in model.graph if n.op_type == "Sum"]
    assert len(sums) == 1 and len(sums[0].inputs) == 3
    assert sums[0].outputs[0] is next(o for o in model.graph.outputs if o.name == "grad:x")

    xv = rng.standard_normal((2, 5)).astype(np.float32)
    got = run_model(model, {"x": xv})
    x64 = xv.astype(np.float64)
    expected = (1 - np.tanh(x64) ** 2) * rs[0] + np.exp(x64) * rs[1] + rs[2]
    assert_close(got["grad:x"], expected, "grad:x")


def _one_op_model(op: str, domain: str, name: str) -> tuple[ir.Model, str]:
    g = TinyGraph()
    x = g.input("x", (3, 4))
    t = g.op("Tanh", x, name="tanh", shape=(3, 4))
    y = g.op(op, t, name=name, shape=(3, 4), domain=domain)
    loss = g.op("ReduceSum", y, name="loss", shape=(), keepdims=0)
    opsets = {"": 20, domain: 1} if domain else None
    return g.model(loss, opsets=opsets), loss.name


@pytest.mark.parametrize(
    "op,domain", [("MyCustomOp", "test.custom"), ("Det", "")], ids=["custom-op", "Det"]
)
def test_op_without_rule_raises_naming_op_and_node(op: str, domain: str) -> None:
    model, loss = _one_op_model(op, domain, "the_node_without_rule")
    with pytest.raises(GradientError, match="no gradient rule") as err:
        build_gradient_graph(model, loss, ["x"])
    assert op in str(err.value) and "the_node_without_rule" in str(err.value)


def test_op_without_rule_off_the_path_is_fine() -> None:
    # Hardmax only sees a frozen input: no gradient is needed through it.
    g = TinyGraph()
    x, w = g.input("x", (3, 4)), g.input("w", (3, 4))
    h = g.op("Hardmax", w, name="hardmax", shape=(3, 4))
    m = g.op("Mul", x, h, name="mul", shape=(3, 4))
    loss = g.op("ReduceSum", m, name="loss", shape=(), keepdims=0)
    model = g.model(loss)
    res = build_gradient_graph(model, loss.name, ["x"])
    assert "hardmax" not in _grad_of(model) and res.grad_outputs == {"x": "grad:x"}


@pytest.fixture
def not_differentiable_op():
    domain = f"test.nondiff.{uuid.uuid4().hex}"
    registry.not_differentiable("MyFrozenOp", "made up for a test", domain=domain)
    yield "MyFrozenOp", domain
    del registry._TABLE[(domain, "MyFrozenOp")]


def test_not_differentiable_op_on_path_raises(not_differentiable_op) -> None:
    op, domain = not_differentiable_op
    model, loss = _one_op_model(op, domain, "frozen_node")
    with pytest.raises(GradientError, match="not differentiable") as err:
        build_gradient_graph(model, loss, ["x"])
    msg = str(err.value)
    assert op in msg and "frozen_node" in msg and "made up for a test" in msg


def test_integer_index_path_gets_no_gradient_nodes() -> None:
    # idx2 = idx + 1 (int64); loss = sum(Gather(w, idx2) * R).
    g = TinyGraph()
    w = g.input("w", (6, 3))
    idx = g.input("idx", (4,), ir.DataType.INT64)
    one = g.const("one", np.array(1, dtype=np.int64))
    idx2 = g.op("Add", idx, one, name="index_add", shape=(4,), dtype=ir.DataType.INT64)
    gathered = g.op("Gather", w, idx2, name="gather", shape=(4, 3), axis=0)
    r = np.random.default_rng(3).standard_normal((4, 3)).astype(np.float32)
    m = g.op("Mul", gathered, g.const("R", r), name="mul", shape=(4, 3))
    loss = g.op("ReduceSum", m, name="loss", shape=(), keepdims=0)
    model = g.model(loss)
    res = build_gradient_graph(model, loss.name, ["w", "idx"])
    assert res.grad_outputs == {"w": "grad:w"} and res.unreachable == ["idx"]
    assert "index_add" not in _grad_of(model)
    assert all("index_add" not in n.metadata_props.get("ortrain.grad_of", "") for n in model.graph)

    wv = np.random.default_rng(4).standard_normal((6, 3)).astype(np.float32)
    iv = np.array([0, 2, 0, 4], dtype=np.int64)
    got = run_model(model, {"w": wv, "idx": iv})
    expected = np.zeros((6, 3))
    np.add.at(expected, iv + 1, r.astype(np.float64))
    assert_close(got["grad:w"], expected, "grad:w")


def test_dropout_mask_reference_is_meaningful() -> None:
    # The 0.3 dropout case must really drop something (else it only tests the identity).
    spec = next(s for s in SPECS if s.id == "Dropout-ratio0.3-train-mask")
    _, outputs = check_gradients(spec)
    mask = outputs[1]
    assert mask.dtype == np.bool_ and 0 < mask.sum() < mask.size


def _backward_ops(spec_id: str) -> list[str]:
    from ortrain.graph_passes.infra.tags import is_backward

    res, _ = check_gradients(next(s for s in SPECS if s.id == spec_id))
    return [n.op_type for n in res.model.graph if is_backward(n)]


@pytest.mark.parametrize(
    ("spec_id", "conv_transpose", "convs", "products"),
    [
        ("Conv2d", 0, 1, 1),  # dx: a flipped-weight Conv; dw: a product over patches
        ("Conv2d-s1-dilated", 0, 1, 1),
        ("Conv2d-stride2-unread-tail", 1, 0, 1),  # stride 2: ConvTranspose
        ("Conv2d-s1-groups", 0, 2, 0),  # grouped dw: the channels-for-batch Conv
        ("Conv2d-s1-pad-beyond-kernel", 1, 0, 1),
    ],
)
def test_conv_backward_is_spelled_in_the_fast_forms(
    spec_id: str, conv_transpose: int, convs: int, products: int
) -> None:
    ops = _backward_ops(spec_id)
    assert ops.count("ConvTranspose") == conv_transpose, ops
    assert ops.count("Conv") == convs, ops
    assert ops.count("MatMul") == products, ops


def test_conv_weight_gradient_with_a_large_patch_index_keeps_the_conv(monkeypatch) -> None:
    from ortrain.graph_passes.autodiff.rules import conv

    # 9 taps x 6 x 6 output positions = 324 index entries: one fewer than needed
    monkeypatch.setattr(conv, "PATCH_INDEX", 323)
    spec = case("Conv2d-large-index", "Conv", [X(2, 3, 8, 8), X(4, 3, 3, 3), X(4)],
                _conv_ref(2), attrs={})  # fmt: skip
    res, _ = check_gradients(spec)
    from ortrain.graph_passes.infra.tags import is_backward

    ops = [n.op_type for n in res.model.graph if is_backward(n)]
    assert ops.count("Gather") == 0 and ops.count("Conv") == 2, ops  # dx and dw as Convs


def test_conv_weight_gradient_over_a_large_batch_is_taken_in_chunks(monkeypatch) -> None:
    from ortrain.graph_passes.autodiff.rules import conv

    # 4 bytes * 9 taps * 3 channels * 6 * 9 positions per sample: chunks of 3 and 2 samples
    monkeypatch.setattr(conv, "PATCH_BYTES", 3 * 4 * 9 * 3 * 6 * 9)
    spec = case("Conv2d-chunked", "Conv", [X(5, 3, 8, 9), X(4, 3, 3, 3), X(4)],
                _conv_ref(2, padding=(0, 1)), attrs={"pads": [0, 1, 0, 1]})  # fmt: skip
    res, _ = check_gradients(spec)
    from ortrain.graph_passes.infra.tags import is_backward

    ops = [n.op_type for n in res.model.graph if is_backward(n)]
    assert ops.count("MatMul") == 2 and ops.count("Sum") == 1, ops
