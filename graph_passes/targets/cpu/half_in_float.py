"""bfloat16 nodes ONNX Runtime's CPU provider has no kernel for, computed in float32.

torch's CPU kernels compute bfloat16 math in float32 and round the result once. ONNX
Runtime's CPU provider has bfloat16 kernels for a few ops only (casts, copies, gathers,
LayerNorm) and refuses a whole session that holds any other bfloat16 node
(NOT_IMPLEMENTED): its own fallback (the session's cast insertion) covers float16 only.
So a model that computes one small part in bfloat16 on purpose (Falcon's ALiBi slopes)
could not run as a graph on CPU. Each such node gets its bfloat16 inputs cast to float32
and its bfloat16 outputs cast back: for element-wise ops the very values torch computes
(the float32 result rounded once), for products and reductions a float32 accumulation, as
torch's CPU kernels accumulate. float16 nodes are left to ONNX Runtime's cast insertion,
as before (it keeps whole float16 regions in float32; mixed precision's fp16 on CPU is
measured with that).

Which nodes: those whose op, at the model's opset, ONNX Runtime's own CPU kernel registry
(``get_all_opkernel_def``) lists without their bfloat16 types but with float32 in their
place; a node's inputs and outputs are matched to the kernel's type parameters through
the op's ONNX schema. That registry call makes every execution provider the build has:
in onnxruntime-gpu it starts CUDA (an error in a forked build process) and crashes the
process when the TensorRT provider cannot load (no libnvinfer). Those builds ask a
one-node session on the CPU provider instead, once per op and types. Graphs without a
bfloat16 value ask neither. A kernel choice, so made late, on CPU builds (training and
evaluation graphs, not ``mixed_precision="bf16"``'s, which are CUDA's) after autodiff,
whose gradient nodes share their forward's types.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import onnx_ir as ir

HALF = (ir.DataType.BFLOAT16,)  # float16: ONNX Runtime's own cast insertion
_TYPE_NAME = {
    ir.DataType.FLOAT: "tensor(float)",
    ir.DataType.BFLOAT16: "tensor(bfloat16)",
    ir.DataType.FLOAT16: "tensor(float16)",
}

Kernel = tuple[int, int, dict[str, frozenset[str]]]


@functools.cache
def cpu_kernels() -> dict[tuple[str, str], list[Kernel]]:
    """(domain, op) -> (first opset, last opset, type parameter -> types) of each of ONNX
    Runtime's CPU kernels."""
    from onnxruntime.capi import _pybind_state

    out: dict[tuple[str, str], list[Kernel]] = {}
    for k in _pybind_state.get_all_opkernel_def():
        if k.provider != "CPUExecutionProvider":
            continue
        lo, hi = k.version_range
        types = {name: frozenset(ts) for name, ts in k.type_constraints.items()}
        out.setdefault((k.domain or "", k.op_name), []).append((lo, hi, types))
    return out


def _type_params(node: ir.Node, opset: int) -> list[tuple[str, ir.Value]] | None:
    """(type parameter, value) of each typed input and output of ``node``, by its schema."""
    import onnx.defs

    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain or "")
    except onnx.defs.SchemaError:
        return None
    pairs: list[tuple[str, ir.Value]] = []
    for formals, values in ((schema.inputs, node.inputs), (schema.outputs, node.outputs)):
        for i, v in enumerate(values):
            if v is None or not formals:
                continue
            formal = formals[min(i, len(formals) - 1)]
            if i >= len(formals) and formal.option != formal.option.Variadic:
                return None
            pairs.append((formal.type_str, v))
    return pairs


def _has_kernel(kernels: Sequence[Kernel], opset: int, types: dict[str, str]) -> bool:
    for lo, hi, allowed in kernels:
        if lo <= opset <= hi and all(t in allowed.get(p, (t,)) for p, t in types.items()):
            return True
    return False


# providers whose presence leaves ``get_all_opkernel_def`` safe to call in this process
_REGISTRY_SAFE = frozenset({"CPUExecutionProvider", "AzureExecutionProvider"})


@functools.cache
def registry_is_safe() -> bool:
    """Whether this onnxruntime build makes no provider but the CPU's (and Azure's, which
    has no kernels) when its kernel registry is listed (the module docstring)."""
    import onnxruntime

    return set(onnxruntime.get_available_providers()) <= _REGISTRY_SAFE


def _session_accepts(node: ir.Node, opset: int, dtypes: Sequence[ir.DataType | None]) -> bool:
    """Whether ONNX Runtime's CPU provider makes a session of ``node`` alone with its
    inputs and outputs at ``dtypes`` (in that order; None: an absent optional input)."""
    import onnxruntime as ort

    inputs: list[ir.Value | None] = []
    for i, (v, dt) in enumerate(zip(node.inputs, dtypes, strict=False)):
        inputs.append(None if v is None else ir.Value(name=f"in{i}", type=ir.TensorType(dt)))
    probe = ir.Node(
        node.domain,
        node.op_type,
        inputs,
        [a for a in node.attributes.values() if a.type is not ir.AttributeType.GRAPH],
        num_outputs=len(node.outputs),
    )
    for i, (out, dt) in enumerate(zip(probe.outputs, dtypes[len(node.inputs) :], strict=True)):
        out.name, out.type = f"out{i}", ir.TensorType(dt)
    imports = {"": opset} if not node.domain else {"": 17, node.domain: opset}
    graph = ir.Graph(
        [v for v in inputs if v is not None], list(probe.outputs), nodes=[probe],
        opset_imports=imports,
    )  # fmt: skip
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    data = ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString()
    try:
        ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    except Exception:  # ONNX Runtime raises its own classes; any refusal counts
        return False
    return True


# (domain, op, opset, dtypes) -> whether the CPU provider made the one-node session
_ACCEPTED: dict[tuple, bool] = {}


def _probe(node: ir.Node, opset: int, dtypes: tuple[ir.DataType | None, ...]) -> bool:
    key = (node.domain or "", node.op_type, opset, dtypes)
    if key not in _ACCEPTED:
        _ACCEPTED[key] = _session_accepts(node, opset, dtypes)
    return _ACCEPTED[key]


def _half_types(node: ir.Node) -> bool:
    return any(v is not None and v.dtype in HALF for v in (*node.inputs, *node.outputs))


def _needs_float(node: ir.Node, opsets: dict[str, int]) -> bool:
    """Whether ONNX Runtime's CPU provider has no kernel for ``node`` at its 16-bit types
    and one with float32 in their place."""
    if not _half_types(node):
        return False
    opset = opsets.get(node.domain or "", opsets.get("ai.onnx"))
    if opset is None:
        return False
    if not registry_is_safe():
        if any(a.type is ir.AttributeType.GRAPH for a in node.attributes.values()):
            return False  # a control-flow body: not asked for alone
        values = (*node.inputs, *node.outputs)
        if any(v is not None and v.dtype is None for v in values):
            return False
        dtypes = tuple(None if v is None else v.dtype for v in values)
        if _probe(node, opset, dtypes):
            return False
        as_float = tuple(ir.DataType.FLOAT if d in HALF else d for d in dtypes)
        return _probe(node, opset, as_float)
    kernels = cpu_kernels().get((node.domain or "", node.op_type))
    if not kernels:
        return False
    params = _type_params(node, opset)
    if params is None:
        return False
    types: dict[str, str] = {}
    for param, v in params:
        if v.dtype in _TYPE_NAME:
            types.setdefault(param, _TYPE_NAME[v.dtype])
    if not any(_TYPE_NAME[h] in types.values() for h in HALF):
        return False
    if _has_kernel(kernels, opset, types):
        return False
    half = {_TYPE_NAME[h] for h in HALF}
    as_float = {p: (_TYPE_NAME[ir.DataType.FLOAT] if t in half else t) for p, t in types.items()}
    return _has_kernel(kernels, opset, as_float)


def _in_float(graph: ir.Graph, node: ir.Node, casts: dict[int, ir.Value]) -> None:
    """``node`` rewritten to read float32 copies of its 16-bit inputs; its 16-bit outputs
    are float32 results cast back (under their own names, for their readers)."""
    inputs: list[ir.Value | None] = []
    for v in node.inputs:
        if v is None or v.dtype not in HALF:
            inputs.append(v)
            continue
        up = casts.get(id(v))
        if up is None:
            cast = ir.Node("", "Cast", [v], [ir.AttrInt64("to", ir.DataType.FLOAT)])
            up = cast.outputs[0]
            up.name, up.dtype, up.shape = f"{v.name}/in_float", ir.DataType.FLOAT, v.shape
            graph.insert_before(node, cast)
            casts[id(v)] = up
        inputs.append(up)
    new = ir.Node(
        node.domain,
        node.op_type,
        inputs,
        list(node.attributes.values()),
        num_outputs=len(node.outputs),
        name=node.name,
        version=node.version,
    )
    new.metadata_props.update(node.metadata_props)
    nodes: list[ir.Node] = [new]
    results: list[ir.Value] = []
    for old, out in zip(node.outputs, new.outputs, strict=True):
        out.shape = old.shape
        if old.dtype in HALF:
            out.name, out.dtype = f"{old.name}/float_result", ir.DataType.FLOAT
            down = ir.Node("", "Cast", [out], [ir.AttrInt64("to", old.dtype)])
            down.outputs[0].dtype, down.outputs[0].shape = old.dtype, old.shape
            nodes.append(down)
            results.append(down.outputs[0])
        else:
            out.dtype = old.dtype
            results.append(out)
    ir.convenience.replace_nodes_and_values(graph, node, [node], nodes, list(node.outputs), results)


def compute_half_in_float(model: ir.Model) -> int:
    """Every bfloat16 node ONNX Runtime's CPU provider lacks a kernel for, computed in
    float32 (the module docstring). Returns how many."""
    graph = model.graph
    opsets = dict(model.opset_imports)
    todo = [n for n in graph if _needs_float(n, opsets)]
    casts: dict[int, ir.Value] = {}
    for node in todo:
        _in_float(graph, node, casts)
    return len(todo)
