"""Control flow made differentiable before autodiff, which differentiates no subgraph.

1. An ``If`` whose condition is a constant is replaced by its taken branch: the branch's
   nodes move into the enclosing graph, its outer-scope reads become ordinary inputs.
2. A ``Loop`` whose trip count and condition are constants is unrolled iteration by
   iteration: the body is cloned with the iteration number and condition as constants and
   the loop-carried values wired; the clone's small constant subexpressions are folded
   and its constant Ifs inlined (the exporter's while-loops, EmbeddingBag's, compute the
   next condition from the iteration number), so the loop ends when the condition folds to
   false. Scan outputs are stacked with Unsqueeze + Concat. A Loop whose condition does not
   fold, or that runs past ``MAX_ITERATIONS`` iterations or ``MAX_NODES`` cloned nodes,
   stays as it was.
3. A ``Scan`` with a static length up to ``MAX_ITERATIONS`` (forward directions, axis 0)
   is unrolled the same way: Gather per iteration in, Unsqueeze + Concat out.
4. An ``If`` on a run-time condition whose branches read float values from outside and
   hold only ops that run safely either way (``_SELECTABLE``) computes both branches and
   picks with ``Where``; a division in a branch divides by 1 where that branch is not
   taken, so its zero gradient stays 0, never 0/0. A ``Slice`` on run-time bounds that a
   reduction over the sliced axis reads (EmbeddingBag with offsets: each bag's rows)
   becomes that reduction under a row mask, with static shapes.
5. The sequences unrolled loops build (``SequenceEmpty`` then appending ``SequenceInsert``\\ s,
   or ``SequenceConstruct``) read by a ``ConcatFromSequence`` become one ``Concat``.

Trip counts and conditions computed from constants in the main graph are folded first.
Whatever stays is the builder's business: a parameter that reaches the loss through it is
a ``GradientError`` (graph_passes/autodiff/builder.py), never a missing gradient.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import onnx.reference
import onnx_ir as ir
import onnx_ir.passes.common
import onnx_ir.traversal

from ortrain.graph_passes.autodiff.builder import subgraphs
from ortrain.graph_passes.infra.constant_value import constant_tensor

MAX_ITERATIONS = 1024
MAX_NODES = 50_000  # nodes one unrolled loop may add
FOLD_INPUT_LIMIT = 8192  # elements: larger constant inputs are not folded (as clean_forward)
FOLD_OUTPUT_LIMIT = 1 << 16  # elements: larger results are computed at run time
# Nondeterministic or stateful: never folded.
_NO_FOLD = {
    "RandomUniform",
    "RandomNormal",
    "RandomUniformLike",
    "RandomNormalLike",
    "Bernoulli",
    "Multinomial",
    "Dropout",
    "Constant",
}


def inline_control_flow(model: ir.Model) -> int:
    """Inline what can be inlined; returns how many nodes were replaced."""
    inliner = _Inliner(model)
    for node in list(model.graph):
        if node.graph is model.graph and node.op_type in ("If", "Loop", "Scan"):
            inliner.expand(node)
    count = inliner.count + _concat_sequences(inliner)
    inliner.drop_unused_constants()
    if count:
        # the inlined nodes' values are untyped: autodiff's rules read static shapes
        onnx_ir.passes.common.ShapeInferencePass()(model)
    for name, then, other in inliner.selects:
        if then.shape is None or then.shape != other.shape or not then.shape.is_static():
            raise NotImplementedError(
                f"If node '{name}': its branches give shapes {then.shape} and {other.shape}; "
                "picking one with Where needs equal static shapes"
            )
    return count


class _Undo(Exception):
    """A loop that cannot be unrolled after all: its partial unrolling is removed."""


class _Inliner:
    def __init__(self, model: ir.Model) -> None:
        self.graph = model.graph
        self.opset = model.opset_imports.get("", 20)
        self.count = 0
        self.created: set[str] = set()  # initializers this pass made
        # old value -> what its uses read now (values as keys: ids of dead ones get reused)
        self.replaced: dict[ir.Value, ir.Value] = {}
        self.added: list[ir.Node] = []  # every node self.op made, in order
        # every node and initializer added, in order: what an undo removes
        self.journal: list[ir.Node] = []
        self.init_journal: list[str] = []
        self.selects: list[tuple[str, ir.Value, ir.Value]] = []  # (If, then, else) outputs
        self.names: set[str] = {
            v.name for v in (*self.graph.inputs, *self.graph.initializers.values()) if v.name
        }
        for node in onnx_ir.traversal.RecursiveGraphIterator(self.graph):
            self.names.update(o.name for o in node.outputs if o.name)
        for node in self.graph:
            for sub in subgraphs(node):
                self.names.update(v.name for v in sub.inputs if v.name)
                self.names.update(sub.initializers)

    # -- names and constants ---------------------------------------------------------

    def fresh(self, base: str) -> str:
        root = re.sub(r"__\d+$", "", base or "v")
        k = len(self.names)
        while f"{root}__{k}" in self.names:
            k += 1
        name = f"{root}__{k}"
        self.names.add(name)
        return name

    def const(self, array: np.ndarray, base: str) -> ir.Value:
        v = ir.Value(name=self.fresh(base), const_value=ir.tensor(array))
        v.dtype, v.shape = v.const_value.dtype, ir.Shape(array.shape)
        self.graph.register_initializer(v)
        self.created.add(v.name)
        self.init_journal.append(v.name)
        return v

    def drop_unused_constants(self) -> None:
        """The folded intermediates (the condition's arithmetic) nothing reads any more."""
        for name in self.created & set(self.graph.initializers):
            if not self.graph.initializers[name].uses():
                self.graph.initializers.pop(name)

    def constant(self, v: ir.Value | None, depth: int = 0) -> np.ndarray | None:
        """``v``'s value if it is, or folds to, a small constant (main-graph producers)."""
        if v is None:
            return None
        t = _constant_tensor(v)
        if t is not None:
            return t.numpy()
        node = v.producer()
        if node is None or node.graph is not self.graph or depth > 32:
            return None
        if all(self.constant(x, depth + 1) is not None for x in node.inputs if x is not None):
            folded = self.fold(node)
            if folded is not None:
                return folded[node.outputs.index(v)]
        return None

    def fold(self, node: ir.Node) -> list[np.ndarray] | None:
        """Evaluate ``node`` if its inputs are small constants; its outputs become
        initializers. Returns the values, or None (left as it is)."""
        if node.domain not in ("", "ai.onnx") or node.op_type in _NO_FOLD or subgraphs(node):
            return None
        if "Sequence" in node.op_type:
            return None
        arrays = []
        for x in node.inputs:
            t = _constant_tensor(x)
            if x is not None and (t is None or t.size > FOLD_INPUT_LIMIT):
                return None
            arrays.append(None if t is None else t.numpy())
        results = _evaluate(node, arrays, self.opset)
        if results is None or any(r.size > FOLD_OUTPUT_LIMIT for r in results):
            return None
        for o, r in zip(node.outputs, results):
            self.replace(o, self.const(r, o.name))
        self.graph.remove(node, safe=True)
        return results

    def replace(self, old: ir.Value, new: ir.Value) -> None:
        """Uses of ``old`` read ``new``; a graph output keeps its name through an Identity."""
        self.replaced[old] = new
        if old.is_graph_output():
            ident = ir.Node("", "Identity", [new], num_outputs=1, name=self.fresh("inlined"))
            out = ident.outputs[0]
            old.replace_all_uses_with(out, replace_graph_outputs=True)
            name, old.name = old.name, self.fresh(old.name)
            out.name, out.type, out.shape = name, old.type or new.type, old.shape or new.shape
            self.graph.append(ident)
            self.journal.append(ident)
            return
        old.replace_all_uses_with(new)

    def current(self, v: ir.Value) -> ir.Value:
        """What replaced ``v`` (folding, inlining), transitively."""
        while v in self.replaced:
            v = self.replaced[v]
        return v

    # -- expanding control flow ------------------------------------------------------

    def expand(self, node: ir.Node) -> list[ir.Node] | None:
        """Inline or unroll ``node`` (an If, Loop or Scan of the main graph); returns the
        nodes that replace it, or None where it stays."""
        if node.domain not in ("", "ai.onnx"):
            return None
        marks = len(self.journal), len(self.init_journal), len(self.selects)
        try:
            if node.op_type == "If":
                result = self.inline_if(node)
                if result is None:
                    result = self.select_if(node)
            elif node.op_type == "Loop":
                result = self.unroll_loop(node)
            elif node.op_type == "Scan":
                result = self.unroll_scan(node)
            else:
                return None
        except _Undo:
            self.undo(*marks)
            return None
        if result is not None:
            self.count += 1
        return result

    def undo(self, nodes: int, inits: int, selects: int) -> None:
        """Remove what was added since the marks (nodes, initializers, selected Ifs)."""
        added = [n for n in self.journal[nodes:] if n.graph is self.graph]
        for node in added:
            _detach(node)
        self.graph.remove(added)
        for name in self.init_journal[inits:]:
            init = self.graph.initializers.get(name)
            if init is not None and not init.uses():  # folded main-graph values stay
                self.graph.initializers.pop(name)
        del self.journal[nodes:], self.init_journal[inits:], self.selects[selects:]

    def insert(self, before: ir.Node, nodes: ir.Node | list[ir.Node]) -> None:
        self.graph.insert_before(before, nodes)
        self.journal.extend(nodes if isinstance(nodes, list) else [nodes])

    def simplify(self, nodes: Sequence[ir.Node]) -> list[ir.Node]:
        """Fold and expand freshly inlined nodes; returns those that remain."""
        live: list[ir.Node] = []
        for node in nodes:
            if node.graph is not self.graph or self.fold(node) is not None:
                continue
            if node.op_type in ("If", "Loop", "Scan"):
                new = self.expand(node)
                if new is not None:
                    live.extend(new)
                    continue
            live.append(node)
        return live

    def instantiate(
        self, sub: ir.Graph, inputs: Sequence[ir.Value], before: ir.Node
    ) -> tuple[list[ir.Node], list[ir.Value]]:
        """A copy of ``sub``'s nodes inserted before ``before``, its inputs reading
        ``inputs``; returns the nodes (simplified) and the copy's outputs."""
        g = sub.clone(allow_outer_scope_values=True)
        outputs = list(g.outputs)
        g.outputs.clear()  # the copy's outputs are looked up through ``mapping``
        mapping: dict[ir.Value, ir.Value] = {}
        for inp, val in zip(g.inputs, inputs):
            inp.replace_all_uses_with(val)
            mapping[inp] = val
        for name in list(g.initializers):
            init = g.initializers.pop(name)
            hoisted = ir.Value(
                name=self.fresh(name),
                type=init.type,
                shape=init.shape,
                const_value=init.const_value,
            )
            init.replace_all_uses_with(hoisted)
            self.graph.register_initializer(hoisted)
            self.created.add(hoisted.name)
            self.init_journal.append(hoisted.name)
            mapping[init] = hoisted
        outputs = [mapping.get(o, o) for o in outputs]
        nodes = list(g)
        g.remove(nodes)
        self._rename(nodes)
        self.insert(before, nodes)
        nodes = self.simplify(nodes)
        return nodes, [self.current(o) for o in outputs]

    def _rename(self, nodes: list[ir.Node]) -> None:
        """Fresh names for the copy's values (nested subgraphs too): copies share names."""

        def rename(values: Sequence[ir.Value]) -> None:
            for v in values:
                v.name = self.fresh(v.name)

        for node in nodes:
            node.name = self.fresh(node.name)
            rename(node.outputs)
            for sub in subgraphs(node):
                walk = onnx_ir.traversal.RecursiveGraphIterator(
                    sub, enter_graph=lambda g: rename(g.inputs)
                )
                for inner in walk:
                    rename(inner.outputs)

    def inline_if(self, node: ir.Node) -> list[ir.Node] | None:
        cond = self.constant(node.inputs[0])
        if cond is None:
            return None
        branch = "then_branch" if bool(cond.reshape(-1)[0]) else "else_branch"
        nodes, outs = self.instantiate(node.attributes[branch].as_graph(), [], node)
        self.finish(node, outs)
        return nodes

    def op(self, op_type: str, *inputs: ir.Value, before: ir.Node, **attrs) -> ir.Value:
        node = ir.Node(
            "",
            op_type,
            list(inputs),
            attributes=ir.convenience.convert_attributes(attrs),
            num_outputs=1,
            name=self.fresh(op_type.lower()),
            metadata_props=dict(before.metadata_props),  # the module scope, for errors
        )
        node.outputs[0].name = self.fresh(op_type.lower())
        self.insert(before, node)
        self.added.append(node)
        return node.outputs[0]

    def select_if(self, node: ir.Node) -> list[ir.Node] | None:
        """An If on a run-time condition whose branches read float values from outside
        and hold only ops that are safe to run either way: both branches computed, the
        result picked by ``Where``. A division in a branch divides by 1 where that branch
        is not taken (its zero gradient stays zero, never 0/0)."""
        if not _reads_outer_float(node):
            return None
        mark = len(self.added)
        cond = self.op(
            "Reshape", node.inputs[0], self.const(np.zeros(0, np.int64), "scalar"), before=node
        )
        taken = {"then_branch": cond, "else_branch": self.op("Not", cond, before=node)}
        outs: dict[str, list[ir.Value]] = {}
        nodes: list[ir.Node] = []
        for key, guard in taken.items():
            new, outs[key] = self.instantiate(node.attributes[key].as_graph(), [], node)
            new = self.mask_slices(new)
            outs[key] = [self.current(o) for o in outs[key]]
            for n in new:
                if not _selectable(n):
                    raise _Undo
                self.guard_singular(n, guard)
            nodes += new
        picked = []
        for t, e in zip(outs["then_branch"], outs["else_branch"]):
            picked.append(self.op("Where", cond, t, e, before=node))
            self.selects.append((node.name, t, e))
        self.finish(node, picked)
        return nodes + self.added[mark:]

    def guard_singular(self, node: ir.Node, taken: ir.Value) -> None:
        k = _SINGULAR.get(node.op_type)
        if k is None or k >= len(node.inputs) or node.inputs[k] is None:
            return
        x = node.inputs[k]
        one = self.op("CastLike", self.const(np.array(1, np.int64), "one"), x, before=node)
        node.replace_input_with(k, self.op("Where", taken, x, one, before=node))

    def mask_slices(self, nodes: list[ir.Node]) -> list[ir.Node]:
        """Slice(x, start, end) on run-time bounds read by a reduction over the sliced axis
        -> a reduction of x under the mask start <= row < end (static shapes)."""
        out = []
        for n in nodes:
            if n.graph is not self.graph:
                continue
            if _runtime_slice(n):
                out += self.mask_slice(n)
            else:
                out.append(n)
        return [n for n in out if n.graph is self.graph]

    def mask_slice(self, sl: ir.Node) -> list[ir.Node]:
        x, start, end = sl.inputs[:3]
        extra = [_constant_tensor(v) for v in sl.inputs[3:] if v is not None]
        if any(t is None for t in extra) or x.shape is None or x.dtype not in _FLOATS:
            raise _Undo
        axes = extra[0].numpy().reshape(-1).tolist() if extra else [0]
        steps = extra[1].numpy().reshape(-1).tolist() if len(extra) > 1 else [1]
        if len(axes) != 1 or steps != [1] or _static_len(start) != 1 or _static_len(end) != 1:
            raise _Undo
        rank, axis = len(x.shape), axes[0] % len(x.shape)
        n = x.shape[axis]
        if not isinstance(n, int):
            raise _Undo
        reductions = [u for u, _ in sl.outputs[0].uses()]
        if not reductions or any(_reduce_axes(r, rank) != [axis] for r in reductions):
            raise _Undo
        mark = len(self.added)
        rows = np.arange(n, dtype=np.int64).reshape([n if d == axis else 1 for d in range(rank)])
        bounds = [self.clamp(v, n, sl) for v in (start, end)]
        j = self.const(rows, "rows")
        mask = self.op(
            "And",
            self.op("GreaterOrEqual", j, bounds[0], before=sl),
            self.op("Less", j, bounds[1], before=sl),
            before=sl,
        )
        for r in reductions:
            self.masked_reduce(r, x, mask, bounds, n)
        _detach(sl)
        self.graph.remove(sl)
        return self.added[mark:]

    def clamp(self, v: ir.Value, n: int, before: ir.Node) -> ir.Value:
        """Slice's reading of a bound: negative counts from the end, clamped to [0, n]."""
        zero = self.const(np.array(0, np.int64), "zero")
        size = self.const(np.array(n, np.int64), "size")
        wrapped = self.op(
            "Where",
            self.op("Less", v, zero, before=before),
            self.op("Add", v, size, before=before),
            v,
            before=before,
        )
        return self.op("Max", self.op("Min", wrapped, size, before=before), zero, before=before)

    def masked_reduce(self, r: ir.Node, x: ir.Value, mask: ir.Value, bounds, n: int) -> None:
        dtype = x.dtype.numpy()
        fill = {"ReduceSum": 0, "ReduceMean": 0, "ReduceMax": -np.inf, "ReduceMin": np.inf}
        filled = self.op(
            "Where", mask, x, self.const(np.array(fill[r.op_type], dtype), "fill"), before=r
        )
        axes = self.const(np.array(_reduce_axes(r, len(x.shape)), np.int64), "axes")
        keep = r.attributes.get("keepdims")
        keepdims = 1 if keep is None else keep.as_int()
        reduce = "ReduceSum" if r.op_type == "ReduceMean" else r.op_type
        y = self.op(reduce, filled, axes, before=r, keepdims=keepdims)
        if r.op_type == "ReduceMean":  # sum / count; an empty slice's mean stays NaN
            count = self.op("Sub", bounds[1], bounds[0], before=r)
            one = self.const(np.array(1, np.int64), "one")
            safe = self.op("Cast", self.op("Max", count, one, before=r), before=r, to=x.dtype)
            empty = self.op(
                "LessOrEqual", count, self.const(np.array(0, np.int64), "zero"), before=r
            )
            nan = self.const(np.array(np.nan, dtype), "nan")
            y = self.op("Where", empty, nan, self.op("Div", y, safe, before=r), before=r)
        self.replace(r.outputs[0], y)
        _detach(r)
        self.graph.remove(r)

    def finish(self, node: ir.Node, outs: Sequence[ir.Value]) -> None:
        for o, new in zip(node.outputs, outs):
            if new.type is None and o.type is not None:
                new.type = o.type
            self.replace(o, new)
        _detach(node)
        self.graph.remove(node, safe=True)

    def unroll_loop(self, node: ir.Node) -> list[ir.Node] | None:
        trip_v, cond_v, *carried = node.inputs
        trip = self.constant(trip_v) if trip_v is not None else None
        cond = self.constant(cond_v) if cond_v is not None else np.array(True)
        if (trip_v is not None and trip is None) or cond is None:
            return None
        body = node.attributes["body"].as_graph()
        n_scan = len(body.outputs) - 1 - len(carried)
        scans: list[list[ir.Value]] = [[] for _ in range(n_scan)]
        nodes: list[ir.Node] = []
        i = 0
        while bool(cond.reshape(-1)[0]) and (trip is None or i < int(trip.reshape(-1)[0])):
            if i >= MAX_ITERATIONS or len(nodes) > MAX_NODES:
                raise _Undo
            it = self.const(np.array(i, np.int64), f"{node.name}_iter")
            c = self.const(np.array(True), f"{node.name}_cond")
            new, outs = self.instantiate(body, [it, c, *carried], node)
            nodes += new
            cond = self.constant(outs[0])
            if cond is None:  # the condition depends on run-time values
                raise _Undo
            carried = outs[1 : 1 + len(carried)]
            for k, s in enumerate(outs[1 + len(carried) :]):
                scans[k].append(s)
            i += 1
        if n_scan and i == 0:
            raise _Undo  # an empty scan output's element shape is unknown
        stacked = [self.stack(s, node) for s in scans]
        nodes += [v.producer() for v in stacked]
        self.finish(node, [*carried, *stacked])
        return nodes

    def stack(self, values: Sequence[ir.Value], before: ir.Node, axis: int = 0) -> ir.Value:
        """Concat of the values, each with a new axis ``axis`` (Unsqueeze)."""
        axes = self.const(np.array([axis], np.int64), "stack_axes")
        parts = []
        for v in values:
            un = ir.Node("", "Unsqueeze", [v, axes], num_outputs=1, name=self.fresh("unsqueeze"))
            un.outputs[0].name = self.fresh(f"{v.name}_unsqueezed")
            self.insert(before, un)
            parts.append(un.outputs[0])
        cat = ir.Node(
            "",
            "Concat",
            parts,
            attributes=[ir.AttrInt64("axis", axis)],
            num_outputs=1,
            name=self.fresh("stack"),
        )
        cat.outputs[0].name = self.fresh("stacked")
        self.insert(before, cat)
        return cat.outputs[0]

    def unroll_scan(self, node: ir.Node) -> list[ir.Node] | None:
        body = node.attributes["body"].as_graph()
        n_in = node.attributes["num_scan_inputs"].as_int()
        n_state = len(node.inputs) - n_in
        for key in (
            "scan_input_axes",
            "scan_input_directions",
            "scan_output_axes",
            "scan_output_directions",
        ):
            attr = node.attributes.get(key)
            if attr is not None and any(attr.as_ints()):
                return None  # reversed directions or other axes: left as it is
        xs = node.inputs[n_state:]
        shapes = [x.shape if x is not None else None for x in xs]
        if not shapes or any(s is None or len(s) == 0 or not isinstance(s[0], int) for s in shapes):
            return None
        length = shapes[0][0]
        if length > MAX_ITERATIONS or length == 0:
            return None
        state = list(node.inputs[:n_state])
        n_out = len(body.outputs) - n_state
        outs_per: list[list[ir.Value]] = [[] for _ in range(n_out)]
        nodes: list[ir.Node] = []
        for i in range(length):
            index = self.const(np.array(i, np.int64), f"{node.name}_index")
            slices = []
            for x in xs:
                g = ir.Node(
                    "",
                    "Gather",
                    [x, index],
                    attributes=[ir.AttrInt64("axis", 0)],
                    num_outputs=1,
                    name=self.fresh("scan_slice"),
                )
                g.outputs[0].name = self.fresh(f"{x.name}_slice")
                self.insert(node, g)
                nodes.append(g)
                slices.append(g.outputs[0])
            new, outs = self.instantiate(body, [*state, *slices], node)
            nodes += new
            state = outs[:n_state]
            for k, v in enumerate(outs[n_state:]):
                outs_per[k].append(v)
        stacked = [self.stack(s, node) for s in outs_per]
        nodes += [v.producer() for v in stacked]
        self.finish(node, [*state, *stacked])
        return nodes


_FLOATS = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
# Ops a selected If's branches may hold: they fail on no input value, and a zero output
# gradient gives zero input gradients for finite inputs (no Exp, Log, Pow, Sqrt: their
# backward turns an untaken branch's overflow into 0 * inf).
_SELECTABLE = {
    "Identity", "Cast", "CastLike", "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Where",
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or",
    "Max", "Min", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "Reshape",
    "Tanh", "Sigmoid", "Relu", "MatMul", "Gemm", "Transpose", "Softmax",
}  # fmt: skip
# input of an op that the branch not taken must not feed a singular value (Div: 0)
_SINGULAR = {"Div": 1}


def _reads_outer_float(node: ir.Node) -> bool:
    def outer_float(v: ir.Value | None) -> bool:
        # copies made by this pass are untyped until the final shape inference
        return v is not None and v.graph is node.graph and (v.dtype in _FLOATS or v.type is None)

    for sub in subgraphs(node):
        if any(outer_float(v) for v in sub.outputs):
            return True
        for inner in onnx_ir.traversal.RecursiveGraphIterator(sub):
            if any(outer_float(v) for v in inner.inputs):
                return True
    return False


def _selectable(node: ir.Node) -> bool:
    if node.op_type not in _SELECTABLE or subgraphs(node) or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Reshape":  # a run-time shape may not fit
        return _constant_tensor(node.inputs[1]) is not None
    return True


def _runtime_slice(node: ir.Node) -> bool:
    return node.op_type == "Slice" and any(
        _constant_tensor(v) is None for v in node.inputs[1:] if v is not None
    )


def _reduce_axes(node: ir.Node, rank: int) -> list[int] | None:
    if node.op_type not in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"):
        return None
    attr = node.attributes.get("axes")
    if attr is not None:
        axes = list(attr.as_ints())
    elif len(node.inputs) > 1 and node.inputs[1] is not None:
        t = _constant_tensor(node.inputs[1])
        if t is None:
            return None
        axes = t.numpy().reshape(-1).tolist()
    else:
        return None
    return sorted(a % rank for a in axes)


def _static_len(v: ir.Value) -> int | None:
    """Length of a 1-D index value: its shape, or a Slice of a known shape on constants."""
    if v.shape is not None and len(v.shape) == 1 and isinstance(v.shape[0], int):
        return v.shape[0]
    node = v.producer()
    if node is None or node.op_type != "Slice" or node.inputs[0].shape is None:
        return None
    params = [_constant_tensor(x) for x in node.inputs[1:] if x is not None]
    if any(t is None for t in params) or not node.inputs[0].shape.is_static():
        return None
    starts, ends, *rest = [t.numpy().reshape(-1) for t in params]
    axes = rest[0] if rest else range(len(starts))
    steps = rest[1] if len(rest) > 1 else [1] * len(starts)
    index = [slice(None)] * len(node.inputs[0].shape)
    for a, b, e, st in zip(axes, starts, ends, steps):
        index[int(a)] = slice(int(b), int(e), int(st))
    shape = np.empty(node.inputs[0].shape.numpy())[tuple(index)].shape
    return shape[0] if len(shape) == 1 else None


def _detach(node: ir.Node) -> None:
    """``node`` and the nodes of its subgraphs stop being uses of their inputs (the outer
    values a removed Loop body read must not look used)."""
    for sub in subgraphs(node):
        for inner in onnx_ir.traversal.RecursiveGraphIterator(sub):
            for i in range(len(inner.inputs)):
                inner.replace_input_with(i, None)
    for i in range(len(node.inputs)):
        node.replace_input_with(i, None)


def _constant_tensor(v: ir.Value | None) -> ir.TensorProtocol | None:
    # an initializer that is also a graph input is only a default: not a constant
    return None if v is None or v.is_graph_input() else constant_tensor(v)


def _evaluate(
    node: ir.Node, inputs: list[np.ndarray | None], opset: int
) -> list[np.ndarray] | None:
    proto = ir.serde.serialize_node(node)
    del proto.input[:], proto.output[:]
    proto.input.extend("" if a is None else f"i{k}" for k, a in enumerate(inputs))
    proto.output.extend(f"o{k}" for k in range(len(node.outputs)))
    feeds = {f"i{k}": a for k, a in enumerate(inputs) if a is not None}
    try:
        results = onnx.reference.ReferenceEvaluator(proto, opsets={"": opset}).run(None, feeds)
    except Exception:  # an op the reference cannot evaluate stays for run time
        return None
    if not all(isinstance(r, np.ndarray) for r in results):
        return None
    return [np.asarray(r) for r in results]


def _concat_sequences(inliner: _Inliner) -> int:
    """ConcatFromSequence over a sequence built element by element -> one Concat."""
    graph, count = inliner.graph, 0
    for node in list(graph):
        if node.op_type != "ConcatFromSequence" or node.graph is not graph:
            continue
        elements = _sequence_elements(node.inputs[0])
        if not elements:
            continue
        axis = node.attributes["axis"].as_int()
        new_axis = node.attributes.get("new_axis")
        if new_axis is not None and new_axis.as_int():
            out = inliner.stack(elements, node, axis)
        else:
            cat = ir.Node(
                "",
                "Concat",
                list(elements),
                attributes=[ir.AttrInt64("axis", axis)],
                num_outputs=1,
                name=inliner.fresh("concat_sequence"),
            )
            cat.outputs[0].name = inliner.fresh("concat_sequence")
            graph.insert_before(node, cat)
            out = cat.outputs[0]
        inliner.finish(node, [out])
        count += 1
    _remove_dead_sequences(graph)
    return count


def _sequence_elements(seq: ir.Value | None) -> list[ir.Value] | None:
    elements: list[ir.Value] = []
    while seq is not None:
        node = seq.producer()
        if node is None:
            return None
        if node.op_type == "SequenceEmpty":
            return elements[::-1]
        if node.op_type == "SequenceConstruct":
            return [*node.inputs, *elements[::-1]]
        if node.op_type != "SequenceInsert" or (len(node.inputs) > 2 and node.inputs[2]):
            return None  # insert at a position: not an append
        elements.append(node.inputs[1])
        seq = node.inputs[0]
    return None


def _remove_dead_sequences(graph: ir.Graph) -> None:
    for node in reversed(list(graph)):
        if node.op_type.startswith("Sequence") and not any(
            o.uses() or o.is_graph_output() for o in node.outputs
        ):
            graph.remove(node, safe=True)
