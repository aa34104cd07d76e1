"""`ortrain.explain(trainer)`: the build passes of a trainer's graphs as a table."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ortrain.trainer import ORTTrainer


def explain(trainer: ORTTrainer) -> str:
    """Per pass: graph, time, node count before/after (export has no 'before') and the
    op-type changes it made."""
    rows = [f"{'graph':<6} {'stage':<22} {'ms':>9} {'nodes':>15}  op changes", "-" * 90]
    for r in trainer.build_log:
        nodes = (
            f"{r.nodes_after}" if r.stage == "export" else f"{r.nodes_before} -> {r.nodes_after}"
        )
        delta = ", ".join(
            f"{k} {v:+d}" for k, v in sorted(r.op_delta.items(), key=lambda kv: (kv[1], kv[0]))
        )
        rows.append(
            f"{r.graph:<6} {r.stage:<22} {r.seconds * 1e3:9.1f} {nodes:>15}  "
            f"{(delta[:70] + '...' if len(delta) > 70 else delta) or '-'}"
        )
    if not trainer.build_log:
        rows.append("(nothing built yet: call train_step or eval_step first)")
    return "\n".join(rows)
