"""`ortrain.explain(trainer)`: the build stages of a trainer's graphs as a table."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ortrain.trainer import ORTTrainer


def explain(trainer: ORTTrainer) -> str:
    """Per stage: graph, time, node count before/after (export has no 'before')."""
    rows = [f"{'graph':<6} {'stage':<22} {'ms':>9} {'nodes':>15}", "-" * 56]
    for r in trainer.build_log:
        nodes = (
            f"{r.nodes_after}" if r.stage == "export" else f"{r.nodes_before} -> {r.nodes_after}"
        )
        rows.append(f"{r.graph:<6} {r.stage:<22} {r.seconds * 1e3:9.1f} {nodes:>15}")
    if not trainer.build_log:
        rows.append("(nothing built yet: call train_step or eval_step first)")
    return "\n".join(rows)
