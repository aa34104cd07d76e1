"""What a gradient rule sees: ORT's vocabulary I(i), O(i), GO(i), plus an emitter."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.infra.constant_value import constant_tensor
from ortrain.graph_passes.infra.emitter import Emitter, static_shape


class GradContext:
    """The view of one forward node that its gradient rule works with.

    ``I(i)``/``O(i)`` are forward values, ``GO(i)`` the gradient flowing into output
    ``i`` (None when nothing flows there), ``needs(i)`` whether ``GI(i)`` is wanted.
    """

    def __init__(
        self,
        node: ir.Node,
        emitter: Emitter,
        output_grads: Sequence[ir.Value | None],
        needed: frozenset[int],
        *,
        cpu_kernels: bool = False,
    ):
        self.node = node
        self.em = emitter
        self._go = list(output_grads)
        self.needed = needed
        self.cpu_kernels = cpu_kernels

    def kernel_for(self, *values: ir.Value) -> bool:
        """Whether to emit an ``ortrain.cpu`` fused backward kernel over ``values``: the
        build has the library (a CPU session) and they are all fp32 (its only type)."""
        return self.cpu_kernels and all(v.dtype == ir.DataType.FLOAT for v in values)

    def kernel(self, op_type: str, *inputs: ir.Value, like: ir.Value) -> ir.Value:
        """One fused kernel node whose (first) output has ``like``'s dtype and shape."""
        return self.op(
            op_type, *inputs, domain=CPU_DOMAIN, dtype=like.dtype, shape=self.shape(like)
        )

    # --- forward values and gradients -------------------------------------------------
    def I(self, i: int) -> ir.Value:
        v = self.node.inputs[i] if i < len(self.node.inputs) else None
        if v is None:
            raise IndexError(f"{self.node.op_type} node {self.node.name!r} has no input {i}")
        return v

    def has_input(self, i: int) -> bool:
        return i < len(self.node.inputs) and self.node.inputs[i] is not None

    def O(self, i: int) -> ir.Value:
        return self.node.outputs[i]

    def GO(self, i: int) -> ir.Value | None:
        return self._go[i] if i < len(self._go) else None

    def GO_or_zeros(self, i: int) -> ir.Value:
        g = self.GO(i)
        if g is not None:
            return g
        out = self.O(i)
        return self.zeros(static_shape(out), out.dtype)

    def needs(self, i: int) -> bool:
        return i in self.needed

    def attr(self, name: str, default: object = None) -> object:
        a = self.node.attributes.get(name)
        return default if a is None else a.value

    # --- emitting ------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: ir.Value | None, **kw: object) -> ir.Value:
        return self.em.op(op_type, *inputs, **kw)

    def op_multi(self, op_type: str, *inputs: ir.Value | None, **kw: object):
        return self.em.op_multi(op_type, *inputs, **kw)

    def const(self, value: float | int | Sequence, dtype: ir.DataType) -> ir.Value:
        return self.em.const(value, dtype)

    def scalar_like(self, value: float, like: ir.Value) -> ir.Value:
        return self.em.const(value, like.dtype or ir.DataType.FLOAT)

    def ints(self, values: Sequence[int]) -> ir.Value:
        return self.em.ints(values)

    def zeros(self, shape: Sequence[int], dtype: ir.DataType) -> ir.Value:
        return self.op("Expand", self.const(0, dtype), self.ints(shape), dtype=dtype, shape=shape)

    # --- static shape helpers -------------------------------------------------------
    @staticmethod
    def shape(v: ir.Value) -> tuple[int, ...]:
        return static_shape(v)

    @staticmethod
    def rank(v: ir.Value) -> int:
        return len(static_shape(v))

    @staticmethod
    def const_ints(v: ir.Value | None) -> list[int] | None:
        """The value of a constant integer input (initializer or Constant node), else None."""
        t = constant_tensor(v)
        if t is None:
            return None
        return [int(x) for x in np.asarray(t.numpy()).reshape(-1)]

    def reshape(self, v: ir.Value, shape: Sequence[int]) -> ir.Value:
        if self.shape(v) == tuple(shape):
            return v
        return self.op("Reshape", v, self.ints(shape), shape=shape)

    def sum_to(self, grad: ir.Value, grad_shape: Sequence[int], target: Sequence[int]) -> ir.Value:
        """Reduce a broadcast gradient back to ``target`` (numpy broadcasting rules)."""
        grad_shape, target = tuple(grad_shape), tuple(target)
        if grad_shape == target:
            return grad
        lead = len(grad_shape) - len(target)
        axes = list(range(lead))
        for i, d in enumerate(target):
            if d == 1 and grad_shape[lead + i] != 1:
                axes.append(lead + i)
        out = grad
        rows = 1
        for d in grad_shape[:lead]:
            rows *= d
        cols = 1
        for d in grad_shape[lead:]:
            cols *= d
        if axes == list(range(lead)) and rows > 1 and grad.dtype == ir.DataType.FLOAT:
            # Summing over all leading axes (bias gradients): ones[1, R] @ g[R, C] runs on
            # the GEMM kernel, which ran faster than ReduceSum over axis 0 on the CPU EP.
            g2 = grad
            if grad_shape != (rows, cols):
                g2 = self.op("Reshape", grad, self.ints((rows, cols)), shape=(rows, cols))
            ones = self.const(np.ones((1, rows), dtype=np.float32).tolist(), ir.DataType.FLOAT)
            out = self.op("Gemm", ones, g2, shape=(1, cols))
        elif axes:
            kept = [d for i, d in enumerate(grad_shape) if i not in axes]
            out = self.op("ReduceSum", grad, self.ints(axes), keepdims=0, shape=kept)
        return self.reshape(out, target)

    def unbroadcast(
        self, grad: ir.Value, like: ir.Value, from_shape: Sequence[int] | None = None
    ) -> ir.Value:
        """``grad`` has the shape of output 0 (or ``from_shape``); reduce it to ``like``'s."""
        src = self.shape(self.O(0)) if from_shape is None else tuple(from_shape)
        return self.sum_to(grad, src, self.shape(like))

    def cast_like(self, v: ir.Value, like: ir.Value) -> ir.Value:
        if v.dtype == like.dtype:
            return v
        return self.op("Cast", v, to=like.dtype.value, dtype=like.dtype)
