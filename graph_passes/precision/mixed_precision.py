"""Mixed precision as a graph rewrite of the forward graph (before autodiff).

The persistent parameters stay fp32 (master weights): the graph computes in fp16 or
bf16 from half copies it makes itself, so autodiff's Cast rule returns fp32 gradients
for the parameters, and the optimizer (its own graph) never sees half precision.

Cases, in graph order:

1. Ops in ``LOW_OPS`` compute in the low type. A float32 input becomes its low copy:
   one Cast per value, shared by every reader (a parameter read by the embedding lookup
   and the tied LM head is cast once); a float32 constant initializer is converted
   instead (clamped to the low type's finite range, so ``finfo(float32).min`` masks
   stay finite in fp16). Their float32 outputs become low.
2. ``LayerNormalization`` is a low op with ``stash_type=1``: its statistics (mean,
   inverse standard deviation, the outputs the backward reads) are computed and kept
   in fp32; scale and bias are read as low copies.
3. Ops in ``FP32_OPS`` compute in fp32: the loss subgraph, Softmax/LogSoftmax (inputs
   and their reductions), reductions of large sums, index lookups (their gradients
   scatter-add rows: embedding gradients accumulate in fp32), and exp/log/pow/sqrt
   whose results overflow fp16. A low input is cast up; when it is itself a low copy of a float32
   value, the float32 original is read instead (no lossy round trip).
4. Any other op (not listed: unknown to this pass, control flow) runs in fp32 as well,
   the safe default.
5. ``Cast(to=float32)`` from a non-float value (masks, ids) casts straight to the low
   type instead of producing float32 that the next op would cast again.
6. Inputs typed apart from the data (Dropout's ratio, CastLike's target) keep their type;
   ``Shape``/``Size`` read whatever they get.
7. A graph output that became low is cast back to float32 under its own name, so the
   loss and any returned logits are float32 for the caller.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ortrain.graph_passes.infra.emitter import MS_DOMAIN, Emitter

F32 = ir.DataType.FLOAT
LOW_TYPES = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}

LOW_OPS = frozenset(
    {
        # matrix products: the bulk of the FLOPs
        "MatMul",
        "Gemm",
        "FusedMatMul",
        # element-wise arithmetic and activations
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Neg",
        "Sum",
        "Max",
        "Min",
        "Abs",
        "Relu",
        "Tanh",
        "Sigmoid",
        "Erf",
        "Gelu",
        "FastGelu",
        "BiasGelu",
        "QuickGelu",
        "Where",
        "Dropout",
        "Clip",
        # normalisation with fp32 statistics (case 2)
        "LayerNormalization",
        "SkipLayerNormalization",
        # data movement: no arithmetic, half the bytes
        "Identity",
        "Reshape",
        "Transpose",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Expand",
        "Concat",
        "Split",
        "Slice",
        "Tile",
        "Pad",
        "Trilu",
        "CastLike",
        # comparisons read low values (their bool outputs are unchanged)
        "Equal",
        "Less",
        "LessOrEqual",
        "Greater",
        "GreaterOrEqual",
    }
)

FP32_OPS = frozenset(
    {
        # the loss subgraph
        "SoftmaxCrossEntropyLoss",
        "NegativeLogLikelihoodLoss",
        # Softmax inputs and their reductions
        "Softmax",
        "LogSoftmax",
        # reductions of large sums
        "ReduceSum",
        "ReduceMean",
        "ReduceSumSquare",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceProd",
        "CumSum",
        # index lookups: their gradients scatter-add many rows into one (a reduction the
        # CPU EP has no fp16 kernel for); the lookup reads the fp32 table directly
        "Gather",
        "GatherND",
        "GatherElements",
        "ScatterND",
        "ScatterElements",
        # results that overflow or lose all precision in fp16
        "Exp",
        "Log",
        "Pow",
        "Sqrt",
        "Reciprocal",
    }
)

# Inputs whose type the op defines apart from its data type.
KEEP_INPUT_TYPE = {"Dropout": {1, 2}, "CastLike": {0}}
# Ops that read any type and compute nothing on values.
TYPE_AGNOSTIC = frozenset({"Shape", "Size"})
_MS_OPS = frozenset({"FusedMatMul", "FastGelu", "BiasGelu", "QuickGelu", "SkipLayerNormalization"})


def _op_key(node: ir.Node) -> str | None:
    """The op's name in the lists above, or None for ops of other domains."""
    if node.domain in ("", "ai.onnx"):
        return node.op_type if node.op_type not in _MS_OPS else None
    if node.domain == MS_DOMAIN and node.op_type in _MS_OPS:
        return node.op_type
    return None


def _low_constant(value: ir.Value, low: ir.DataType, graph: ir.Graph) -> ir.Value:
    arr = np.asarray(value.const_value.numpy(), dtype=np.float32)
    info = np.finfo(np.float16) if low == ir.DataType.FLOAT16 else None
    if info is not None:
        arr = np.clip(arr, info.min, info.max)
    name = f"{value.name}__{low.name.lower()}"
    tensor = ir.tensor(arr.astype(low.numpy()), name=name)
    v = ir.Value(name=name, shape=value.shape, type=ir.TensorType(low), const_value=tensor)
    graph.register_initializer(v)
    return v


class _Converter:
    def __init__(self, model: ir.Model, low: ir.DataType):
        self.graph = model.graph
        self.low = low
        self.em = Emitter(self.graph, "mixed_precision")
        self.down: dict[int, ir.Value] = {}  # id(float32 value) -> its low copy
        self.up: dict[int, ir.Value] = {}  # id(low value) -> its float32 version
        self.origin: dict[int, ir.Value] = {}  # id(low copy) -> the float32 value it copies
        self.converted = 0

    def to_low(self, v: ir.Value, before: ir.Node) -> ir.Value:
        if id(v) in self.down:
            return self.down[id(v)]
        if v.const_value is not None and not v.is_graph_input():
            out = _low_constant(v, self.low, self.graph)
        else:
            out = self.em.op("Cast", v, to=self.low.value, dtype=self.low, name_hint="to_low")
            out.shape = v.shape
            self.em.flush_before(before)
        self.down[id(v)] = out
        self.origin[id(out)] = v
        return out

    def to_fp32(self, v: ir.Value, before: ir.Node) -> ir.Value:
        if id(v) in self.origin:  # a low copy: read the float32 original
            return self.origin[id(v)]
        if id(v) not in self.up:
            out = self.em.op("Cast", v, to=F32.value, dtype=F32, name_hint="to_fp32")
            out.shape = v.shape
            self.em.flush_before(before)
            self.up[id(v)] = out
        return self.up[id(v)]

    def visit(self, node: ir.Node) -> None:
        key = _op_key(node)
        if key in TYPE_AGNOSTIC:
            return
        if key == "Cast":
            to = ir.DataType(node.attributes["to"].value)
            src = node.inputs[0]
            if to == F32 and src is not None and not src.dtype.is_floating_point():
                node.attributes["to"] = ir.AttrInt64("to", self.low.value)
                node.outputs[0].dtype = self.low
                self.converted += 1
            return
        if key in LOW_OPS:
            keep = KEEP_INPUT_TYPE.get(key, set())
            for i, v in enumerate(node.inputs):
                if v is not None and i not in keep and v.dtype == F32:
                    node.replace_input_with(i, self.to_low(v, node))
            outputs = node.outputs[:1] if key == "LayerNormalization" else node.outputs
            for o in outputs:
                if o.dtype == F32:
                    o.dtype = self.low
            if key == "LayerNormalization":
                node.attributes["stash_type"] = ir.AttrInt64("stash_type", F32.value)
            self.converted += 1
            return
        # FP32_OPS and every op this pass does not know: float32 inputs.
        for i, v in enumerate(node.inputs):
            if v is not None and v.dtype == self.low:
                node.replace_input_with(i, self.to_fp32(v, node))

    def restore_outputs(self) -> None:
        for i, v in enumerate(self.graph.outputs):
            if v.dtype != self.low:
                continue
            name = v.name
            v.name = f"{name}__{self.low.name.lower()}"
            out = self.em.op("Cast", v, to=F32.value, dtype=F32, name_hint="output_fp32")
            out.shape = v.shape
            out.name = name
            self.graph.outputs[i] = out
        self.em.flush_before(None)


def convert_to_mixed_precision(model: ir.Model, precision: str) -> int:
    """Rewrite ``model`` to compute in ``precision`` ("fp16" or "bf16").

    Returns the number of nodes that now compute in the low type.
    """
    if precision not in LOW_TYPES:
        raise ValueError(f"mixed precision {precision!r}: use 'fp16' or 'bf16'")
    conv = _Converter(model, LOW_TYPES[precision])
    for node in list(model.graph):
        conv.visit(node)
    conv.restore_outputs()
    return conv.converted


def cast_count(model: ir.Model) -> int:
    return sum(1 for n in model.graph if n.op_type == "Cast")
