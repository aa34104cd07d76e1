"""The constant tensor behind a value: an initializer or a ``Constant`` node's output."""

from __future__ import annotations

import onnx_ir as ir


def constant_tensor(v: ir.Value | None) -> ir.TensorProtocol | None:
    if v is None:
        return None
    if v.const_value is not None:
        return v.const_value
    node = v.producer()
    if node is not None and node.op_type == "Constant":
        attr = node.attributes.get("value")
        return attr.value if attr is not None else None
    return None
