"""Gradient accumulation in the gradient graph: ``grad:p = acc:p + micro-batch grad``.

The runtime binds ``acc:p`` and ``grad:p`` to the same buffer, so accumulation is in
place; the only reader of ``acc:p`` is the Add that overwrites it.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx_ir as ir

from ortrain.graph_passes.infra.emitter import Emitter


def accumulate_gradients(model: ir.Model, grad_outputs: Mapping[str, str]) -> dict[str, str]:
    """Returns {accumulator input name: gradient output name it aliases}."""
    graph = model.graph
    em = Emitter(graph, "accumulate")
    by_name = {v.name: (i, v) for i, v in enumerate(graph.outputs)}
    aliases = {}
    for param, out_name in grad_outputs.items():
        idx, g = by_name[out_name]
        acc = ir.Value(name=f"acc:{param}", shape=g.shape, type=ir.TensorType(g.dtype))
        graph.inputs.append(acc)
        g.name = f"{out_name}/micro"
        total = em.op("Add", acc, g, shape=g.shape, dtype=g.dtype)
        total.name = out_name
        graph.outputs[idx] = total
        aliases[acc.name] = out_name
    em.flush_before(None)
    return aliases
