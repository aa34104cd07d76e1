"""Weight gradients' activation operands written transposed by the kernel that makes them.

A weight gradient is ``dW = X^T dY`` (``Gemm(X, dY, transA=1)``, X the layer's input
[tokens, in], dY its output gradient [tokens, out]). ONNX Runtime's MLAS runs ``transA``
by transposing 12-column panels of X again for every 128 output columns; from an X
stored transposed ([in, tokens]) the same product is a plain one, 14-25% faster on an
AMD EPYC (GPT-2 small's four weight-gradient shapes at 512 tokens, one-node sessions:
155-172 -> 183-201 GFLOP/s). In the backward, X is mostly made right there by one of
ortrain's kernels: the recomputed LayerNorm (``recompute.py``) before a layer's first
product, the GELU value the GELU backward returns (``gelu_value.py``) before the MLP's
second, the row-scaled head input ``sink_row_scale.py`` leaves on ``ortrain.cpu.Mul``
before the tied head's ``dW^T`` (``transposed_weight_grad.py``). Those kernels can write
their output transposed (``y_transposed``: tiles of 16 rows x 256 columns transposed in
registers) for less than the product saves (GPT-2 small's GELU backward 0.8 -> 1.2 ms, a
LayerNorm 0.15 -> 0.2 ms: the writes land a row of ``X^T`` apart; its c_proj weight
gradient 15.6 -> 13.2 ms), so where that output's only reader is the product (through a
flattening Reshape), the kernel writes ``X^T`` and the product reads it with
``transA=0``.

Not where the token count times 4 bytes is a multiple of 4096 (1024, 2048, 4096 tokens):
MLAS then reads rows of ``X^T`` one page apart, which share a set of the L1 cache, and
the plain product runs 10-20% *slower* than the ``transA`` one (which packs X first).
Products on the BLAS op (``blas_gemm.py``: MKL packs either way) are left alone.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from graph_passes.interface import CPU_DOMAIN

__all__ = ["ALIASING_BYTES", "write_activations_transposed"]

ALIASING_BYTES = 4096  # a row stride that is a multiple of this aliases in L1 (see above)
_STD = ("", "ai.onnx")
_ADAM_ORDERING = 6  # AdamStep(P, G, M, V, H, L, after0, ...)
# ortrain.cpu kernels with y_transposed, and which of their outputs it transposes
_TRANSPOSABLE = {
    "LayerNorm": 0, "GeluGrad": 1, "FastGeluGrad": 1, "Mul": 0, "Add": 0, "Sub": 0
}  # fmt: skip


def write_activations_transposed(model: ir.Model) -> int:
    """Returns the number of products now reading a transposed activation."""
    count = 0
    for node in list(model.graph):
        site = _site(node)
        if site is None:
            continue
        kernel, value, reshape = site
        assert value.shape is not None
        rows = math.prod(value.shape.dims[:-1])
        value.shape = ir.Shape([value.shape.dims[-1], rows])
        kernel.attributes["y_transposed"] = ir.AttrInt64("y_transposed", 1)
        node.replace_input_with(0, value)
        node.attributes["transA"] = ir.AttrInt64("transA", 0)
        if reshape is not None:
            model.graph.remove(reshape, safe=True)
        count += 1
    return count


def _int_attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def _only_reader(value: ir.Value, reader: ir.Node) -> bool:
    """``reader`` is the one node that reads ``value``'s data. An update's ordering inputs
    (``AdamStep``'s after the sixth: "run after this", ``update_in_backward.py``) read
    no data and take any shape."""
    uses = [
        (node, i) for node, i in value.uses()
        if not (node.op_type == "AdamStep" and node.domain == CPU_DOMAIN and i >= _ADAM_ORDERING)
    ]  # fmt: skip
    return not value.is_graph_output() and len(uses) == 1 and uses[0][0] is reader


def _site(node: ir.Node) -> tuple[ir.Node, ir.Value, ir.Node | None] | None:
    """(the kernel, its output to transpose, the Reshape between them or None) where
    ``node`` is a ``transA`` product whose left operand one of the kernels makes."""
    if node.op_type != "Gemm" or node.domain not in _STD or _int_attr(node, "transA", 0) != 1:
        return None
    a = node.inputs[0]
    if a is None or a.dtype != ir.DataType.FLOAT or not _only_reader(a, node):
        return None
    value, reshape = a, None
    producer = a.producer()
    if producer is not None and producer.op_type == "Reshape" and producer.domain in _STD:
        reshape, value = producer, producer.inputs[0]
        if value is None or not _only_reader(value, reshape):
            return None
    kernel = value.producer()
    if kernel is None or kernel.domain != CPU_DOMAIN or kernel.op_type not in _TRANSPOSABLE:
        return None
    if kernel.outputs[_TRANSPOSABLE[kernel.op_type]] is not value:
        return None
    if _int_attr(kernel, "y_transposed", 0):
        return None
    dims = value.shape.dims if value.shape is not None else ()
    a_dims = a.shape.dims if a.shape is not None else ()
    if not dims or not all(isinstance(d, int) for d in (*dims, *a_dims)):
        return None
    rows, cols = math.prod(dims[:-1]), dims[-1]
    if tuple(a_dims) != (rows, cols):  # the Reshape only flattens the leading axes
        return None
    if rows * 4 % ALIASING_BYTES == 0:
        return None
    return kernel, value, reshape
