"""Masked fp32 ``Softmax`` (with the mask's ``Add``) -> ``ortrain.cpu.Softmax``.

ONNX Runtime's CPU Softmax runs 5x slower on rows that hold masked logits (the
``finfo.min`` an attention mask adds, anything below ~-88): gpt2-tiny's four causal
attention Softmaxes took 0.9 ms each, 0.15 ms on unmasked rows.
``ortrain.cpu.Softmax(X, bias)`` (``ortrain/runtime/softmax.c``) runs masked rows as fast
as any, and takes the mask's ``Add`` in the same pass: ``Softmax(Add(scores, mask))`` ->
``Softmax(scores, mask)``, one full-size temporary and one pass fewer. On dense rows
ONNX Runtime's own is 10-30% faster (its exp is hand-written assembly), so a Softmax moves
where its input is masked: made by an ``Add`` (an additive mask) or a ``Where`` (a
masked fill). A loss head's Softmax over a vocabulary (rows of >= 4096) moves too: alone
both run at the memory's rate (GPT-2's [512, 50257]: 11.0-11.3 ms, ONNX Runtime's
11.3-11.6), but in the gradient graph ortrain's runs on the BLAS products' threads
(``kernel_util.h``: for_blocks) and ONNX Runtime's beside them: 7.7 ms against 10-11.8.

A kernel choice like ``scatter_rows.py``: made last (after autodiff, whose Softmax rule
reads the standard op), on CPU builds with ortrain's kernel library. Rewritten: float32
Softmax whose axis is the last one (any opset: for the last axis opset 11's flattening
changes nothing). The ``Add`` is taken in when the Softmax is its only reader and one
operand has the sum's (static) shape and the other broadcasts to it with the same last
dimension.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN

_STD = ("", "ai.onnx")
_F32 = ir.DataType.FLOAT
_MASKING = ("Add", "Where")  # producers whose output likely holds masked logits
LONG_ROW = 4096  # a row this long is a loss head's vocabulary


def lower_softmax(model: ir.Model) -> int:
    """Returns the number of Softmax nodes rewritten."""
    graph = model.graph
    opset = model.opset_imports.get("", 13)
    outputs = set(graph.outputs)
    count = 0
    for node in list(graph):
        if not _eligible(node, opset):
            continue
        x = node.inputs[0]
        assert x is not None
        add = _mask_add(x, outputs)
        node.op_type, node.domain, node.version = "Softmax", CPU_DOMAIN, None
        node.attributes.clear()
        if add is not None:
            scores, mask = add
            producer = x.producer()
            node.replace_input_with(0, scores)
            node.resize_inputs(2)
            node.replace_input_with(1, mask)
            if producer is not None and not x.uses():
                graph.remove(producer, safe=True)
        count += 1
    if count:
        model.opset_imports[CPU_DOMAIN] = 1
    return count


def _eligible(node: ir.Node, opset: int) -> bool:
    if node.op_type != "Softmax" or node.domain not in _STD or len(node.inputs) != 1:
        return False
    x, y = node.inputs[0], node.outputs[0]
    if x is None or x.dtype != _F32 or y.dtype != _F32 or x.shape is None:
        return False
    rank = len(x.shape)
    attr = node.attributes.get("axis")
    axis = attr.value if attr is not None else (-1 if opset >= 13 else 1)
    if rank < 1 or axis % rank != rank - 1:
        return False
    producer = x.producer()
    if producer is not None and producer.op_type in _MASKING and producer.domain in _STD:
        return True
    width = x.shape[-1]
    return isinstance(width, int) and width >= LONG_ROW


def _mask_add(x: ir.Value, outputs: set[ir.Value]) -> tuple[ir.Value, ir.Value] | None:
    """(scores, mask) of the Add that makes ``x``, when it can be taken in, else None."""
    add = x.producer()
    if add is None or add.op_type != "Add" or add.domain not in _STD or len(add.inputs) != 2:
        return None
    if len(x.uses()) != 1 or x in outputs:
        return None
    shape = _static(x)
    if shape is None or not shape:
        return None
    for scores, mask in (add.inputs, add.inputs[::-1]):
        if scores is None or mask is None or scores.dtype != _F32 or mask.dtype != _F32:
            continue
        s, m = _static(scores), _static(mask)
        if s != shape or m is None or not m or len(m) > len(shape) or m[-1] != shape[-1]:
            continue
        if all(b in (1, d) for b, d in zip(m[::-1], shape[::-1], strict=False)):
            return scores, mask
    return None


def _static(v: ir.Value) -> tuple[int, ...] | None:
    if v.shape is None or not v.shape.is_static():
        return None
    return tuple(int(d) for d in v.shape)
