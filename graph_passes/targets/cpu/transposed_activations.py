"""Kernel outputs written transposed where the products that read them run faster so.

MLAS (ONNX Runtime's CPU products) is slow on two operand layouts:

- ``transA``: a Conv1D weight's gradient ``dW = X^T dY`` (``Gemm(X, dY, transA=1)``, X
  the layer's input [tokens, in]) transposes 12-column panels of X again for every 128
  output columns; from X stored as ``X^T`` the same product is a plain one, and faster.
- a plain A whose rows are a multiple of the L1 way size apart
  (``CpuCostModel.aliasing_stride``, from the machine's L1 size and associativity; GPT-2's
  MLP width 3072 floats on a 4 KiB way): the 12 rows the kernel reads at once share one
  set of the L1 cache and evict each other. The forward's ``G W_proj`` and the backward's
  ``dH W_fc^T`` are such products; from a ``G^T`` read with ``transA`` MLAS packs it
  without the conflict.

Where such an operand is made by one of ortrain's kernels (the recomputed LayerNorm
before a layer's first product, the GELU of the forward, the GELU backward's dX and the
GELU value it returns (``gelu_value.py``), the row-scaled head input ``sink_row_scale.py``
leaves on ``ortrain.cpu.Mul`` before the tied head's ``dW^T``), the kernel writes it
transposed (``out_transposed``, a bit per output: tiles of 16 rows x 256 columns
transposed in registers, values bit for bit the plain ones) and every product that reads
it flips that operand's trans flag. Only where every reader is a product's A or B
(directly or through the Reshape to the 2-D view), some A gains and none loses (a plain
A with unaliased rows would become ``transA``); a B only changes where MLAS packs it
from (neutral alone). The kernels pay a little for the strided writes.

Not where the transposed output's rows (the token count times 4 bytes apart) would
themselves be a multiple of the aliasing stride: then ``dW = (X^T) dY`` runs slower than
the ``transA`` one. Products on the BLAS op (``blas_gemm.py``: MKL packs either way) are
left alone. Inputs of a node past its ``ORDERING_INPUTS_FROM`` tag (an update's "run after
this" inputs, ``update_in_backward.py``) read no data and take any shape.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.infra.tags import ORDERING_INPUTS_FROM
from ortrain.graph_passes.targets.cpu.cost_model import CpuCostModel, cost_or_default

__all__ = ["write_activations_transposed"]

_STD = ("", "ai.onnx")
_F32_BYTES = 4
# ortrain.cpu kernels with out_transposed, and which of their outputs it may mark
_TRANSPOSABLE = {
    "LayerNorm": (0,), "Gelu": (0,), "FastGelu": (0,), "GeluGrad": (0, 1),
    "FastGeluGrad": (0, 1), "Mul": (0,), "Add": (0,), "Sub": (0,),
}  # fmt: skip
_FLAG = ("transA", "transB")


def write_activations_transposed(model: ir.Model, cost: CpuCostModel | None = None) -> int:
    """Returns the number of kernel outputs now written transposed (``cost`` None: this
    machine's model)."""
    stride = cost_or_default(cost).aliasing_stride
    count = 0
    for kernel in list(model.graph):
        if kernel.domain != CPU_DOMAIN or kernel.op_type not in _TRANSPOSABLE:
            continue
        for index in _TRANSPOSABLE[kernel.op_type]:
            marked = kernel.attributes.get_int("out_transposed", 0)
            if index >= len(kernel.outputs) or marked >> index & 1:
                continue
            value = kernel.outputs[index]
            readers = _product_readers(value)
            if readers is None or not _pays(value, readers, stride):
                continue
            assert value.shape is not None
            rows = math.prod(value.shape.dims[:-1])
            value.shape = ir.Shape([value.shape.dims[-1], rows])
            bits = marked | 1 << index
            kernel.attributes["out_transposed"] = ir.AttrInt64("out_transposed", bits)
            reshapes = set()
            for gemm, i, reshape in readers:
                gemm.replace_input_with(i, value)
                flag = _FLAG[i]
                gemm.attributes[flag] = ir.AttrInt64(flag, 1 - gemm.attributes.get_int(flag, 0))
                if reshape is not None:
                    reshapes.add(reshape)
            for reshape in reshapes:
                model.graph.remove(reshape, safe=True)
            count += 1
    return count


def _data_uses(value: ir.Value) -> list[tuple[ir.Node, int]]:
    """The nodes that read ``value``'s data: not as an ordering input (past the reader's
    ``ORDERING_INPUTS_FROM``), which reads none and takes any shape."""
    return [(node, i) for node, i in value.uses() if i < _ordering_from(node)]


def _ordering_from(node: ir.Node) -> int:
    """The first of ``node``'s inputs that only orders it (past the last: none)."""
    tag = node.metadata_props.get(ORDERING_INPUTS_FROM)
    return int(tag) if tag is not None and tag.isdigit() else len(node.inputs)


def _static(value: ir.Value) -> tuple[int, ...] | None:
    dims = value.shape.dims if value.shape is not None else ()
    if not dims or not all(isinstance(d, int) for d in dims):
        return None
    return tuple(int(d) for d in dims)


def _is_product_operand(node: ir.Node, i: int) -> bool:
    return node.op_type == "Gemm" and node.domain in _STD and i in (0, 1)


def _product_readers(
    value: ir.Value,
) -> list[tuple[ir.Node, int, ir.Node | None]] | None:
    """(Gemm, input index, the flattening Reshape between or None) for every reader of
    ``value``, where each is a product's A or B (directly, ``value`` 2-D, or through a
    Reshape to its 2-D view that only products read); else None."""
    dims = _static(value)
    if value.is_graph_output() or value.dtype != ir.DataType.FLOAT or dims is None:
        return None
    view = (math.prod(dims[:-1]), dims[-1])
    readers: list[tuple[ir.Node, int, ir.Node | None]] = []
    for node, i in _data_uses(value):
        if _is_product_operand(node, i) and len(dims) == 2:
            readers.append((node, i, None))
            continue
        if node.op_type != "Reshape" or node.domain not in _STD or i != 0:
            return None
        out = node.outputs[0]
        if out.is_graph_output() or _static(out) != view:
            return None
        for reader, j in out.uses():
            if not _is_product_operand(reader, j):
                return None
            readers.append((reader, j, node))
    return readers or None


def _pays(value: ir.Value, readers: list[tuple[ir.Node, int, ir.Node | None]], stride: int) -> bool:
    """Some product gains and none loses: an A read with transA becomes plain, or an A
    read plainly from rows a multiple of ``stride`` apart (aliased) becomes transA; a B
    only changes where MLAS packs it from. Never where the transposed rows would alias."""
    dims = _static(value)
    assert dims is not None
    rows, cols = math.prod(dims[:-1]), dims[-1]
    if rows * _F32_BYTES % stride == 0:
        return False
    gains = False
    for gemm, i, _ in readers:
        if i != 0:
            continue
        if gemm.attributes.get_int("transA", 0) or cols * _F32_BYTES % stride == 0:
            gains = True
        else:
            return False
    return gains
