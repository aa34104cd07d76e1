"""Graph inputs keep their names where onnx_ir's ``OutputFixPass`` renamed them.

``OutputFixPass`` puts an Identity between a graph input that is also a graph output
(a module returning its argument or a parameter as it is) and gives the Identity's
output the input's name, renaming the input ``<name>_orig``. Inputs are bound by name
(the export's roles, a segment's call arguments), so the renamed input was never fed:
ONNX Runtime refused the run ("Missing Input: in:0_orig"). Here the input takes its
name back and the Identity's output gets a fresh one; outputs are read by position.
"""

from __future__ import annotations

import onnx_ir as ir


class KeepInputNamesPass(ir.passes.InPlacePass):
    """Undo ``OutputFixPass``'s renaming of graph inputs (run right after it)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        taken = {v.name for v in graph.inputs} | set(graph.initializers)
        taken |= {o.name for n in graph for o in n.outputs}
        modified = False
        for out in graph.outputs:
            node = out.producer()
            if node is None or node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
                continue
            src = node.inputs[0]
            if src is None or not src.is_graph_input() or src.name != f"{out.name}_orig":
                continue
            base, fresh, k = out.name, f"{out.name}_out", 1
            while fresh in taken:
                fresh, k = f"{base}_out{k}", k + 1
            taken.add(fresh)
            out.name = fresh
            src.name = base
            modified = True
        return ir.passes.PassResult(model, modified)
