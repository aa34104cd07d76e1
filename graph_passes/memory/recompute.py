"""Recompute cheap forward values in the backward instead of keeping them alive.

A forward value that a backward node reads stays alive from the forward pass to that
reader. When the op that made it is cheap and its inputs are alive then anyway, the
backward can make it again next to its readers, and the forward copy dies after its
last forward reader. Which ops count as cheap is a named policy (JAX
``checkpoint_policies`` style), not a flag:

- ``RecomputePolicy.NOTHING``: keep every value (the off switch).
- ``RecomputePolicy.CHEAP_VIEWS``: Cast, CastLike, Reshape, Flatten, Squeeze, Unsqueeze,
  Identity, Transpose, Expand: layout/dtype changes, O(bytes) to redo.
- ``RecomputePolicy.CHEAP_OPS``: CHEAP_VIEWS plus element-wise activations (Gelu, Relu,
  LeakyRelu, Elu, Sigmoid, Tanh, Erf, Softplus), element-wise arithmetic (Mul, Add, Sub,
  Div, Neg, Sqrt, Reciprocal) and LayerNormalization, also O(bytes). The arithmetic
  matters for Llama-style blocks: the SiLU-gated MLP (``x * sigmoid(x) * up``) and RMSNorm
  (``x * 1/rms * w``) are products of values the backward keeps anyway (llama-tiny: a
  lower planned peak and peak RSS, the gradient graph's time unchanged; GPT-2 and BERT
  tiny: no new copies, their LayerNorm/GELU blocks are fused ops).
  Under ONNX Runtime this is where memory is won: it makes a Reshape's output an alias
  of its input and folds a weight's Transpose into its Gemms anyway, so CHEAP_VIEWS
  moves bytes only on paper (GPT-2/BERT tiny: peak RSS unchanged), while CHEAP_OPS
  lowered the gradient graph's peak RSS at some batch sizes and raised it at others
  (GPT-2 tiny, BERT-MLM tiny): ONNX Runtime's default order runs the
  whole input-gradient chain before any weight-gradient Gemm, so a copy read by both
  lives through most of the backward, and its arena's peak is not monotonic in bytes.

The copies run the same kernels on the same inputs, so numerics stay bit-identical.
Nothing random (Dropout) is ever recomputed. ONNX Runtime's common-subexpression
elimination would merge a copy back into the forward value it replaces (same op, same
inputs): sessions running these graphs must disable ``CommonSubexpressionElimination``.

Cases:

1. A kept forward value ``v = op(x, ...)`` (its node's first output: the others, like
   LayerNormalization's mean and 1/std, are small and read first by the backward) with
   ``op`` in the policy, every input alive anyway (a graph input, a constant, a graph
   output, a value the backward keeps and does not recompute), and ``v`` not a graph
   output: ``op`` is cloned right before ``v``'s first backward reader and every
   backward reader reads the clone. E.g.
   ``Transpose(W)`` of a Linear weight, ``Cast(W)`` of an fp16 weight copy,
   ``Reshape(gelu_out)`` when ``gelu_out`` is kept; with CHEAP_OPS ``Gelu(fc_out)`` and
   ``LayerNormalization(residual)``, whose inputs their own backward keeps.
2. A chain of policy ops whose start is alive anyway is cloned whole
   (``Reshape(Transpose(W))``).
3. Anything else is kept: recomputing ``Reshape(gemm_out)`` would keep ``gemm_out``
   alive instead, which saves nothing.

Clones are backward nodes: they carry ``ortrain.grad_of`` (of the reader they serve)
and ``ortrain.recompute_of`` (the forward node they copy). Returns the number of kept
values whose backward readers now read a recomputed copy.
"""

from __future__ import annotations

import enum

import onnx_ir as ir

from ortrain.graph_passes.infra.tags import GRAD_OF, RECOMPUTE_OF, is_backward

_VIEWS = frozenset(
    {
        "Cast",
        "CastLike",
        "Reshape",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "Identity",
        "Transpose",
        "Expand",
    }
)
_NORMS = frozenset({"LayerNormalization", "SimplifiedLayerNormalization"})
_ARITHMETIC = frozenset({"Mul", "Add", "Sub", "Div", "Neg", "Sqrt", "Reciprocal"})
_ACTIVATIONS = frozenset({"Gelu", "Relu", "LeakyRelu", "Elu", "Sigmoid", "Tanh", "Erf", "Softplus"})


class RecomputePolicy(enum.Enum):
    """Which forward ops the backward may redo instead of keeping their outputs."""

    NOTHING = frozenset()
    CHEAP_VIEWS = _VIEWS
    CHEAP_OPS = _VIEWS | _ACTIVATIONS | _ARITHMETIC | _NORMS

    def allows(self, node: ir.Node) -> bool:
        return node.domain in ("", "ai.onnx") and node.op_type in self.value


def _alive_anyway(v: ir.Value) -> bool:
    producer = v.producer()
    return (
        producer is None  # graph input or initializer
        or v.const_value is not None
        or producer.op_type == "Constant"
        or v.is_graph_output()
    )


class _Recompute:
    def __init__(self, graph: ir.Graph, policy: RecomputePolicy):
        self.graph = graph
        self.policy = policy
        self.kept = {
            id(v)
            for node in graph
            if not is_backward(node)
            for v in node.outputs
            if any(is_backward(u.node) for u in v.uses())
        }
        self._memo: dict[int, bool] = {}
        self.clones: dict[int, ir.Value] = {}
        self.taken = names_in(graph)

    def recomputable(self, v: ir.Value) -> bool:
        """``v`` comes from a policy op whose inputs are alive in the backward anyway."""
        if id(v) not in self._memo:
            node = v.producer()
            self._memo[id(v)] = (
                node is not None
                and not is_backward(node)
                and not _alive_anyway(v)
                and self.policy.allows(node)
                and all(x is None or self.available(x) for x in node.inputs)
            )
        return self._memo[id(v)]

    def available(self, x: ir.Value) -> bool:
        return _alive_anyway(x) or id(x) in self.kept or self.recomputable(x)

    def clone(self, v: ir.Value, anchor: ir.Node) -> ir.Value:
        """A backward copy of ``v`` (and of the recomputable chain it needs), before anchor."""
        if id(v) in self.clones:
            return self.clones[id(v)]
        if not self.recomputable(v):  # alive anyway: read it directly
            return v
        node = v.producer()
        assert node is not None
        inputs = [None if x is None else self.clone(x, anchor) for x in node.inputs]
        copy_before(self.graph, node, inputs, anchor, self.clones, self.taken)
        return self.clones[id(v)]


Names = tuple[set[str], set[str]]  # (value names, node names): two namespaces in ONNX


def names_in(graph: ir.Graph) -> Names:
    """The names of ``graph``'s values and of its nodes (``copy_before``'s ``taken``)."""
    values = {v.name for v in graph.inputs if v.name} | set(graph.initializers)
    nodes = set()
    for n in graph:
        if n.name:
            nodes.add(n.name)
        values |= {v.name for v in n.outputs if v.name}
    return values, nodes


def _fresh(base: str, taken: set[str]) -> str:
    """``base/recompute``, or ``base/recompute2``... where a node is copied twice (two
    attention layers' probabilities over one shared product)."""
    name, k = f"{base}/recompute", 1
    while name in taken:
        k += 1
        name = f"{base}/recompute{k}"
    taken.add(name)
    return name


def copy_before(
    graph: ir.Graph,
    node: ir.Node,
    inputs: list[ir.Value | None],
    anchor: ir.Node,
    clones: dict[int, ir.Value],
    taken: Names,
) -> ir.Node:
    """A backward copy of forward ``node`` reading ``inputs``, inserted before ``anchor``
    (and tagged as serving it); ``clones`` maps each original output's id to the copy's;
    ``taken``: the graph's names so far (``names_in``), the copy's added."""
    meta = dict(node.metadata_props)
    meta[GRAD_OF] = anchor.metadata_props[GRAD_OF]
    meta[RECOMPUTE_OF] = node.name or ""
    new = ir.Node(
        node.domain,
        node.op_type,
        inputs,
        attributes=[ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()],
        num_outputs=len(node.outputs),
        name=_fresh(node.name or "", taken[1]),
        metadata_props=meta,
        version=node.version,
    )
    for old, out in zip(node.outputs, new.outputs, strict=True):
        out.name = _fresh(old.name, taken[0]) if old.name else ""
        out.shape, out.type = old.shape, old.type
        clones[id(old)] = out
    graph.insert_before(anchor, new)
    return new


def recompute_cheap_values(
    model: ir.Model, policy: RecomputePolicy = RecomputePolicy.CHEAP_VIEWS
) -> int:
    """Rebuild the policy's kept forward values next to their backward readers."""
    if policy is RecomputePolicy.NOTHING:
        return 0
    graph = model.graph
    rc = _Recompute(graph, policy)
    position = {id(n): i for i, n in enumerate(graph)}
    targets = []
    for node in graph:
        if is_backward(node):
            continue
        # Only the first output: a multi-output op's others are small statistics
        # (LayerNormalization's mean and 1/std) that the backward reads first; recomputing
        # them would pull the copy to the start of the layer's backward.
        for v in node.outputs[:1]:
            if id(v) in rc.kept and rc.recomputable(v):
                readers = [u for u in v.uses() if is_backward(u.node)]
                first = min(readers, key=lambda u: position[id(u.node)]).node
                targets.append((position[id(first)], v, first, readers))
    # Earliest first reader first: a clone shared by a later value (a chain's start) is
    # then already in place before that value's readers.
    for _, v, first, readers in sorted(targets, key=lambda t: t[0]):
        copy = rc.clone(v, first)
        for use in readers:
            use.node.replace_input_with(use.idx, copy)
    return len(targets)
