"""Minimal gradient graph over an ONNX forward graph.

1. Values on a path from a trainable input to the loss are found by a forward
   walk (along differentiable edges, float tensors only) intersected with a
   backward walk from the loss. Only nodes on such paths get gradient nodes, so
   frozen parameters and index/mask subgraphs get none.
2. Nodes are visited in reverse topological order; each asks its registered rule
   for the input gradients that are needed, and only those.
3. A value used several times (tied weights, residuals) gets its contributions
   merged by one ``Sum`` node.
4. An op on a gradient path without a rule, or registered as not differentiable,
   raises :class:`GradientError` naming the op, the node, its torch scope and the
   trainable parameters behind it.
5. Values a node's subgraphs (Loop/If/Scan bodies, nested too) read from the outer scope
   count as that node's inputs for reachability: a parameter that reaches the loss only
   through control flow that ``inline_control_flow`` could not inline is an error, never
   a silently missing gradient.
6. After the build, the parameters that reach the loss (declared and subgraph reads) must
   be exactly those that got a gradient; ``unreachable`` is what eager leaves ``None``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import onnx_ir as ir
import onnx_ir.traversal

from ortrain.core.names import GradientError
from ortrain.graph_passes.autodiff import registry
from ortrain.graph_passes.autodiff.context import GradContext

# Import for registration side effects.
from ortrain.graph_passes.autodiff.rules import register_all
from ortrain.graph_passes.infra.emitter import Emitter, static_shape
from ortrain.graph_passes.infra.tags import GRAD_OF

register_all()

FLOAT_TYPES = {
    ir.DataType.FLOAT,
    ir.DataType.FLOAT16,
    ir.DataType.BFLOAT16,
    ir.DataType.DOUBLE,
}


def node_scope(node: ir.Node) -> str:
    """The torch module scope a node came from (exporter metadata), or ''."""
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if scopes:
        try:
            names = [s for s in eval_list(scopes) if s]
            return names[-2] if len(names) > 1 else (names[-1] if names else "")
        except ValueError:
            pass
    return node.metadata_props.get("namespace", "")


def eval_list(text: str) -> list[str]:
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        raise ValueError(text)
    return [p.strip().strip("'\"") for p in text[1:-1].split(",")]


def describe(node: ir.Node) -> str:
    scope = node_scope(node)
    where = f" in module '{scope}'" if scope else ""
    dom = f"{node.domain}::" if node.domain else ""
    return f"op {dom}{node.op_type} (node '{node.name}'{where})"


@dataclasses.dataclass
class GradientGraphResult:
    model: ir.Model
    grad_outputs: dict[str, str]  # trainable input name -> gradient output name
    unreachable: list[str]  # trainable inputs with no path to the loss (grad None in torch)
    grad_nodes: int  # number of gradient nodes emitted


def _is_float(v: ir.Value) -> bool:
    # Untyped values (control-flow and sequence outputs) may carry a float: reachability
    # must not stop there.
    return v.dtype in FLOAT_TYPES or v.type is None


def subgraphs(node: ir.Node) -> list[ir.Graph]:
    """The graphs a node's attributes hold (Loop / Scan bodies, If branches)."""
    graphs: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            graphs.append(attr.as_graph())
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs.extend(attr.as_graphs())
    return graphs


def captured_values(graph: ir.Graph) -> dict[int, list[ir.Value]]:
    """id(node) -> values of ``graph`` its subgraphs (nested ones too) read or return."""
    captured = {id(node): _outer_reads(node, graph) for node in graph if subgraphs(node)}
    return {k: v for k, v in captured.items() if v}


def _outer_reads(node: ir.Node, graph: ir.Graph) -> list[ir.Value]:
    found: dict[int, ir.Value] = {}

    def visit(values: Sequence[ir.Value | None]) -> None:
        for v in values:
            if v is not None and v.graph is graph:
                found.setdefault(id(v), v)

    for sub in subgraphs(node):
        walk = onnx_ir.traversal.RecursiveGraphIterator(sub, enter_graph=lambda g: visit(g.outputs))
        for inner in walk:
            visit(inner.inputs)
    return list(found.values())


def _params_behind(
    graph: ir.Graph,
    values: Sequence[ir.Value],
    wrt: dict[int, str],
    captured: dict[int, list[ir.Value]],
) -> list[str]:
    """Trainable inputs among the ancestors of ``values`` (subgraph reads included)."""
    found: set[str] = set()
    seen: set[int] = set()
    stack = list(values)
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if id(v) in wrt:
            found.add(wrt[id(v)])
        node = v.producer()
        if node is not None and node.graph is graph:
            stack.extend(x for x in node.inputs if x is not None)
            stack.extend(captured.get(id(node), ()))
    return sorted(found)


def _params_reaching_loss(
    graph: ir.Graph,
    roots: Sequence[ir.Value],
    wrt: dict[int, str],
    regs: dict[int, registry.Registration | None],
    captured: dict[int, list[ir.Value]],
) -> set[str]:
    """Trainable inputs with a float path to a root (the loss) along edges eager
    differentiates (declared differentiable inputs and subgraph reads; not through
    no-gradient ops)."""
    reach = {id(v) for v in roots}
    for node in reversed(list(graph)):
        reg = regs[id(node)]
        if reg is not None and reg.kind == "no_gradient":
            continue
        if not any(id(o) in reach for o in node.outputs):
            continue
        for i, v in enumerate(node.inputs):
            differentiable = reg is None or reg.kind != "rule" or reg.input_differentiable(i)
            if v is not None and _is_float(v) and differentiable:
                reach.add(id(v))
        reach.update(id(v) for v in captured.get(id(node), ()) if _is_float(v))
    return {name for i, name in wrt.items() if i in reach}


def _opset(model: ir.Model, node: ir.Node) -> int:
    if node.version is not None:
        return node.version
    domain = "" if node.domain == "ai.onnx" else node.domain
    return model.opset_imports.get(domain, 1)


def _expose_outputs(graph: ir.Graph, node: ir.Node, count: int) -> ir.Node:
    """Rebuild ``node`` so it produces at least ``count`` outputs (keeps names and uses).

    Optional outputs that the node declares but leaves unnamed (omitted in ONNX) are
    named and typed in place.
    """
    for k, v in enumerate(node.outputs[:count]):
        if not v.name:
            v.name = f"{node.name}__out{k}"
            v.dtype, v.shape = _extra_output_type(node, k)
    if len(node.outputs) >= count:
        return node
    new = ir.Node(
        node.domain,
        node.op_type,
        list(node.inputs),
        attributes=list(node.attributes.values()),
        num_outputs=count,
        name=node.name,
        metadata_props=dict(node.metadata_props),
        version=node.version,
    )
    for old_v, new_v in zip(node.outputs, new.outputs):
        name, shape, typ = old_v.name, old_v.shape, old_v.type
        old_v.name = f"{name}__replaced"
        old_v.replace_all_uses_with(new_v, replace_graph_outputs=True)
        new_v.name, new_v.shape, new_v.type = name, shape, typ
    for k in range(len(node.outputs), count):
        v = new.outputs[k]
        v.name = f"{node.name}__out{k}"
        v.dtype, v.shape = _extra_output_type(node, k)
    graph.insert_before(node, new)
    graph.remove(node, safe=True)
    return new


def _extra_output_type(node: ir.Node, k: int) -> tuple[ir.DataType, ir.Shape | None]:
    """dtype/shape of optional forward outputs that rules read (SkipLayerNormalization's
    output 3, input + skip + bias, has the input's)."""
    x = node.inputs[0]
    if node.op_type == "Dropout":
        return ir.DataType.BOOL, x.shape
    if node.op_type in ("LayerNormalization", "SimplifiedLayerNormalization"):
        # statistics (mean, 1/std; RMSNorm: 1/rms) over the axes from ``axis`` on, kept 1
        stash = node.attributes.get("stash_type")
        dtype = ir.DataType(stash.value if stash is not None else 1)
        if x.shape is None:
            return dtype, None
        rank = len(x.shape)
        attr = node.attributes.get("axis")
        axis = (attr.value if attr is not None else -1) % rank
        dims = [d if i < axis else 1 for i, d in enumerate(x.shape.dims)]
        return dtype, ir.Shape(dims)
    if node.op_type == "SkipLayerNormalization" and k in (1, 2):  # fp32 stats, last axis
        dims = None if x.shape is None else ir.Shape([*x.shape.dims[:-1], 1])
        return ir.DataType.FLOAT, dims
    return x.dtype, x.shape


def build_gradient_graph(
    model: ir.Model,
    loss: str,
    wrt: Sequence[str],
    *,
    loss_grad: ir.Value | None = None,
    cpu_kernels: bool = False,
    seeds: Mapping[str, str] | None = None,
) -> GradientGraphResult:
    """Add the minimal backward graph of ``loss`` w.r.t. the inputs ``wrt`` to ``model``.

    The model is changed in place: gradient outputs named ``grad:<input>`` are appended.
    ``loss_grad`` (a graph input, e.g. the loss scale) seeds the backward pass; the
    default seed is 1. ``seeds`` (a compiled segment's backward, ``ortrain/segments``)
    instead maps each of several values to the graph input holding its gradient (added,
    typed as the value, where the graph has none); ``loss`` is then unused.
    ``cpu_kernels``: rules may emit ortrain's fused CPU backward kernels (``ortrain.cpu``
    domain, ``ortrain/runtime/grad_kernels.c``) for fp32 values.
    """
    graph = model.graph
    values = {v.name: v for v in graph.inputs}
    for node in graph:
        for o in node.outputs:
            values[o.name] = o
    roots = dict(seeds) if seeds else {loss: ""}
    for name in roots:
        # a constant output (a segment returning ``zeros_like`` of its input, folded to
        # an initializer): its gradient reaches nothing, but it still gets its seed
        if name not in values and name in graph.initializers:
            values[name] = graph.initializers[name]
    absent = [r for r in roots if r not in values]
    if absent:
        raise GradientError(f"value(s) {absent} to differentiate from are not in the graph")
    root_vs = {name: values[name] for name in roots}
    for name, seed in roots.items():  # each seed a graph input typed as its value
        if seed and seed not in values:
            root = root_vs[name]
            values[seed] = ir.Value(name=seed, shape=root.shape, type=root.type)
            graph.inputs.append(values[seed])
    missing = [n for n in wrt if n not in values]
    if missing:
        raise GradientError(f"trainable inputs not in the graph: {missing}")
    wrt_values = [values[n] for n in wrt]
    regs = {
        id(node): registry.lookup(node.op_type, node.domain, _opset(model, node)) for node in graph
    }
    captured = captured_values(graph)
    wrt_ids = {id(v): name for name, v in zip(wrt, wrt_values)}
    expected = _params_reaching_loss(graph, list(root_vs.values()), wrt_ids, regs, captured)

    # 1. forward reachability along differentiable edges.
    fwd: set[int] = {id(v) for v in wrt_values if _is_float(v)}
    for node in graph:
        reg = regs[id(node)]
        if reg is not None and reg.kind == "no_gradient":
            continue
        live = any(
            v is not None
            and id(v) in fwd
            and (reg is None or reg.kind != "rule" or reg.input_differentiable(i))
            for i, v in enumerate(node.inputs)
        ) or any(id(v) in fwd for v in captured.get(id(node), ()))
        if live:
            fwd.update(id(o) for o in node.outputs if _is_float(o))

    # 2. backward reachability from the loss, restricted to forward-reachable values.
    needed: set[int] = {id(v) for v in root_vs.values() if id(v) in fwd}
    on_path: list[ir.Node] = []
    for node in reversed(list(graph)):
        if not any(id(o) in needed for o in node.outputs):
            continue
        reg = regs[id(node)]
        diff_inputs = [
            i
            for i, v in enumerate(node.inputs)
            if v is not None
            and id(v) in fwd
            and (reg is None or reg.kind != "rule" or reg.input_differentiable(i))
        ]
        reads = [v for v in captured.get(id(node), ()) if id(v) in fwd]
        if not diff_inputs and not reads:
            continue
        if reg is None or reg.kind == "not_differentiable" or reads:
            live = [node.inputs[i] for i in diff_inputs] + reads
            params = _params_behind(graph, live, wrt_ids, captured)
            raise GradientError(_not_differentiable(node, reg, params, reads))
        on_path.append(node)
        needed.update(id(node.inputs[i]) for i in diff_inputs)

    # 3. expose forward outputs the rules read (Dropout mask, LayerNorm statistics).
    rebuilt: list[ir.Node] = []
    for node in on_path:
        reg = regs[id(node)]
        new = _expose_outputs(graph, node, reg.forward_outputs) if reg.forward_outputs else node
        if new is not node:
            regs[id(new)] = reg
            for old_v, new_v in zip(node.outputs, new.outputs):
                for ids in (fwd, needed):
                    if id(old_v) in ids:
                        ids.add(id(new_v))
                for name, v in root_vs.items():
                    if old_v is v:
                        root_vs[name] = new_v
            node = new
        rebuilt.append(node)

    # 4. emit gradients in reverse topological order.
    em = Emitter(graph, "grad")
    contribs: dict[int, list[ir.Value]] = {}
    for name, root in root_vs.items():
        if roots[name]:
            seed = values[roots[name]]
        elif loss_grad is not None:
            seed = loss_grad
        else:
            seed = em.const(1.0, root.dtype)
            if static_shape(root) != ():
                seed = em.op("Expand", seed, em.ints(static_shape(root)))
        contribs.setdefault(id(root), []).append(seed)

    def total(v: ir.Value) -> ir.Value | None:
        parts = contribs.get(id(v))
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        merged = em.op("Sum", *parts, dtype=v.dtype, shape=v.shape, name_hint="gradsum")
        contribs[id(v)] = [merged]
        return merged

    for node in rebuilt:
        reg = regs[id(node)]
        gos = [total(o) if id(o) in needed else None for o in node.outputs]
        if all(g is None for g in gos):
            continue
        want = frozenset(
            i
            for i, v in enumerate(node.inputs)
            if v is not None and id(v) in needed and reg.input_differentiable(i)
        )
        em.metadata = {
            GRAD_OF: node.name,
            "namespace": node.metadata_props.get("namespace", ""),
        }
        ctx = GradContext(node, em, gos, want, cpu_kernels=cpu_kernels)
        try:
            result = reg.fn(ctx)
        except GradientError:
            raise
        except Exception as exc:  # a rule bug: say which node it was building
            raise GradientError(f"gradient rule failed for {describe(node)}: {exc}") from exc
        for i, g in result.items():
            if g is None or i not in want:
                continue
            x = node.inputs[i]
            if g.shape is None and x.shape is not None:
                g.shape = x.shape
            if g.dtype is None:
                g.dtype = x.dtype
            contribs.setdefault(id(x), []).append(g)

    # 5. gradient outputs for the trainable inputs.
    grad_outputs: dict[str, str] = {}
    unreachable: list[str] = []
    used: set[int] = set()
    for name, v in zip(wrt, wrt_values):
        g = total(v)
        if g is None:
            unreachable.append(name)
            continue
        if g.is_graph_input() or g.is_graph_output() or g.const_value is not None or id(g) in used:
            g = em.op("Identity", g, dtype=v.dtype, shape=v.shape)
        used.add(id(g))
        g.name = f"grad:{name}"
        g.shape, g.dtype = v.shape, v.dtype
        graph.outputs.append(g)
        grad_outputs[name] = g.name
    if set(grad_outputs) != expected:
        raise GradientError(
            f"trainable parameters reaching the loss {sorted(expected)} differ from those "
            f"that got a gradient {sorted(grad_outputs)}: a rule returned no gradient for "
            "an input it was asked for"
        )
    count = len(em.nodes)
    em.flush_before(None)
    return GradientGraphResult(model, grad_outputs, unreachable, count)


def _not_differentiable(
    node: ir.Node,
    reg: registry.Registration | None,
    params: list[str],
    reads: list[ir.Value],
) -> str:
    where = f"{describe(node)} lies between trainable parameter(s) {params} and the loss"
    if reads:
        names = [v.name for v in reads]
        return (
            f"{where} and its subgraph reads {names} from the outer scope: ortrain's autodiff "
            "does not differentiate control flow (graph_passes/prepare/inline_control_flow.py "
            "unrolls "
            "Loops with a constant trip count, inlines Ifs with a constant condition and "
            "computes both branches of Ifs over safe ops; this one could not be)"
        )
    if reg is None:
        return f"no gradient rule for {where}. Register one in graph_passes/autodiff/rules."
    return f"{where} but is not differentiable: {reg.reason}"
