"""ONNX translations for aten ops the exporter has no function for.

1. ``aten::_cdist_forward`` (``torch.cdist``: prototype networks, metric learning,
   k-means-style layers): the p-norm of every pairwise difference, ``x1 [..., P, M]``
   against ``x2 [..., R, M]`` -> ``[..., P, R]``, spelled with the differences
   (``[..., P, R, M]``, as torch's own path for small sets and its backward): p = 2 and 1
   as ReduceL2 / ReduceL1 (whose gradient is 0 at a zero distance, as torch's), p = inf
   as the largest absolute difference, p = 0 as the count of differing coordinates, any
   other p as ``(sum |d|^p)^(1/p)`` with zeros kept out of the powers' gradients.
2. ``aten::linalg_vector_norm`` (``torch.norm(x, p)``, ``torch.linalg.vector_norm``) for
   p > 0 other than 1, 2 and inf: ``(sum |x|^p)^(1/p)`` as the exporter's function spells
   it, with cdist's zeros kept out, so the gradient is 0 at zero elements and where the
   norm is 0, as torch's ``norm_backward`` masks it (not 0 * inf = NaN). Other p go to
   the exporter's own function.
3. ``aten::scatter_reduce`` with ``reduce="mean"`` on floating tensors: the exporter's
   function writes it as ``ScatterElements(reduction="none")``, the last update winning,
   which is the mean only where no index repeats (a first batch without duplicates
   passes the first-step check, later ones trained another loss). Here it is a sum over
   a count, both scattered with ``reduction="add"``: torch's mean, including ``self``'s
   value (``include_self``) or not, and the untouched positions keeping theirs. Other
   reductions go to the exporter's function.
4. ``aten::logcumsumexp``: the exporter's function is ``log(cumsum(exp(x - max))) + max``
   in the input's precision with the whole row's maximum, so a prefix more than about 88
   below the row's maximum (float32) underflows to ``log(0) = -inf``, and a row of -inf
   is ``-inf - -inf = NaN`` (a wrong loss, NaN parameters). Here it is summed in float64
   (prefixes to about 745 below the maximum stay exact), a row's maximum of -inf is
   shifted by 0, and an empty prefix is -inf with a zero gradient (eager's values; its
   gradient ``sum_i g_i exp(x_j - out_i)`` is what autodiff takes of it).
5. ``aten::baddbmm`` / ``addbmm`` / ``addmv`` / ``addr``: ``beta * self + alpha *
   product``. With ``beta=0`` torch ignores ``self`` (its NaN and inf do not propagate:
   a buffer from ``torch.empty``); the exporter's functions multiply it by 0 (NaN). Here
   ``self`` is left out where beta is 0, and a factor of 1 is no op.
6. ``aten::bernoulli`` (``torch.bernoulli(p)``, a tensor of probabilities): the
   exporter's function is ONNX's ``Bernoulli``, whose ONNX Runtime CPU kernel draws 1 with
   probability ``1 - p`` (measured: p = 0.1 gave 0.9 ones), so a stochastic mask or
   binarization trained on the complement. Here it is ``RandomUniformLike(p) < p``, as
   the exporter already spells ``bernoulli.p`` (a scalar probability).
7. ``aten::avg_pool2d`` / ``avg_pool3d`` with ``divisor_override``: the exporter's
   function drops it (ONNX's ``AveragePool`` has no divisor), so ``nn.AvgPool2d(...,
   divisor_override=4)`` trained an average where torch takes each window's sum over 4.
   Here it is the average with the padding counted (whose divisor is the window clipped
   to the padded input, as torch's) times that window's size over the divisor: a
   constant per output position, read off the static shapes. Without the divisor, with
   a spatial size not known at the export, or where ``ceil_mode`` makes torch drop a
   last window that would start in the padding (ONNX Runtime keeps it), the exporter's
   function as before (the first-step check catches the latter two).
8. ``aten::uniform`` (``uniform_(a, b)``, its bounds known at the export: NEFTune's
   embedding noise, whose bounds are 0-dim tensors): the exporter decomposes it to
   ``prims::uniform``, for which it has no function, so such a module ran in eager. Here
   it is ``RandomUniformLike`` over the bounds, which the first-step check fixes
   (``graph_passes/prepare/random_switch.py``).
9. Complex ``unsqueeze``, ``expand``, ``select``, ``alias``, ``zeros_like``, ``fill``,
   ``copy``, ``slice_scatter``, ``select_scatter`` and two-operand ``einsum``
   (``complex_translations``): the exporter carries a complex tensor as its real view,
   ``[..., 2]``, and has complex functions for ``view_as_complex``/``view_as_real``,
   ``mul``, slices and the like, but not these, which rotary embeddings written with
   complex numbers (Llama 4's ``freqs_cis[...].unsqueeze(1)``) and spectral layers (a
   Fourier neural operator's ``out[..., :modes] = einsum(...)`` into ``zeros_like``) use:
   such a model ran that part in eager. Here the real view gets the same axis, broadcast
   or slice (the (re, im) axis kept last, negative axes counted before it), and a complex
   product is four real ``Einsum``s over the equation's own axes. A real value copied
   into a complex tensor gets zero imaginary parts; the real view carries no dtype, so
   a real operand is told from a complex one by which of the two broadcasts to the
   target, and a copy where both do is refused (the module then runs in eager).
10. ``aten::atan2`` and complex ``angle``: the exporter's ``atan2`` gives -pi for a zero
   ``y`` over a negative ``x`` (torch: pi; the angle of a spectrum's real DC bin), 0 for
   NaN, NaN for two infinities, and a NaN gradient where ``x`` is 0 (the slope's
   quotient). Here signed zeros read as torch reads them, and each quotient is taken
   over the larger magnitude with the other branch's divisor 1, so no gradient divides
   by zero (torch's is ``x / (x^2 + y^2)``).
11. ``aten::kthvalue`` (``torch.kthvalue``: a robust pooling or a trimmed statistic), which
   the exporter has no function for (the module ran in eager): the ``k`` smallest along
   the axis by ``TopK`` (ascending, sorted) and the last of them, value and index, the
   axis kept or dropped as ``keepdim`` says; the gradient goes to that index, as torch's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def _cdist(x1: Any, x2: Any, p: float = 2.0, compute_mode: Any = None) -> Any:
    from onnxscript import opset18 as op

    last = op.Constant(value_ints=[-1])
    diff = op.Sub(
        op.Unsqueeze(x1, op.Constant(value_ints=[-2])),
        op.Unsqueeze(x2, op.Constant(value_ints=[-3])),
    )
    if p == 2.0:
        return op.ReduceL2(diff, last, keepdims=0)
    if p == 1.0:
        return op.ReduceL1(diff, last, keepdims=0)
    if math.isinf(p):
        return op.ReduceMax(op.Abs(diff), last, keepdims=0)
    if p == 0.0:  # through Sign, whose gradient is zeros: torch's (not None) for x1 and x2
        return op.ReduceSum(op.Sign(op.Abs(diff)), last, keepdims=0)
    return _p_norm(op, diff, p, last, keepdims=0)


def _p_norm(op: Any, x: Any, p: float, axes: Any, keepdims: int, magnitude: Any = None) -> Any:
    """``(sum |x|^p)^(1/p)`` over ``axes`` for p > 0 (``magnitude``: ``|x|`` or, for an
    even p, ``x`` itself). |x|^p and the root are kept off zero: their gradients there
    are 0 (torch's), not inf."""
    zero = op.CastLike(op.Constant(value_float=0.0), x)
    one = op.CastLike(op.Constant(value_float=1.0), x)
    same = op.Equal(x, zero)
    base = op.Abs(x) if magnitude is None else magnitude
    powered = op.Pow(op.Where(same, one, base), op.CastLike(op.Constant(value_float=p), x))
    total = op.ReduceSum(op.Where(same, zero, powered), axes, keepdims=keepdims)
    at_zero = op.Equal(total, zero)
    root = op.Pow(op.Where(at_zero, one, total), op.CastLike(op.Constant(value_float=1.0 / p), x))
    return op.Where(at_zero, zero, root)


def _vector_norm(
    self: Any, ord: float = 2.0, dim: Any = None, keepdim: bool = False, dtype: int = -1
) -> Any:
    from onnxscript import opset18 as op
    from onnxscript.function_libs.torch_lib.ops.linalg import aten_linalg_vector_norm

    p = float(ord)
    if not p > 0 or p in (1.0, 2.0) or math.isinf(p):
        # ReduceL1 / ReduceL2 / ReduceMax already give torch's 0 at zero; p <= 0 counts
        # or inverts zeros, a different shape of gradient
        return aten_linalg_vector_norm(self, ord, dim, keepdim, dtype)
    if dtype != -1:
        self = op.Cast(self, to=dtype)
    if dim is None:
        self = op.Reshape(self, op.Constant(value_ints=[-1]))
        axes, keepdim = op.Constant(value_ints=[0]), False
    else:
        axes = op.Constant(value_ints=list(dim) if isinstance(dim, (list, tuple)) else [dim])
    # An even p needs no Abs (the exporter's spelling: the same value and gradient)
    magnitude = self if p % 2 == 0 else None
    return _p_norm(op, self, p, axes, keepdims=int(keepdim), magnitude=magnitude)


def _scatter_reduce(
    self: Any, dim: int, index: Any, src: Any, reduce: str, include_self: bool = True
) -> Any:
    from onnxscript import ir
    from onnxscript import opset18 as op
    from onnxscript.function_libs.torch_lib.ops.core import aten_scatter_reduce

    floats = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    if reduce != "mean" or self.dtype not in floats or len(self.shape) == 0:
        return aten_scatter_reduce(self, dim, index, src, reduce, include_self)
    # constants of their shapes and types (no gradient flows through them)
    zeros = op.Expand(op.CastLike(op.Constant(value_float=0.0), self), op.Shape(self))
    ones = op.Expand(op.CastLike(op.Constant(value_float=1.0), src), op.Shape(src))
    count = op.ScatterElements(zeros, index, ones, axis=dim, reduction="add")
    base = self
    if not include_self:  # the written positions start from 0, the others keep self
        base = op.Where(op.Greater(count, zeros), zeros, self)
    else:
        count = op.Add(count, op.CastLike(op.Constant(value_float=1.0), count))
    total = op.ScatterElements(base, index, src, axis=dim, reduction="add")
    one = op.CastLike(op.Constant(value_float=1.0), count)
    return op.Div(total, op.Max(count, one))


def _logcumsumexp(self: Any, dim: int) -> Any:
    from onnxscript import ir
    from onnxscript import opset18 as op
    from onnxscript.function_libs.torch_lib.ops.core import aten_logcumsumexp

    if len(self.shape) == 0:
        return aten_logcumsumexp(self, dim)
    axis = op.Constant(value_ints=[dim])
    x = op.Cast(self, to=ir.DataType.DOUBLE)
    zero = op.CastLike(op.Constant(value_float=0.0), x)
    top = op.ReduceMax(x, axis, keepdims=1)
    top = op.Where(op.IsInf(top), zero, top)  # a row of -inf (or one +inf): no shift
    total = op.CumSum(op.Exp(op.Sub(x, top)), op.Constant(value_int=dim))
    empty = op.Equal(total, zero)  # every element so far -inf (or 745 below the maximum)
    one = op.CastLike(op.Constant(value_float=1.0), x)
    value = op.Add(op.Log(op.Where(empty, one, total)), top)
    minus_inf = op.CastLike(op.Constant(value_float=-math.inf), x)
    return op.CastLike(op.Where(empty, minus_inf, value), self)


def _kthvalue(self: Any, k: int, dim: int = -1, keepdim: bool = False) -> Any:
    from onnxscript import opset18 as op

    if len(self.shape) == 0:  # one element: itself, at index 0
        return op.Identity(self), op.Constant(value=torch.tensor(0, dtype=torch.int64))
    values, indices = op.TopK(self, op.Constant(value_ints=[k]), axis=dim, largest=0, sorted=1)
    at = op.Constant(value_ints=[k - 1])
    value, index = op.Gather(values, at, axis=dim), op.Gather(indices, at, axis=dim)
    if not keepdim:
        axis = op.Constant(value_ints=[dim])
        value, index = op.Squeeze(value, axis), op.Squeeze(index, axis)
    return value, index


def _scaled_sum(op: Any, self: Any, product: Any, beta: float, alpha: float) -> Any:
    """``beta * self + alpha * product``, ``self`` ignored where ``beta`` is 0 (torch's)."""
    if alpha != 1:
        product = op.Mul(product, op.CastLike(op.Constant(value_float=float(alpha)), product))
    if beta == 0:
        return product
    if beta != 1:
        self = op.Mul(self, op.CastLike(op.Constant(value_float=float(beta)), self))
    return op.Add(self, product)


def _baddbmm(self: Any, batch1: Any, batch2: Any, beta: float = 1.0, alpha: float = 1.0) -> Any:
    from onnxscript import opset18 as op

    return _scaled_sum(op, self, op.MatMul(batch1, batch2), beta, alpha)


def _addbmm(self: Any, batch1: Any, batch2: Any, beta: float = 1.0, alpha: float = 1.0) -> Any:
    from onnxscript import opset18 as op

    summed = op.ReduceSum(op.MatMul(batch1, batch2), op.Constant(value_ints=[0]), keepdims=0)
    return _scaled_sum(op, self, summed, beta, alpha)


def _addmv(self: Any, mat: Any, vec: Any, beta: float = 1.0, alpha: float = 1.0) -> Any:
    from onnxscript import opset18 as op

    return _scaled_sum(op, self, op.MatMul(mat, vec), beta, alpha)


def _addr(self: Any, vec1: Any, vec2: Any, beta: float = 1.0, alpha: float = 1.0) -> Any:
    from onnxscript import opset18 as op

    outer = op.Mul(
        op.Unsqueeze(vec1, op.Constant(value_ints=[-1])),
        op.Unsqueeze(vec2, op.Constant(value_ints=[0])),
    )
    return _scaled_sum(op, self, outer, beta, alpha)


def _bernoulli(self: Any) -> Any:
    from onnxscript import ir
    from onnxscript import opset18 as op

    p = op.Cast(self, to=ir.DataType.FLOAT)
    drawn = op.Less(op.RandomUniformLike(p, low=0.0, high=1.0), p)
    return op.CastLike(drawn, self)


def _uniform(self: Any, low: float = 0.0, high: float = 1.0, generator: Any = None) -> Any:
    from onnxscript import opset18 as op

    return op.RandomUniformLike(self, low=float(low), high=float(high))


def _unsqueeze_complex(self: Any, dim: int) -> Any:
    from onnxscript import opset18 as op

    axis = dim if dim >= 0 else dim - 1  # counted before the real view's (re, im) axis
    return op.Unsqueeze(self, op.Constant(value_ints=[axis]))


def _expand_complex(self: Any, size: Any, implicit: bool = False) -> Any:
    from onnxscript import opset18 as op

    # -1 keeps the axis: 1 in ONNX's Expand, which broadcasts it to the input's
    dims = [abs(int(d)) for d in size] + [2]
    return op.Expand(self, op.Constant(value_ints=dims))


def _zeros_like_complex(self: Any, dtype: Any = None, **_: Any) -> Any:
    from onnxscript import ir
    from onnxscript import opset18 as op

    # zeros made, not ``self * 0`` (NaN * 0 is NaN)
    if dtype is None:  # the real view's shape and type
        return op.CastLike(op.ConstantOfShape(op.Shape(self)), self)
    views = {ir.DataType.COMPLEX64: ir.DataType.FLOAT, ir.DataType.COMPLEX128: ir.DataType.DOUBLE}
    if dtype in views:
        return op.Cast(op.ConstantOfShape(op.Shape(self)), to=views[dtype])
    # a real dtype: the complex tensor's own shape, without the (re, im) axis
    return op.Cast(op.ConstantOfShape(op.Shape(self, end=-1)), to=dtype)


def _einsum_complex(equation: str, tensors: Any, path: Any = None) -> Any:
    from onnxscript import opset18 as op

    if len(tensors) != 2:  # a chain is pairwise only for some equations: not translated
        raise NotImplementedError("complex einsum of other than two operands")
    a, b = tensors
    ar, ai, br, bi = (
        op.Gather(t, op.Constant(value_int=k), axis=-1) for t in (a, b) for k in (0, 1)
    )
    # (ar + i ai)(br + i bi), each product over the equation's own axes
    real = op.Sub(op.Einsum(ar, br, equation=equation), op.Einsum(ai, bi, equation=equation))
    imag = op.Add(op.Einsum(ar, bi, equation=equation), op.Einsum(ai, br, equation=equation))
    last = op.Constant(value_ints=[-1])
    return op.Concat(op.Unsqueeze(real, last), op.Unsqueeze(imag, last), axis=-1)


def _broadcasts(shape: list[Any], to: list[Any]) -> bool:
    """``shape`` broadcasts to ``to`` (static sizes)."""
    if len(shape) > len(to):
        return False
    return all(a == 1 or a == b for a, b in zip(reversed(shape), reversed(to)))


def _copy_complex(self: Any, src: Any, non_blocking: bool = False) -> Any:
    from onnxscript import opset18 as op

    # ``self`` is complex (a real view, [..., 2]); ``src`` may be complex (a real view) or
    # real (a real value copies with zero imaginary parts), which only shapes tell apart
    to = list(self.shape) if self.shape is not None else None
    got = list(src.shape) if src.shape is not None else None
    if to is None or got is None or not all(isinstance(d, int) for d in [*to, *got]):
        if to is not None and got is not None and len(got) == len(to):
            return op.Expand(op.CastLike(src, self), op.Shape(self))  # complex (real: lower)
        raise NotImplementedError("complex copy without static shapes")
    complex_src = bool(got) and got[-1] == 2 and _broadcasts(got[:-1], to[:-1])
    real_src = _broadcasts(got, to[:-1])
    if complex_src == real_src:  # neither, or either (a real one whose last axis is 2)
        raise NotImplementedError(f"complex copy of a {got} operand into {to[:-1]}: ambiguous")
    if real_src:
        real = op.Unsqueeze(op.CastLike(src, self), op.Constant(value_ints=[-1]))
        zeros = op.CastLike(op.ConstantOfShape(op.Shape(real)), self)
        src = op.Concat(real, zeros, axis=-1)
    return op.Expand(op.CastLike(src, self), op.Shape(self))


def _fill_complex(self: Any, value: Any) -> Any:
    from onnxscript import opset18 as op

    if isinstance(value, int | float | complex):
        pair = op.Constant(value_floats=[complex(value).real, complex(value).imag])
    elif value.shape is not None and list(value.shape) == [2]:  # a complex 0-dim tensor
        pair = value
    elif value.shape is not None and len(value.shape) == 0:  # a real one: no imaginary part
        pair = op.Concat(
            op.Reshape(op.CastLike(value, self), op.Constant(value_ints=[1])),
            op.CastLike(op.Constant(value_floats=[0.0]), self),
            axis=0,
        )
    else:
        raise NotImplementedError("complex fill with a value of unknown shape")
    return op.Expand(op.CastLike(pair, self), op.Shape(self))


def _select_scatter_complex(self: Any, src: Any, dim: int, index: int) -> Any:
    from onnxscript.function_libs.torch_lib.ops.core import aten_select_scatter

    return aten_select_scatter(self, src, dim if dim >= 0 else dim - 1, index)


def _slice_scatter_complex(
    self: Any, src: Any, dim: int = 0, start: Any = None, end: Any = None, step: int = 1
) -> Any:
    from onnxscript.function_libs.torch_lib.ops.core import aten_slice_scatter

    axis = dim if dim >= 0 else dim - 1  # counted before the real view's (re, im) axis
    return aten_slice_scatter(self, src, axis, start, end, step)


def _alias_complex(self: Any) -> Any:
    from onnxscript import opset18 as op

    return op.Identity(self)


def _select_complex(self: Any, dim: int, index: int) -> Any:
    from onnxscript.function_libs.torch_lib.ops.core import aten_select

    return aten_select(self, dim if dim >= 0 else dim - 1, index)


def _one_hot(self: Any, num_classes: int = -1) -> Any:
    """``F.one_hot``: ONNX ``OneHot`` over a constant depth, not torch's decomposition
    (``eq(x[..., None], arange(n))``, which gives a row of zeros for a class out of range
    where eager raises): the index check (``ortrain/index_check.py``) reads OneHot's depth
    and refuses such a batch as eager does. ``num_classes=-1`` (the batch's max + 1) is
    data-dependent: the export stops before this."""
    from onnxscript import opset18 as op

    if num_classes < 0:
        raise ValueError("one_hot with num_classes=-1 depends on the batch's values")
    return op.OneHot(
        self,
        op.Constant(value_ints=[num_classes]),
        op.Constant(value_ints=[0, 1]),
        axis=-1,
    )


def _atan2(y: Any, x: Any) -> Any:
    from onnxscript import opset18 as op

    def const(value: float) -> Any:
        return op.CastLike(op.Constant(value_float=value), y)

    zero, one, pi = const(0.0), const(1.0), const(math.pi)
    # the sign bits, -0.0's included (1 / -0.0 is -inf), as torch's atan2 reads them
    y_up = op.Or(op.Greater(y, zero), op.And(op.Equal(y, zero), op.Greater(op.Div(one, y), zero)))
    x_back = op.Or(op.Less(x, zero), op.And(op.Equal(x, zero), op.Less(op.Div(one, x), zero)))
    # both infinite: the slope of their signs (atan2(inf, inf) is pi / 4)
    both_inf = op.And(op.IsInf(y), op.IsInf(x))
    y_, x_ = op.Where(both_inf, op.Sign(y), y), op.Where(both_inf, op.Sign(x), x)
    # each quotient over the larger magnitude, the other branch's divisor kept at 1 so
    # that no gradient divides by zero (torch's is x / (x^2 + y^2), 0 where x is 0)
    flat = op.LessOrEqual(op.Abs(y_), op.Abs(x_))
    near = op.Atan(op.Div(y_, op.Where(flat, x_, one)))
    near = op.Where(x_back, op.Where(y_up, op.Add(near, pi), op.Sub(near, pi)), near)
    half_pi = op.Mul(op.Where(y_up, one, op.Neg(one)), const(math.pi / 2))
    steep = op.Sub(half_pi, op.Atan(op.Div(x_, op.Where(flat, one, y_))))
    angle = op.Where(flat, near, steep)
    # both zero: +-0 towards +0, +-pi towards -0
    both_zero = op.And(op.Equal(y, zero), op.Equal(x, zero))
    at_zero = op.Where(x_back, op.Where(y_up, pi, op.Neg(pi)), y)
    return op.Where(both_zero, at_zero, angle)


def _angle_complex(self: Any) -> Any:
    from onnxscript import opset18 as op

    last = op.Constant(value_ints=[-1])
    real = op.Squeeze(op.Slice(self, [0], [1], last), last)
    imag = op.Squeeze(op.Slice(self, [1], [2], last), last)
    return _atan2(imag, real)


def complex_translations() -> dict[Callable, Callable]:
    """Translations for complex inputs, registered with ``is_complex`` (docstring, 9)."""
    return {
        torch.ops.aten.unsqueeze.default: _unsqueeze_complex,
        torch.ops.aten.expand.default: _expand_complex,
        torch.ops.aten.zeros_like.default: _zeros_like_complex,
        torch.ops.aten.einsum.default: _einsum_complex,
        torch.ops.aten.angle.default: _angle_complex,
        torch.ops.aten.copy.default: _copy_complex,
        torch.ops.aten.slice_scatter.default: _slice_scatter_complex,
        torch.ops.aten.select_scatter.default: _select_scatter_complex,
        torch.ops.aten.alias.default: _alias_complex,
        torch.ops.aten.fill.Scalar: _fill_complex,
        torch.ops.aten.fill.Tensor: _fill_complex,
        torch.ops.aten.select.int: _select_complex,
    }


def _window_sizes(
    sizes: list[int], kernel: list[int], stride: list[int], padding: list[int], ceil_mode: bool
) -> Any:
    """Per output position, the size of its window clipped to the padded input (torch's
    divisor with the padding counted), as a float32 array over the spatial axes; None
    where torch drops a last window that would start in the padding (``ceil_mode``),
    which ONNX Runtime's ``AveragePool`` keeps."""
    import numpy as np

    per_axis = []
    for n, k, s, p in zip(sizes, kernel, stride, padding):
        span = n + 2 * p - k
        out = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (out - 1) * s >= n + p:
            return None
        starts = np.arange(out) * s - p
        per_axis.append(np.minimum(starts + k, n + p) - starts)
    total = per_axis[0].astype(np.float64)
    for axis in per_axis[1:]:
        total = np.multiply.outer(total, axis)
    return total.astype(np.float32)


def _avg_pool(spatial: int, function: Callable) -> Callable:
    def translate(
        self: Any,
        kernel_size: Any,
        stride: Any = (),
        padding: Any = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
    ) -> Any:
        from onnxscript import ir
        from onnxscript import opset18 as op

        def per_axis(value: Any, default: list[int]) -> list[int]:
            if isinstance(value, int):
                return [value] * spatial
            value = list(value) or default
            return value * spatial if len(value) == 1 else value

        shape = self.shape
        sizes = [] if shape is None else list(shape)[-spatial:]
        static = len(sizes) == spatial and all(isinstance(d, int) for d in sizes)
        if divisor_override is None or not static:
            return function(
                self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
            )
        kernel = per_axis(kernel_size, [])
        steps = per_axis(stride, kernel)
        pads = per_axis(padding, [0])
        windows = _window_sizes(sizes, kernel, steps, pads, ceil_mode)
        if windows is None:
            return function(
                self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
            )
        average = function(self, kernel, steps, pads, ceil_mode, True, None)
        scale = windows / float(divisor_override)
        if average.shape is None:  # the exporter gives shapes to a translation's output only
            average.shape = ir.Shape([*list(shape)[:-spatial], *scale.shape])
        factor = op.Constant(value=ir.tensor(scale))
        return op.Mul(average, op.CastLike(factor, average))

    return translate


def aten_translations() -> dict[Callable, Callable]:
    from onnxscript.function_libs.torch_lib.ops.nn import aten_avg_pool2d, aten_avg_pool3d

    from ortrain.export_bce import bce_translations
    from ortrain.export_gamma import gamma_translations
    from ortrain.export_lstm import lstm_translations
    from ortrain.export_order import order_translations
    from ortrain.export_pointwise import pointwise_translations
    from ortrain.export_precise import precise_translations
    from ortrain.export_sdpa_rank import sdpa_translations

    return {
        **bce_translations(),
        **gamma_translations(),
        **lstm_translations(),
        **order_translations(),
        **pointwise_translations(),
        **precise_translations(),
        **sdpa_translations(),
        torch.ops.aten.atan2.default: _atan2,
        torch.ops.aten.one_hot.default: _one_hot,
        torch.ops.aten.bernoulli.default: _bernoulli,
        torch.ops.aten.uniform.default: _uniform,
        torch.ops.aten.baddbmm.default: _baddbmm,
        torch.ops.aten.addbmm.default: _addbmm,
        torch.ops.aten.addmv.default: _addmv,
        torch.ops.aten.addr.default: _addr,
        torch.ops.aten._cdist_forward.default: _cdist,
        torch.ops.aten.linalg_vector_norm.default: _vector_norm,
        torch.ops.aten.scatter_reduce.two: _scatter_reduce,
        torch.ops.aten.logcumsumexp.default: _logcumsumexp,
        torch.ops.aten.kthvalue.default: _kthvalue,
        torch.ops.aten.avg_pool2d.default: _avg_pool(2, aten_avg_pool2d),
        torch.ops.aten.avg_pool3d.default: _avg_pool(3, aten_avg_pool3d),
    }
