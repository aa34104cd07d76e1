"""Gradient rules of the CNN ops: pooling, ConvTranspose, Resize, Instance/GroupNorm.

1. Each row of ``SPECS`` is one ONNX node checked against torch.autograd by
   ``tests/gradcheck.check_gradients`` (float64 reference, rtol 1e-5, atol 1e-5 x max|ref|).
   ``Ties`` inputs are small integers, so pooling windows hold tied maxima: torch's
   max_pool and adaptive_max_pool send the gradient to the first maximum in window scan
   order, and the rules must pick the same element.
2. GroupNormalization-21 (per-channel affine) runs the same checks at opset 21.
3. Resize's gradient is checked against the matrix onnxruntime's forward applies (read off
   one-hot inputs), over modes and sizes where it departs from torch or from the spec.
4. Structure: the ops each backward is spelled in; unsupported attributes raise, naming
   the op, the node and the attribute.
5. Small 1-D / 2-D / 3-D CNNs train through ``ORTTrainer`` like eager (8 AdamW steps).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from ortrain.graph_passes.autodiff import GradientError
from ortrain.graph_passes.infra.tags import is_backward
from tests import gradcheck
from tests.gradcheck import Const, In, Spec, X, case, check_gradients


def Ties(*shape: int) -> In:
    """A float input of integers in [-2, 2]: pooling windows hold tied maxima."""
    return In(tuple(shape), "float32", lambda rng, s: rng.integers(-2, 3, s), grad=True)


def _pool_attrs(nd: int, k, stride=None, pad=0, dilation=1, ceil=0) -> dict:
    def per_axis(v):
        return list(v) if isinstance(v, (tuple, list)) else [v] * nd

    attrs = {"kernel_shape": per_axis(k), "strides": per_axis(stride or k)}
    attrs["pads"] = per_axis(pad) * 2
    if dilation != 1:
        attrs["dilations"] = per_axis(dilation)
    if ceil:
        attrs["ceil_mode"] = 1
    return attrs


# --- MaxPool --------------------------------------------------------------------------------------


def _max_ref(nd: int, k, stride=None, pad=0, dilation=1, ceil=0, indices=False) -> Callable:
    fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[nd]

    def ref(x):
        return fn(x, k, stride or k, pad, dilation, bool(ceil), return_indices=indices)

    return ref


def _max(id: str, x: In, nd: int, k, stride=None, pad=0, dilation=1, ceil=0) -> Spec:
    return case(
        f"MaxPool{nd}d-{id}", "MaxPool", [x], _max_ref(nd, k, stride, pad, dilation, ceil),
        attrs=_pool_attrs(nd, k, stride, pad, dilation, ceil),
    )  # fmt: skip


MAX_POOLS = [
    _max("k2", X(2, 3, 6, 8), 2, 2),
    _max("k3-s1-overlap-ties", Ties(2, 3, 6, 7), 2, 3, 1),
    _max("k3-s2-pad1-ties", Ties(2, 2, 7, 7), 2, 3, 2, 1),
    _max("k3-s2-pad1-ceil-ties", Ties(1, 3, 8, 6), 2, 3, 2, 1, ceil=1),
    _max("k2-s2-ceil-odd", X(2, 2, 7, 5), 2, 2, ceil=1),
    _max("k2-dilation2-ties", Ties(2, 2, 7, 6), 2, 2, 1, dilation=2),
    _max("k-2x3-s-1x2-pad-1x1-ties", Ties(2, 2, 6, 7), 2, (2, 3), (1, 2), (1, 1)),
    _max("k3-s2-ties", Ties(2, 3, 11), 1, 3, 2),
    _max("k3-s1-pad1-dil2-ceil-ties", Ties(2, 2, 10), 1, 3, 2, 1, dilation=2, ceil=1),
    _max("k2-ties", Ties(1, 2, 4, 5, 4), 3, 2),
    _max("k3-s2-pad1-ties", Ties(1, 2, 5, 6, 5), 3, 3, 2, 1),
    case("MaxPool2d-auto-pad-same-upper-ties", "MaxPool", [Ties(2, 2, 7, 6)],
         lambda x: F.max_pool2d(F.pad(x, (0, 1, 1, 1), value=-float("inf")), 3, 2),
         attrs={"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    case("MaxPool2d-indices-output-ties", "MaxPool", [Ties(2, 2, 6, 6)],
         _max_ref(2, 3, 1, indices=True), attrs=_pool_attrs(2, 3, 1), outputs=2),
]  # fmt: skip


# --- AveragePool ----------------------------------------------------------------------------------


def _avg_ref(nd: int, k, stride=None, pad=0, ceil=0, count_pad=1) -> Callable:
    fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[nd]

    def ref(x):
        return fn(x, k, stride or k, pad, bool(ceil), bool(count_pad))

    return ref


def _avg(id: str, x: In, nd: int, k, stride=None, pad=0, ceil=0, count_pad=1) -> Spec:
    attrs = _pool_attrs(nd, k, stride, pad, 1, ceil) | {"count_include_pad": count_pad}
    return case(f"AveragePool{nd}d-{id}-count_pad{count_pad}", "AveragePool", [x],
                _avg_ref(nd, k, stride, pad, ceil, count_pad), attrs=attrs)  # fmt: skip


def _avg_dilated_ref(x):
    # count_include_pad=1 with dilation 2: a depthwise conv with a 1/9 kernel, zero pads
    c = x.shape[1]
    w = torch.full((c, 1, 3, 3), 1 / 9, dtype=x.dtype)
    return F.conv2d(x, w, stride=2, padding=2, dilation=2, groups=c)


AVG_POOLS = [
    *(_avg(f"k3-s2-pad1{'-ceil' if ceil else ''}", X(2, 3, 8, 7), 2, 3, 2, 1, ceil, cp)
      for ceil in (0, 1) for cp in (0, 1)),
    _avg("k2", X(2, 3, 6, 8), 2, 2),
    # a window far past the input (EfficientNet's AvgPool2d(hidden_dim, ceil_mode=True))
    _avg("k9-ceil-past-input", X(2, 3, 2, 3), 2, 9, 9, 0, 1, 1),
    _avg("k7-pad1-ceil-past-input", X(1, 2, 3, 3), 2, 7, 7, 1, 1, 0),
    _avg("k3-s1-overlap", X(1, 2, 5, 6), 2, 3, 1, 1, 0, 0),
    _avg("k-3x2-s-2x1-pad-1x0-ceil", X(2, 2, 8, 6), 2, (3, 2), (2, 1), (1, 0), 1, 0),
    _avg("k2-s2-ceil-odd", X(2, 2, 7, 5), 2, 2, ceil=1),
    _avg("k3-s2-pad1-ceil", X(2, 3, 10), 1, 3, 2, 1, 1, 0),
    _avg("k4-s3-pad2", X(2, 3, 11), 1, 4, 3, 2, 0, 1),
    _avg("k2-s2-pad1", X(1, 2, 5, 4, 5), 3, 2, 2, 1, 0, 0),
    _avg("k3-s2-pad1-ceil", X(1, 2, 6, 5, 4), 3, 3, 2, 1, 1, 1),
    case("AveragePool2d-asymmetric-pads-count_pad1", "AveragePool", [X(2, 2, 5, 6)],
         lambda x: F.avg_pool2d(F.pad(x, (0, 1, 1, 0)), 2, 2),
         attrs={"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 0, 0, 1],
                "count_include_pad": 1}),
    case("AveragePool2d-auto-pad-same-lower-count_pad1", "AveragePool", [X(2, 2, 7, 6)],
         lambda x: F.avg_pool2d(F.pad(x, (1, 0, 1, 1)), 3, 2),
         attrs={"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER",
                "count_include_pad": 1}),
    case("AveragePool2d-dilation2-count_pad1", "AveragePool", [X(2, 2, 7, 8)],
         _avg_dilated_ref,
         attrs=_pool_attrs(2, 3, 2, 2, 2) | {"count_include_pad": 1}),
]  # fmt: skip


# --- LpPool (torch exports lp_pool as Pow / AveragePool; the ONNX op comes from elsewhere) --------


def _lp_ref(nd: int, p: int, k, stride, pad=0, ceil=0) -> Callable:
    def ref(x):
        v = x.abs() ** p
        if nd == 1:  # as a 2-D pool over [N, C, 1, L]
            v = v.unsqueeze(2)
            k_, s_, pad_ = (1, k), (1, stride), (0, pad)
        else:
            k_, s_, pad_ = k, stride, pad
        fn = F.avg_pool3d if nd == 3 else F.avg_pool2d
        total = fn(v, k_, s_, pad_, bool(ceil), True, divisor_override=1)  # window sums
        return (total.squeeze(2) if nd == 1 else total) ** (1 / p)

    return ref


def _lp(id: str, x: In, nd: int, p: int, k, stride=None, pad=0, ceil=0) -> Spec:
    attrs = _pool_attrs(nd, k, stride, pad, 1, ceil) | {"p": p}
    return case(f"LpPool{nd}d-p{p}-{id}", "LpPool", [x], _lp_ref(nd, p, k, stride or k, pad, ceil),
                attrs=attrs)  # fmt: skip


LP_POOLS = [
    _lp("k2", X(2, 3, 6, 8), 2, 2, 2),
    _lp("k3-s2-pad1-ceil", X(2, 2, 8, 7), 2, 2, 3, 2, 1, 1),
    _lp("k3-s2", X(2, 2, 7, 7), 2, 3, 3, 2),
    _lp("k2-s1", X(2, 3, 5, 4), 2, 1, 2, 1),
    _lp("k3-s2-pad1", X(2, 3, 9), 1, 2, 3, 2, 1),
    _lp("k2", X(1, 2, 4, 4, 6), 3, 2, 2),
]


# --- global pools ---------------------------------------------------------------------------------


def _global_avg(x):
    return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)


def _global_max(x):
    fn = {3: F.adaptive_max_pool1d, 4: F.adaptive_max_pool2d, 5: F.adaptive_max_pool3d}[x.dim()]
    return fn(x, 1)


GLOBAL_POOLS = [
    case("GlobalAveragePool1d", "GlobalAveragePool", [X(2, 3, 7)], _global_avg),
    case("GlobalAveragePool2d", "GlobalAveragePool", [X(2, 3, 5, 4)], _global_avg),
    case("GlobalAveragePool3d", "GlobalAveragePool", [X(1, 2, 3, 4, 3)], _global_avg),
    case("GlobalMaxPool1d-ties", "GlobalMaxPool", [Ties(3, 4, 6)], _global_max),
    case("GlobalMaxPool2d-ties", "GlobalMaxPool", [Ties(2, 3, 4, 5)], _global_max),
    case("GlobalMaxPool2d", "GlobalMaxPool", [X(2, 3, 4, 5)], _global_max),
    case("GlobalMaxPool3d-ties", "GlobalMaxPool", [Ties(2, 2, 3, 2, 3)], _global_max),
]  # fmt: skip


# --- ConvTranspose --------------------------------------------------------------------------------


def _convt_ref(nd: int, stride=1, pad=0, out_pad=0, groups=1, dilation=1) -> Callable:
    fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[nd]

    def ref(x, w, b=None):
        return fn(x, w, b, stride, pad, out_pad, groups, dilation)

    return ref


def _convt_attrs(nd: int, stride=1, pad=0, out_pad=0, groups=1, dilation=1) -> dict:
    attrs: dict[str, object] = {"strides": [stride] * nd, "pads": [pad] * (2 * nd)}
    if out_pad:
        attrs["output_padding"] = [out_pad] * nd
    if groups != 1:
        attrs["group"] = groups
    if dilation != 1:
        attrs["dilations"] = [dilation] * nd
    return attrs


def _convt(id: str, inputs: list, nd: int, **kw) -> Spec:
    return case(f"ConvTranspose{nd}d-{id}", "ConvTranspose", inputs, _convt_ref(nd, **kw),
                attrs=_convt_attrs(nd, **kw))  # fmt: skip


CONV_TRANSPOSES = [
    _convt("basic", [X(2, 3, 4, 5), X(3, 4, 3, 3), X(4)], 2),
    _convt("s2-pad1-outpad1-groups2", [X(2, 4, 4, 3), X(4, 3, 3, 3), X(6)], 2,
           stride=2, pad=1, out_pad=1, groups=2),
    _convt("s3-dil2-pad2-nobias", [X(2, 2, 3, 4), X(2, 2, 2, 3)], 2,
           stride=3, pad=2, dilation=2),
    _convt("depthwise-s2", [X(2, 4, 3, 3), X(4, 1, 2, 2), X(4)], 2, stride=2, groups=4),
    _convt("frozen-x", [X(2, 3, 4, 4, grad=False), X(3, 2, 3, 3), X(2)], 2, stride=2),
    _convt("s2-pad1-outpad1", [X(2, 3, 6), X(3, 4, 4), X(4)], 1,
           stride=2, pad=1, out_pad=1),
    _convt("s2-pad1", [X(1, 2, 3, 2, 3), X(2, 3, 3, 2, 3), X(3)], 3, stride=2, pad=1),
    case("ConvTranspose2d-asymmetric-pads", "ConvTranspose",
         [X(2, 2, 4, 3), X(2, 3, 3, 3), X(3)],
         lambda x, w, b: F.conv_transpose2d(x, w, b, 2)[:, :, 1:, :-1],
         attrs={"strides": [2, 2], "pads": [1, 0, 0, 1]}),
]  # fmt: skip


# --- Resize (as F.interpolate exports it, and a few more modes) -----------------------------------


def _interp(mode: str, scale=None, size=None, align_corners=None, aa=False) -> Callable:
    def ref(x, _scales_or_sizes):
        return F.interpolate(x, size=size, scale_factor=scale, mode=mode,
                             align_corners=align_corners, antialias=aa)  # fmt: skip

    return ref


def _resize(id: str, x: In, ref: Callable, attrs: dict, scales=None, sizes=None) -> Spec:
    rank = len(x.shape)
    if scales is not None:
        scales = [1.0, 1.0, *([scales] * (rank - 2) if np.isscalar(scales) else scales)]
        inputs = [x, None, Const(scales, "float32")]
    else:
        inputs = [x, None, None, Const([*x.shape[:2], *sizes])]
    return case(f"Resize-{id}", "Resize", inputs, ref, attrs=attrs)


NEAREST = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
           "nearest_mode": "floor"}  # fmt: skip
LINEAR = {"mode": "linear", "coordinate_transformation_mode": "half_pixel"}
CORNERS = {"mode": "linear", "coordinate_transformation_mode": "align_corners"}
CUBIC = {"mode": "cubic", "coordinate_transformation_mode": "half_pixel", "cubic_coeff_a": -0.75}
AA = {"antialias": 1, "exclude_outside": 1}
# torch's antialiased bicubic is PIL's (a = -0.5); the exporter writes -0.75 (a forward bug)
AA_CUBIC = CUBIC | AA | {"cubic_coeff_a": -0.5}

RESIZES = [
    _resize("nearest-2d-x2", X(2, 3, 4, 5), _interp("nearest", 2), NEAREST, 2.0),
    _resize("nearest-2d-x1.5", X(2, 3, 4, 6), _interp("nearest", 1.5), NEAREST, 1.5),
    _resize("nearest-2d-sizes-down-up", X(2, 2, 6, 6), _interp("nearest", size=(4, 9)),
            NEAREST, sizes=(4, 9)),
    _resize("nearest-1d-x3", X(2, 3, 5), _interp("nearest", 3), NEAREST, 3.0),
    _resize("nearest-3d-x2", X(1, 2, 2, 3, 2), _interp("nearest", 2), NEAREST, 2.0),
    _resize("bilinear-x2", X(2, 3, 4, 5), _interp("bilinear", 2, align_corners=False),
            LINEAR, 2.0),
    _resize("bilinear-x1.5", X(2, 2, 5, 6), _interp("bilinear", 1.5, align_corners=False),
            LINEAR, 1.5),
    _resize("bilinear-x0.5-down", X(2, 2, 8, 6), _interp("bilinear", 0.5, align_corners=False),
            LINEAR, 0.5),
    _resize("bilinear-sizes", X(2, 2, 5, 6), _interp("bilinear", size=(7, 4)), LINEAR,
            sizes=(7, 4)),
    _resize("bilinear-align-corners-x2", X(2, 3, 4, 5),
            _interp("bilinear", 2, align_corners=True), CORNERS, 2.0),
    _resize("bilinear-align-corners-sizes", X(2, 2, 5, 6),
            _interp("bilinear", size=(9, 4), align_corners=True), CORNERS, sizes=(9, 4)),
    _resize("linear-1d-x2.5", X(2, 3, 4), _interp("linear", 2.5, align_corners=False),
            LINEAR, 2.5),
    _resize("linear-1d-align-corners", X(2, 3, 4), _interp("linear", 2, align_corners=True),
            CORNERS, 2.0),
    _resize("trilinear-x2", X(1, 2, 3, 2, 3), _interp("trilinear", 2, align_corners=False),
            LINEAR, 2.0),
    _resize("trilinear-align-corners-sizes", X(1, 2, 3, 2, 3),
            _interp("trilinear", size=(4, 5, 2), align_corners=True), CORNERS,
            sizes=(4, 5, 2)),
    _resize("bicubic-x2", X(2, 2, 4, 5), _interp("bicubic", 2, align_corners=False),
            CUBIC, 2.0),
    _resize("bicubic-align-corners-sizes", X(2, 2, 5, 4),
            _interp("bicubic", size=(7, 9), align_corners=True),
            CUBIC | {"coordinate_transformation_mode": "align_corners"}, sizes=(7, 9)),
    _resize("bilinear-antialias-x0.5", X(2, 2, 8, 10), _interp("bilinear", 0.5, aa=True),
            LINEAR | AA, 0.5),
    _resize("bilinear-antialias-sizes-down-up", X(2, 2, 10, 6),
            _interp("bilinear", size=(6, 9), aa=True), LINEAR | AA, sizes=(6, 9)),
    _resize("bilinear-antialias-x0.3", X(1, 2, 11, 9), _interp("bilinear", 0.3, aa=True),
            LINEAR | AA, 0.3),
    _resize("bicubic-antialias-x0.6", X(2, 2, 10, 9), _interp("bicubic", 0.6, aa=True),
            AA_CUBIC, 0.6),
    _resize("bicubic-antialias-sizes-up", X(1, 2, 5, 4),
            _interp("bicubic", size=(8, 7), aa=True), AA_CUBIC, sizes=(8, 7)),
]  # fmt: skip


# --- Resize against onnxruntime's own forward -------------------------------------------------
# Which source elements onnxruntime reads is the forward the gradient must match, including
# where it departs from torch (float32 nearest indices) or from the spec's formula (x copied
# when no axis changes size; antialias leaves an axis of unchanged size alone). The
# reference is torch.autograd through the matrix onnxruntime applies, read off by resizing
# one-hot rows: y = x @ A_ort^T over the last axis of [N, C, 1, W].


def _ort_resize_matrix(attrs: dict, n_in: int, scale: float | None, size: int | None):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    inputs = ["x", "", "scales"] if size is None else ["x", "", "", "sizes"]
    if size is None:
        init = helper.make_tensor("scales", TensorProto.FLOAT, [4], [1, 1, 1, scale])
    else:
        init = helper.make_tensor("sizes", TensorProto.INT64, [4], [n_in, 1, 1, size])
    node = helper.make_node("Resize", inputs, ["y"], **attrs)
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n_in, 1, 1, n_in])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "resize", [x_info], [y_info], [init])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", gradcheck.OPSETS[""])])
    model.ir_version = gradcheck.IR_VERSION
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    eye = np.eye(n_in, dtype=np.float32).reshape(n_in, 1, 1, n_in)
    return sess.run(None, {"x": eye})[0].reshape(n_in, -1).T  # [n_out, n_in]


def _ort_resize(id: str, attrs: dict, n_in: int, scale=None, size=None) -> Spec:
    a = torch.from_numpy(_ort_resize_matrix(attrs, n_in, scale, size).astype(np.float64))

    def ref(x, _scales_or_sizes):
        return x @ a.T

    if size is None:
        inputs = [X(2, 3, 1, n_in), None, Const([1, 1, 1, scale], "float32")]
    else:
        inputs = [X(2, 3, 1, n_in), None, None, Const([2, 3, 1, size])]
    how = f"x{scale}" if size is None else f"{n_in}to{size}"
    return case(f"Resize-ort-{id}-{how}", "Resize", inputs, ref, attrs=attrs)


ORT_MODES = {
    "nearest-asymmetric-floor": NEAREST,
    "nearest-asymmetric-round": NEAREST | {"nearest_mode": "round_prefer_floor"},
    "nearest-half-pixel-floor": NEAREST | {"coordinate_transformation_mode": "half_pixel"},
    "nearest-align-corners-ceil": NEAREST
    | {"coordinate_transformation_mode": "align_corners", "nearest_mode": "ceil"},
    "linear-half-pixel": LINEAR,
    "linear-pytorch-half-pixel": LINEAR | {"coordinate_transformation_mode": "pytorch_half_pixel"},
    "linear-half-pixel-symmetric": LINEAR
    | {"coordinate_transformation_mode": "half_pixel_symmetric"},
    "linear-align-corners": CORNERS,
    "cubic-half-pixel": CUBIC,
    "cubic-asymmetric": CUBIC | {"coordinate_transformation_mode": "asymmetric"},
    "linear-antialias": LINEAR | AA,
    "cubic-antialias": CUBIC | AA,
}
# float32 index corner cases (14 -> 19, 26 -> 14, 21 -> 3), a size kept with scale != 1,
# shrinking and growing scales that are not out / in
ORT_SIZES = [(14, None, 19), (26, None, 14), (21, None, 3), (6, 1.1481615, None),
             (8, 0.6, None), (9, 0.45, None), (7, 2.5, None), (5, None, 1)]  # fmt: skip
ORT_RESIZES = [
    _ort_resize(name, attrs, n_in, scale, size)
    for name, attrs in ORT_MODES.items()
    for n_in, scale, size in ORT_SIZES
]


@pytest.mark.parametrize("spec", ORT_RESIZES, ids=[s.id for s in ORT_RESIZES])
def test_resize_gradient_is_the_adjoint_of_onnxruntime_forward(spec: Spec) -> None:
    check_gradients(spec)


# --- InstanceNormalization / GroupNormalization ---------------------------------------------------


def _instance_ref(eps: float = 1e-5) -> Callable:
    def ref(x, w, b):
        return F.instance_norm(x, weight=w, bias=b, eps=eps)

    return ref


def _group_ref(groups: int, eps: float = 1e-5, per_group: bool = True) -> Callable:
    def ref(x, w, b):
        if per_group:  # GroupNormalization-18: one scale and bias per group
            rep = x.shape[1] // groups
            w, b = w.repeat_interleave(rep), b.repeat_interleave(rep)
        return F.group_norm(x, groups, w, b, eps)

    return ref


NORMS = [
    case("InstanceNormalization-2d", "InstanceNormalization", [X(2, 3, 5, 4), X(3), X(3)],
         _instance_ref()),
    case("InstanceNormalization-1d-eps1e-3", "InstanceNormalization",
         [X(3, 4, 7), X(4), X(4)], _instance_ref(1e-3), attrs={"epsilon": 1e-3}),
    case("InstanceNormalization-3d", "InstanceNormalization",
         [X(2, 2, 3, 4, 3), X(2), X(2)], _instance_ref()),
    case("InstanceNormalization-2d-frozen-affine", "InstanceNormalization",
         [X(2, 3, 4, 4), X(3, grad=False), X(3, grad=False)], _instance_ref()),
    case("GroupNormalization18-2d-g2", "GroupNormalization", [X(2, 4, 3, 5), X(2), X(2)],
         _group_ref(2), attrs={"num_groups": 2}),
    case("GroupNormalization18-1d-g3", "GroupNormalization", [X(2, 6, 7), X(3), X(3)],
         _group_ref(3, 1e-3), attrs={"num_groups": 3, "epsilon": 1e-3}),
    case("GroupNormalization18-3d-g1", "GroupNormalization",
         [X(2, 3, 2, 3, 4), X(1), X(1)], _group_ref(1), attrs={"num_groups": 1}),
]  # fmt: skip


SPECS: list[Spec] = [
    *MAX_POOLS,
    *AVG_POOLS,
    *LP_POOLS,
    *GLOBAL_POOLS,
    *CONV_TRANSPOSES,
    *RESIZES,
    *NORMS,
]
_dup = [s.id for s in SPECS if [t.id for t in SPECS].count(s.id) > 1]
assert not _dup, f"duplicate spec ids: {_dup}"


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_rule(spec: Spec) -> None:
    check_gradients(spec)


# GroupNormalization-21: scale and bias per channel (18: per group), stash_type.
GROUP_NORMS_21 = [
    case("GroupNormalization21-2d-g2", "GroupNormalization", [X(2, 4, 3, 5), X(4), X(4)],
         _group_ref(2, per_group=False), attrs={"num_groups": 2}),
    case("GroupNormalization21-1d-g3-stash1", "GroupNormalization", [X(2, 6, 7), X(6), X(6)],
         _group_ref(3, 1e-3, per_group=False),
         attrs={"num_groups": 3, "epsilon": 1e-3, "stash_type": 1}),
    case("GroupNormalization21-3d-g4", "GroupNormalization",
         [X(1, 4, 2, 3, 2), X(4), X(4)], _group_ref(4, per_group=False),
         attrs={"num_groups": 4}),
]  # fmt: skip


@pytest.mark.parametrize("spec", GROUP_NORMS_21, ids=[s.id for s in GROUP_NORMS_21])
def test_group_norm_opset21(spec: Spec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gradcheck.OPSETS, "", 21)
    res, _ = check_gradients(spec)
    assert res.model.opset_imports[""] == 21


# --- structure: what the backward is spelled in ---------------------------------------------------


def _grad_ops(spec_id: str) -> list[str]:
    spec = next(s for s in SPECS if s.id == spec_id)
    res, _ = check_gradients(spec)
    return [n.op_type for n in res.model.graph if is_backward(n)]


@pytest.mark.parametrize(
    ("spec_id", "expected", "absent"),
    [
        ("MaxPool2d-k3-s2-pad1-ties", {"ScatterElements"}, {"MaxPool", "Conv"}),
        ("AveragePool2d-k3-s2-pad1-ceil-count_pad0", {"ConvTranspose", "Div"}, {"AveragePool"}),
        ("GlobalMaxPool2d-ties", {"ArgMax", "ScatterElements"}, {"ReduceMax"}),
        ("ConvTranspose2d-s2-pad1-outpad1-groups2", {"Conv", "ReduceSum"}, {"ConvTranspose"}),
        ("Resize-bilinear-x1.5", {"MatMul"}, {"Resize"}),
        ("InstanceNormalization-2d", {"ReduceMean"}, {"InstanceNormalization"}),
    ],
)
def test_backward_ops(spec_id: str, expected: set[str], absent: set[str]) -> None:
    ops = _grad_ops(spec_id)
    assert expected <= set(ops), ops
    assert not absent & set(ops), ops
    assert all(op[0].isupper() and "Grad" not in op for op in ops), ops


def test_a_window_past_the_input_spreads_through_a_kernel_of_the_inputs_size() -> None:
    """One window along an axis: the ones kernel stops at the input's end, not at the
    window's (a 1280 x 1280 window over a 1 x 1 map made gigabytes of kernel)."""
    spec = next(s for s in SPECS if s.id == "AveragePool2d-k9-ceil-past-input-count_pad1")
    res, _ = check_gradients(spec)
    (convt,) = [n for n in res.model.graph if n.op_type == "ConvTranspose"]
    assert list(convt.attributes["kernel_shape"].value) == [2, 3]
    assert list(convt.inputs[1].shape) == [3, 1, 2, 3]


def test_resize_gradient_touches_only_resized_axes() -> None:
    # nearest x2 over H and W of [N, C, H, W]: one MatMul per resized axis, none for N, C
    assert _grad_ops("Resize-nearest-2d-x2").count("MatMul") == 2
    assert _grad_ops("Resize-nearest-1d-x3").count("MatMul") == 1


def test_max_pool_with_indices_output_keeps_one_pool() -> None:
    # The forward MaxPool already returns Indices: the rule reads them, adds no second pool.
    spec = next(s for s in SPECS if s.id == "MaxPool2d-indices-output-ties")
    res, _ = check_gradients(spec)
    assert [n.op_type for n in res.model.graph].count("MaxPool") == 1


# --- unsupported attributes raise, naming the op, the node and the attribute ----------------------

UNSUPPORTED = [
    (case("MaxPool-storage-order-1", "MaxPool", [X(1, 2, 4, 4)], _max_ref(2, 2),
          attrs=_pool_attrs(2, 2) | {"storage_order": 1}), "storage_order"),
    (case("ConvTranspose-auto-pad", "ConvTranspose", [X(1, 2, 3, 3), X(2, 2, 3, 3)],
          _convt_ref(2, stride=2), attrs={"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
     "auto_pad=SAME_UPPER"),
    (case("Resize-tf-crop-and-resize", "Resize",
          [X(1, 2, 4, 4), Const([0, 0, 0.1, 0.1, 1, 1, 0.9, 0.9], "float32"),
           Const([1, 1, 2, 2], "float32")], _interp("bilinear", 2),
          attrs={"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize"}),
     "tf_crop_and_resize"),
    # torch's nearest-exact (exported as a GatherND chain, not Resize)
    (_resize("nearest-half-pixel-round", X(2, 2, 5, 6), _interp("nearest-exact", size=(7, 4)),
             {"mode": "nearest", "coordinate_transformation_mode": "half_pixel",
              "nearest_mode": "round_prefer_ceil"}, sizes=(7, 4)),
     "round_prefer_ceil with half_pixel"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "what"), UNSUPPORTED, ids=[s.id for s, _ in UNSUPPORTED])
def test_unsupported_attribute_raises(spec: Spec, what: str) -> None:
    with pytest.raises(GradientError, match=rf"{spec.op}.*node_under_test.*{what}"):
        check_gradients(spec)


# --- end to end: a small CNN through ORTTrainer against eager -------------------------------------


class SmallCNN(torch.nn.Module):
    """Conv, GroupNorm, InstanceNorm (affine and not), MaxPool, AvgPool (ceil mode, padding
    not counted), AdaptiveAvgPool, ConvTranspose, bilinear and nearest interpolation."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.pool1 = nn.MaxPool2d(3, 2, 1)
        # no bias right before an InstanceNorm: its exact gradient is zero, and Adam would
        # turn both sides' float noise into full-size steps
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.pool2 = nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False)
        self.up = nn.ConvTranspose2d(8, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.inorm2 = nn.InstanceNorm2d(6)
        self.side = nn.Conv2d(3, 6, 1, bias=False)
        self.squeeze = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(6 * 4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.gn(self.conv1(x)))  # [B, 8, 12, 12]
        h = self.pool1(h)  # 6x6
        h = F.relu(self.inorm(self.conv2(h)))
        h = self.pool2(h)  # 4x4: the last windows are partial (ceil mode)
        h = F.relu(self.up(h))  # 8x8
        h = F.interpolate(h, scale_factor=1.5, mode="bilinear", align_corners=False)  # 12x12
        side = F.interpolate(self.side(x[:, :, ::2, ::2]), scale_factor=2, mode="nearest")
        h = self.inorm2(h + side)
        h = self.squeeze(h).flatten(1)
        return F.cross_entropy(self.head(h), y)


class SmallCNN1d(torch.nn.Module):
    """The 1-D forms: GroupNorm and InstanceNorm1d (affine and not) over [N, C, L], pools
    with ceil mode and counted padding, ConvTranspose1d, linear and nearest interpolation."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv1d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(4, 8)
        self.pool1 = nn.MaxPool1d(3, 2, 1, ceil_mode=True)
        self.conv2 = nn.Conv1d(8, 8, 3, padding=1, bias=False)  # InstanceNorm follows
        self.inorm = nn.InstanceNorm1d(8, affine=True)
        self.pool2 = nn.AvgPool1d(3, 2, 1, count_include_pad=True)
        self.up = nn.ConvTranspose1d(8, 4, 4, stride=2, padding=1)
        self.inorm2 = nn.InstanceNorm1d(4)
        self.head = nn.Linear(4 * 3, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.gn(self.conv1(x)))  # [B, 8, 15]
        h = self.pool1(h)  # 8
        h = F.relu(self.inorm(self.conv2(h)))
        h = self.pool2(h)  # 4
        h = F.relu(self.up(h))  # 8
        h = F.interpolate(h, size=9, mode="linear", align_corners=True)  # a GatherND chain
        h = h * F.interpolate(torch.sigmoid(h[..., ::3]), size=9, mode="nearest")  # Resize
        h = F.max_pool1d(self.inorm2(h), 3).flatten(1)
        return F.cross_entropy(self.head(h), y)


class SmallCNN3d(torch.nn.Module):
    """The 3-D forms: GroupNorm, InstanceNorm3d, MaxPool3d, AvgPool3d, ConvTranspose3d,
    trilinear and nearest interpolation."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv3d(2, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.pool1 = nn.MaxPool3d(2)
        self.conv2 = nn.Conv3d(4, 4, 3, padding=1, bias=False)  # InstanceNorm follows
        self.inorm = nn.InstanceNorm3d(4, affine=True)
        self.pool2 = nn.AvgPool3d(2, 1, 1, count_include_pad=False)
        self.up = nn.ConvTranspose3d(4, 4, 2, stride=2, groups=2)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.gn(self.conv1(x)))  # [B, 4, 6, 6, 6]
        h = self.pool1(h)  # 3
        h = F.relu(self.inorm(self.conv2(h)))
        h = self.pool2(h)  # 4
        h = F.relu(self.up(h))  # 8
        h = F.interpolate(h, scale_factor=0.75, mode="trilinear", align_corners=False)  # 6
        h = h * F.interpolate(x[:, :1], scale_factor=1.0, mode="nearest")
        return F.cross_entropy(self.head(h.mean(dim=(2, 3, 4))), y)


CNNS = {
    "2d": (SmallCNN, (4, 3, 12, 12)),
    "1d": (SmallCNN1d, (4, 3, 15)),
    "3d": (SmallCNN3d, (2, 2, 6, 6, 6)),
}
POOLING_OPS = ("InstanceNormalization", "MaxPool", "AveragePool", "ConvTranspose", "Resize")


@pytest.mark.parametrize(
    "dims", ["2d", *(pytest.param(d, marks=pytest.mark.slow) for d in ("1d", "3d"))]
)
def test_small_cnn_trains_like_eager(dims: str) -> None:
    """8 AdamW steps: the first step's gradients element-wise, every loss, the weights."""
    make, shape = CNNS[dims]
    torch.manual_seed(0)
    ref = make().train()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    # the "torch" engine updates after the session, so the gradients stay readable
    trainer = ORTTrainer(model, opt, TrainerOptions(update_engine="torch"))
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        x, y = torch.randn(*shape, generator=g), torch.randint(0, 5, (shape[0],), generator=g)
        opt_ref.zero_grad()
        loss = ref(x, y)
        loss.backward()
        ours = trainer.train_step(x, y)
        assert ours.item() == pytest.approx(loss.item(), rel=1e-4), f"step {step}"
        if step == 0:
            for name, p in ref.named_parameters():
                atol = 1e-5 * p.grad.abs().max().item()
                torch.testing.assert_close(trainer.grads[name], p.grad, rtol=1e-4, atol=atol,
                                           msg=lambda m, n=name: f"grad {n}: {m}")  # fmt: skip
        opt_ref.step()
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    (compiled,) = trainer._graphs.train.values()
    ops = [n.op_type for n in compiled.model.graph]
    missing = [op for op in POOLING_OPS if op not in ops]
    assert not missing, f"not in the training graph: {missing}"
