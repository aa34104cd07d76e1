"""A small node emitter over an ``onnx_ir`` graph, shared by the graph builders.

It names every value it creates under one prefix (so a dumped graph reads as
``grad/...`` or ``update/...``), caches scalar constants, and records dtype/shape on
new values when they are known, which later rules rely on.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

MS_DOMAIN = "com.microsoft"


_BOOL_OPS = frozenset(
    {
        "Equal",
        "Greater",
        "GreaterOrEqual",
        "Less",
        "LessOrEqual",
        "And",
        "Or",
        "Not",
        "Xor",
        "IsNaN",
        "IsInf",
    }
)


def _infer_dtype(
    op_type: str, inputs: Sequence[ir.Value | None], attrs: dict[str, object]
) -> ir.DataType | None:
    """Output dtype for the ops the builders emit (shape inference is not run on the fly)."""
    if op_type in _BOOL_OPS:
        return ir.DataType.BOOL
    if op_type in ("Shape", "Size"):
        return ir.DataType.INT64
    if op_type == "Cast":
        return ir.DataType(int(attrs["to"]))  # type: ignore[arg-type]
    if op_type == "Where":
        inputs = inputs[1:]
    src = next((i for i in inputs if i is not None and i.dtype is not None), None)
    return src.dtype if src is not None else None


class Emitter:
    def __init__(self, graph: ir.Graph, prefix: str, metadata: dict[str, str] | None = None):
        self.graph = graph
        self.prefix = prefix
        self.nodes: list[ir.Node] = []
        self.metadata = metadata or {}
        self._counter = itertools.count()
        self._consts: dict[tuple, ir.Value] = {}

    def fresh(self, hint: str) -> str:
        return f"{self.prefix}/{hint}_{next(self._counter)}"

    def op(
        self,
        op_type: str,
        *inputs: ir.Value | None,
        domain: str = "",
        num_outputs: int = 1,
        dtype: ir.DataType | None = None,
        shape: Sequence[int] | None = None,
        name_hint: str | None = None,
        **attrs: object,
    ) -> ir.Value:
        outs = self.op_multi(
            op_type,
            *inputs,
            domain=domain,
            num_outputs=num_outputs,
            name_hint=name_hint,
            **attrs,
        )
        out = outs[0]
        out.dtype = dtype if dtype is not None else _infer_dtype(op_type, inputs, attrs)
        if shape is not None:
            out.shape = ir.Shape(list(shape))
        return out

    def op_multi(
        self,
        op_type: str,
        *inputs: ir.Value | None,
        domain: str = "",
        num_outputs: int = 1,
        name_hint: str | None = None,
        **attrs: object,
    ) -> Sequence[ir.Value]:
        attributes = {k: v for k, v in attrs.items() if v is not None}
        hint = name_hint or op_type
        outputs = [ir.Value(name=self.fresh(hint)) for _ in range(num_outputs)]
        node = ir.Node(
            domain,
            op_type,
            list(inputs),
            attributes=ir.convenience.convert_attributes(attributes),
            outputs=outputs,
            name=self.fresh(f"node_{op_type}"),
            metadata_props=dict(self.metadata),
        )
        if domain and domain not in self.graph.opset_imports:
            self.graph.opset_imports[domain] = 1
        self.nodes.append(node)
        return node.outputs

    def const(self, value: float | int | Sequence, dtype: ir.DataType) -> ir.Value:
        """A cached constant initializer, e.g. ``const(0.5, FLOAT)``, ``const([0, 1], INT64)``."""
        arr = np.asarray(value, dtype=dtype.numpy())
        key = (dtype, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self.fresh("const")
            v = ir.Value(
                name=name,
                shape=ir.Shape(list(arr.shape)),
                type=ir.TensorType(dtype),
                const_value=ir.tensor(arr, name=name),
            )
            self.graph.register_initializer(v)
            self._consts[key] = v
        return self._consts[key]

    def ints(self, values: Sequence[int]) -> ir.Value:
        return self.const(list(values), ir.DataType.INT64)

    def flush_before(self, anchor: ir.Node | None = None) -> None:
        """Insert the emitted nodes into the graph (at the end, or before ``anchor``)."""
        if anchor is None:
            self.graph.extend(self.nodes)
        else:
            self.graph.insert_before(anchor, self.nodes)
        self.nodes = []


def static_shape(value: ir.Value) -> tuple[int, ...]:
    shape = value.shape
    if shape is None or not all(isinstance(d, int) for d in shape.dims):
        raise ValueError(
            f"value {value.name!r} has no static shape ({shape}); ortrain compiles one graph "
            "per batch shape signature"
        )
    return tuple(int(d) for d in shape.dims)
