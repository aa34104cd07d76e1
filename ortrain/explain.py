"""`ortrain.explain(trainer)`: the build passes of a trainer's graphs as a table."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ortrain.trainer import ORTTrainer


def explain(trainer: ORTTrainer) -> str:
    """The trainer's program (one graph, or segments with their fallbacks and time), the
    first-step checks against eager, then per pass: graph, time, node count before/after
    (export has no 'before') and the op-type changes it made."""
    head = [trainer.program.format()]
    if trainer.segments is not None:
        head.append(trainer.segments.explain())
    head.append(_build_time(trainer))
    if times := trainer.speed_choices:
        head.append("graph against eager (TrainerOptions.eager_if_faster):\n" + times)
    rows = [*head, "", f"{'graph':<6} {'stage':<22} {'ms':>9} {'nodes':>15}  op changes"]
    rows.append("-" * 90)
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


def _build_time(trainer: ORTTrainer) -> str:
    """Where the builds' time went, by stage: what a first step costs beyond a step."""
    stages = {"export": 0.0, "passes": 0.0, "cache": 0.0}
    for r in trainer.build_log:
        key = r.stage if r.stage in ("export", "cache") else "passes"
        stages[key] += r.seconds
    sessions = trainer.session_seconds
    parts = [f"{k} {v:.2f} s" for k, v in stages.items() if v]
    parts += [f"sessions {sessions:.2f} s", f"checks against eager {trainer.verify_seconds:.2f} s"]
    if trainer.options.background_build:  # what those builds cost the steps instead
        parts.append(f"built in the background, {trainer.eager_steps} step(s) in eager meanwhile")
    text = "build time: " + ", ".join(parts)
    deferred = trainer.deferred_builds
    if deferred:  # shapes whose steps ran in eager rather than wait for a build
        text += "\nshapes stepped in eager until a build would pay:\n" + deferred
    return text
