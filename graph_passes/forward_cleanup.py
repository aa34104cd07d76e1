"""Forward cleanup before autodiff: constant folding, CSE and dead-code removal.

onnxscript's optimizer does all three (with its default no-op rewrites: identity
Reshape/Cast/Expand, collapsed Slices): constant subexpressions the exporter left
(shape arithmetic, causal masks built from ``arange``) become initializers, so autodiff
never sees them. Parameters are graph inputs, never initializers, so no weight is
folded into a constant. The size limits keep big constants computed: folding a
[seq, seq] mask is fine, folding a broadcast [batch, heads, seq, seq] one would add
megabytes to the model.

Run it after ``seed_dropouts``: every Dropout then carries its own seed, so CSE cannot
merge two independent Dropouts that read one input.
"""

from __future__ import annotations

import onnx_ir as ir
import onnxscript.optimizer

FOLD_INPUT_LIMIT = 8192  # elements: larger constant inputs are not folded
FOLD_OUTPUT_LIMIT = 1 << 20  # elements: folded results larger than this are not kept


def clean_forward(model: ir.Model) -> None:
    unseeded = [
        n.name for n in model.graph if n.op_type == "Dropout" and "seed" not in n.attributes
    ]
    if unseeded:
        raise ValueError(
            f"clean_forward: Dropout nodes {unseeded[:3]} have no seed; run seed_dropouts "
            "first or CSE may merge independent masks"
        )
    onnxscript.optimizer.optimize(
        model, input_size_limit=FOLD_INPUT_LIMIT, output_size_limit=FOLD_OUTPUT_LIMIT
    )
