"""A recomputed GELU taken from its gradient kernel: ``GeluGrad(dY, X) -> dX, Y``.

The recompute pass makes an MLP's GELU output again in the backward, where the next
layer's weight gradient reads it (``dW2 = gelu(X)^T @ dY``), instead of keeping it from
the forward: a full pass over X per layer. The GELU's own backward
(``ortrain.cpu.GeluGrad`` / ``FastGeluGrad``, ``ortrain/runtime/grad_kernels.c``) reads
the same X and computes the GELU on the way to its slope, so it writes it as a second
output for free; the copy goes. The weight gradient then waits for the GELU backward,
which needs only ``dW2``'s sibling ``dX2 = dY @ W2^T``: no cycle, checked per pair.

The kernel's GELU is ortrain's evaluation, not ONNX Runtime's (a few float32 roundoffs
apart, as two GELU implementations are), so this is a kernel choice made with the
others, last, on CPU builds with ortrain's kernel library. Rewritten: a standard
``Gelu`` tagged ``ortrain.recompute_of`` whose input X is also the X of a one-output
``GeluGrad`` (``approximate="none"``) or ``FastGeluGrad`` (``"tanh"``) that does not
depend on the copy.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.infra.tags import RECOMPUTE_OF

_STD = ("", "ai.onnx")
_KERNEL = {"none": "GeluGrad", "tanh": "FastGeluGrad"}


def take_gelu_values(model: ir.Model) -> int:
    """Returns the number of recomputed GELUs replaced by a kernel's second output."""
    graph = model.graph
    kernels: dict[ir.Value, list[ir.Node]] = {}
    for node in graph:
        if node.domain == CPU_DOMAIN and node.op_type in _KERNEL.values():
            if len(node.inputs) == 2 and node.inputs[1] is not None:
                kernels.setdefault(node.inputs[1], []).append(node)
    count = 0
    for copy in list(graph):
        if copy.op_type != "Gelu" or copy.domain not in _STD or copy.inputs[0] is None:
            continue
        if RECOMPUTE_OF not in copy.metadata_props:
            continue
        approximate = copy.attributes.get("approximate")
        want = _KERNEL.get(approximate.value if approximate is not None else "none")
        for kernel in kernels.get(copy.inputs[0], []):
            if kernel.op_type == want and len(kernel.outputs) == 1:
                if not _reaches(copy, kernel):
                    _take(graph, copy, kernel)
                    count += 1
                    break
    if count:
        graph.sort()  # the weight gradients now come after the kernels they read
    return count


def _take(graph: ir.Graph, copy: ir.Node, kernel: ir.Node) -> None:
    old = copy.outputs[0]
    kernel.resize_outputs(2)
    new = kernel.outputs[1]
    new.type, new.shape = old.type, old.shape
    old.replace_all_uses_with(new)
    graph.remove(copy, safe=True)
    new.name = old.name


def _reaches(start: ir.Node, target: ir.Node) -> bool:
    """Whether ``target`` reads, directly or not, an output of ``start``."""
    seen: set[ir.Node] = set()
    stack = [target]
    while stack:
        node = stack.pop()
        for v in node.inputs:
            producer = v.producer() if v is not None else None
            if producer is start:
                return True
            if producer is not None and producer not in seen:
                seen.add(producer)
                stack.append(producer)
    return False
