"""An ordered list of named passes run by one manager that times each pass and
records node counts and the op-type histogram delta (onnxscript optimizer style)."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

import onnx_ir as ir


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[ir.Model], object]  # returns a count, a PassResult or None


@dataclasses.dataclass
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    op_delta: dict[str, int]
    note: str = ""  # why a pass changed nothing, where it can say (a fusion's closest match)

    @property
    def modified(self) -> bool:
        return self.nodes_before != self.nodes_after or bool(self.op_delta)


def op_histogram(model: ir.Model) -> collections.Counter:
    return collections.Counter(
        f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph
    )


def run_pipeline(
    model: ir.Model,
    passes: Sequence[Pass],
    after_each: Callable[[str, ir.Model], None] | None = None,
) -> list[PassRecord]:
    records = []
    for p in passes:
        before = op_histogram(model)
        t = time.perf_counter()
        p.run(model)
        seconds = time.perf_counter() - t
        after = op_histogram(model)
        delta = {k: after[k] - before[k] for k in before | after if after[k] != before[k]}
        note = getattr(p.run, "why_not", None) or ""
        records.append(
            PassRecord(p.name, seconds, sum(before.values()), sum(after.values()), delta, note)
        )
        if after_each is not None:
            after_each(p.name, model)
    return records


def format_table(records: Sequence[PassRecord]) -> str:
    lines = [
        f"{'pass':<26} {'ms':>8} {'nodes':>13}  op changes",
        "-" * 78,
    ]
    for r in records:
        delta = ", ".join(
            f"{k} {v:+d}" for k, v in sorted(r.op_delta.items(), key=lambda kv: kv[1])
        )
        lines.append(
            f"{r.name:<26} {r.seconds * 1e3:8.1f} {r.nodes_before:>5} -> {r.nodes_after:<5}  "
            f"{delta[:60] if delta else '-'}"
        )
    notes = [f"  {r.name}: {r.note}" for r in records if r.note]
    if notes:
        lines += ["", "found nothing:", *notes]
    return "\n".join(lines)
