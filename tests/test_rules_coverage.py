"""Gradient rules added where the torch.nn coverage table (docs/model-coverage.md) showed
common modules falling back to eager.

1. MatMul / FusedMatMul with a 1-D operand (``nn.Linear`` over a vector, a dot product,
   ``spectral_norm``'s power iteration): promoted as numpy does (a row for A, a column for
   B). Before, MatMul's rule refused it and FusedMatMul's made a gradient of the wrong
   shape (a dot product where the weight's gradient is an outer product), which ONNX
   Runtime stopped at run time.
2. Pad in reflect / edge / wrap mode (``padding_mode`` of the convolutions,
   ``ReflectionPad``, ``ReplicationPad``, ``CircularPad``, ``F.pad``): each added entry's
   gradient goes back to the entry it copies.
3. Col2Im (``nn.Fold``): its gradient gathers the patches back out of the image.

Each row is checked against torch.autograd by ``tests/gradcheck.check_gradients`` (float64
reference, rtol 1e-5, atol 1e-5 x max|ref|); forms the rules refuse raise naming the op.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ortrain.graph_passes.autodiff import GradientError
from ortrain.graph_passes.infra.emitter import MS_DOMAIN
from tests.gradcheck import Const, Spec, X, case, check_gradients

_TORCH_PAD = {"reflect": "reflect", "edge": "replicate", "wrap": "circular"}


def _matmuls() -> list[Spec]:
    shapes = [((4,), (4, 5)), ((2, 3, 4), (4,)), ((4,), (2, 4, 5)), ((4,), (4,)), ((3, 4), (4,))]
    out = [
        case(f"MatMul-{'x'.join(map(str, a))}-{'x'.join(map(str, b))}", "MatMul", [X(*a), X(*b)],
             torch.matmul)
        for a, b in shapes
    ]  # fmt: skip
    out.append(case("MatMul-1d-2d-A-only", "MatMul", [X(4), X(4, 5, grad=False)], torch.matmul))
    # fuse_matmul_transpose makes x @ W.T a FusedMatMul with transB (a Linear over a vector)
    out.append(case("FusedMatMul-1d-weightT", "FusedMatMul", [X(4), X(5, 4)],
                    lambda x, w: 0.5 * x @ w.T, attrs={"transB": 1, "alpha": 0.5},
                    domain=MS_DOMAIN))  # fmt: skip
    out.append(case("FusedMatMul-3d-vector", "FusedMatMul", [X(2, 3, 4), X(4)],
                    lambda a, v: a @ v, domain=MS_DOMAIN))  # fmt: skip
    return out


def _pad(mode: str, shape: tuple[int, ...], pads: list[int], axes: list[int] | None = None):
    """ONNX pads (begins, then ends, over ``axes`` or every axis) against torch's F.pad."""
    rank = len(shape)
    axes_ = [a % rank for a in (axes if axes is not None else range(rank))]
    k = len(axes_)
    per_axis = {a: (0, 0) for a in range(rank)}
    per_axis.update({a: (pads[i], pads[k + i]) for i, a in enumerate(axes_)})
    # F.pad's non-constant modes pad the trailing axes of an (N, C, ...) input only
    assert per_axis[0] == per_axis[1] == (0, 0), (shape, pads)
    torch_pad = [p for a in reversed(range(2, rank)) for p in per_axis[a]]  # last axis first

    def ref(x, *_):
        return F.pad(x, tuple(torch_pad), mode=_TORCH_PAD[mode])

    inputs = [X(*shape), Const(pads)]
    if axes is not None:
        inputs += [None, Const(axes)]
    name = f"Pad-{mode}-{'x'.join(map(str, shape))}-{pads}" + (f"-axes{axes}" if axes else "")
    return case(name, "Pad", inputs, ref, attrs={"mode": mode})


def _pads() -> list[Spec]:
    out = []
    for mode in ("reflect", "edge", "wrap"):
        out += [
            _pad(mode, (2, 3, 5), [0, 0, 1, 0, 0, 2]),
            _pad(mode, (2, 2, 4, 5), [0, 0, 1, 2, 0, 0, 2, 0]),
            _pad(mode, (1, 2, 3, 4, 4), [0, 0, 1, 0, 2, 0, 0, 0, 1, 1]),
            _pad(mode, (2, 3, 6), [0, 0, 3, 0, 0, 3 if mode == "reflect" else 4]),  # longest pads
            _pad(mode, (2, 2, 4, 5), [2, 1, 0, 3], axes=[-2, -1]),
        ]
    return out


def _fold_ref(size, kernel, dilation=1, padding=0, stride=1):
    def ref(x, *_):
        return F.fold(x, size, kernel, dilation=dilation, padding=padding, stride=stride)

    return ref


def _col2im(name: str, x: tuple[int, ...], size, kernel, dilation=1, padding=0, stride=1):
    nd = len(size)

    def per_axis(v):
        return list(v) if isinstance(v, (tuple, list)) else [v] * nd

    attrs = {"dilations": per_axis(dilation), "strides": per_axis(stride),
             "pads": per_axis(padding) * 2}  # fmt: skip
    return case(f"Col2Im-{name}", "Col2Im", [X(*x), Const(list(size)), Const(per_axis(kernel))],
                _fold_ref(size, kernel, dilation, padding, stride), attrs=attrs)  # fmt: skip


SPECS = [
    *_matmuls(),
    *_pads(),
    _col2im("k2", (2, 12, 12), (4, 5), 2),
    _col2im("k2-s2", (2, 12, 6), (4, 6), 2, stride=2),
    _col2im("k2-pad1-dil2", (2, 12, 20), (4, 5), 2, dilation=2, padding=1),
    _col2im("k-2x3-s-1x2", (1, 12, 4), (3, 6), (2, 3), stride=(1, 2)),
    _col2im("k3-overlap-pad1", (2, 18, 16), (4, 4), 3, padding=1),
]


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_gradient_rule(spec: Spec) -> None:
    check_gradients(spec)


REFUSED = [
    (case("Pad-reflect-negative", "Pad", [X(2, 3, 4), Const([0, 0, -1, 0, 0, 1])],
          lambda x, *_: x, attrs={"mode": "reflect"}), "reflect"),
    (case("FusedMatMul-1d-transA", "FusedMatMul", [X(4), X(4, 5)], lambda a, b: a @ b,
          attrs={"transA": 1}, domain=MS_DOMAIN), "1-D"),
    # ONNX Runtime's forward of it is not a.T @ v (checked below): refused, not guessed
    (case("FusedMatMul-transA-1d-B", "FusedMatMul", [X(4, 3), X(4)], lambda a, v: a.T @ v,
          attrs={"transA": 1}, domain=MS_DOMAIN), "1-D"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "what"), REFUSED, ids=[s.id for s, _ in REFUSED])
def test_forms_the_rules_refuse_raise_naming_the_op(spec: Spec, what: str) -> None:
    with pytest.raises(GradientError, match=rf"{spec.op}.*node_under_test.*{what}"):
        check_gradients(spec)


def test_onnxruntime_transA_with_a_vector_is_not_the_transposed_product() -> None:
    """Why the FusedMatMul rule refuses transA with a 1-D B: ONNX Runtime's forward of
    FusedMatMul(A[4, 3], v[4], transA=1) is not A.T @ v. When it is, the rule may take it."""
    import numpy as np
    import onnx_ir as ir

    from tests.gradcheck import _forward_graph, _model, _session

    spec = case("probe", "FusedMatMul", [X(4, 3), X(4)], lambda a, v: a.T @ v,
                attrs={"transA": 1}, domain=MS_DOMAIN)  # fmt: skip
    rng = np.random.default_rng(0)
    a, v = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    inputs, inits, node = _forward_graph(spec, [a, v], [(ir.DataType.FLOAT, (3,))])
    (got,) = _session(_model(inputs, node.outputs, [node], inits)).run(None, {"in0": a, "in1": v})
    assert got.shape == (3,) and not np.allclose(got, a.T @ v, rtol=1e-4, atol=1e-5)
