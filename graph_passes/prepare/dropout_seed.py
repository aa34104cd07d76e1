"""Give every Dropout node its own seed derived from the run's seed.

ONNX Runtime's Dropout kernel keeps a generator seeded from the ``seed`` attribute and
advances it every run, so each step draws new masks and two runs with the same seed
draw the same sequence. Nodes that already carry a seed keep it.
"""

from __future__ import annotations

import onnx_ir as ir


def seed_dropouts(model: ir.Model, seed: int) -> int:
    """Returns the number of Dropout nodes seeded."""
    count = 0
    for i, node in enumerate(model.graph):
        if node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            if "seed" not in node.attributes:
                value = (seed * 1_000_003 + i * 7919) % (2**31 - 1)
                node.attributes["seed"] = ir.AttrInt64("seed", value)
                count += 1
    return count
