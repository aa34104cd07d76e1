"""The pass contract and the runner: an ordered list of passes run by one manager that
times each pass and records node counts and the op-type delta (onnxscript optimizer style).

A pass (``Pass``) is an ``onnx_ir`` in-place pass that also says where it belongs:

- ``name``: what the build log, ``--report`` and ``ortrain explain`` call it;
- ``stage``: one of ``STAGES`` (prepare ... target), the folder its module lives in;
- ``target``: "any", or the one target it lowers for ("cpu");
- ``gate``: which option turns it on ("always", "optimize_graph", "cpu_kernels", ...);
- ``test``: the ``tests/`` file that checks it (the generated pass table lists it);
- ``on_eval``: whether it also runs on evaluation (forward-only) graphs.

``pass_(model)`` returns ``onnx_ir.passes.PassResult``; ``modified`` comes from the pass
itself: its function returns a count, a bool or a ``PassResult``, never None.

A ``SerializedPass`` works on the ``onnx.ModelProto`` handed to ONNX Runtime (node order,
kernel thread placement): it comes after every ``Pass`` of a pipeline, and the runner
serializes the model once before the first one, so those passes are timed and recorded
like the others while the ``onnx_ir`` model keeps its own order.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import onnx
import onnx_ir as ir
import onnx_ir.passes

from ortrain.core.errors import OrtrainError, PassError, deepest_cause
from ortrain.core.names import GradientError, UpdateInBackwardError

Stage = Literal[
    "prepare", "cleanup", "fusions", "precision", "autodiff", "training", "memory", "target"
]
STAGES: tuple[str, ...] = (
    "prepare", "cleanup", "fusions", "precision", "autodiff", "training", "memory", "target",
)  # fmt: skip
TARGETS: tuple[str, ...] = ("any", "cpu")


def _modified(name: str, out: object) -> bool:
    """A pass function's own account of whether it changed the model."""
    if isinstance(out, ir.passes.PassResult):
        return out.modified
    if isinstance(out, bool):
        return out
    if isinstance(out, int):
        return out > 0
    raise TypeError(
        f"pass {name!r} returned {type(out).__name__}: a pass returns a count, a bool or a "
        "PassResult"
    )


class _Described:
    """The description every pipeline entry carries (the pass table's columns)."""

    def __init__(
        self,
        name: str,
        run: Callable[[Any], object],
        *,
        stage: Stage,
        test: str,
        gate: str = "always",
        target: str = "any",
        on_eval: bool = False,
        impl: object | None = None,
    ) -> None:
        if stage not in STAGES:
            raise ValueError(f"pass {name!r}: stage {stage!r} is not one of {STAGES}")
        if target not in TARGETS:
            raise ValueError(f"pass {name!r}: target {target!r} is not one of {TARGETS}")
        self.name = name
        self.run = run
        self.stage = stage
        self.test = test
        self.gate = gate
        self.target = target
        self.on_eval = on_eval
        # what implements the pass (a function, or the pass object) when ``run`` is a
        # wrapper that hands it the build's inputs: its module is the table's
        self.impl = impl if impl is not None else run

    @property
    def module(self) -> str:
        """The module that implements the pass."""
        return getattr(self.impl, "__module__", None) or type(self.impl).__module__

    @property
    def why_not(self) -> str:
        """Why a pass changed nothing, where it can say (a fusion's closest match)."""
        return getattr(self.run, "why_not", None) or ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, stage={self.stage!r}, gate={self.gate!r})"


class Pass(_Described, ir.passes.InPlacePass):
    """One pass over the ``onnx_ir`` model (see the module docstring)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, _modified(self.name, self.run(model)))


@dataclasses.dataclass
class SerializedResult:
    model: onnx.ModelProto
    modified: bool


class SerializedPass(_Described):
    """One pass over the serialized model handed to ONNX Runtime; ``run`` takes its
    ``GraphProto``, changes it in place and returns a count or a bool."""

    def __call__(self, model: onnx.ModelProto) -> SerializedResult:
        return SerializedResult(model, _modified(self.name, self.run(model.graph)))


AnyPass = Pass | SerializedPass


@dataclasses.dataclass
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    op_delta: dict[str, int]
    note: str = ""  # why a pass changed nothing, where it can say (a fusion's closest match)
    modified: bool = False  # what the pass says


def op_histogram(model: ir.Model | onnx.ModelProto) -> collections.Counter:
    nodes = model.graph.node if isinstance(model, onnx.ModelProto) else model.graph
    return collections.Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in nodes)


def run_pipeline(
    model: ir.Model,
    passes: Sequence[AnyPass],
    after_each: Callable[[str, ir.Model | onnx.ModelProto], None] | None = None,
    serialize: Callable[[ir.Model], onnx.ModelProto] = ir.serde.serialize_model,
) -> list[PassRecord]:
    """Run ``passes`` in order and record each. ``serialize`` makes the proto the
    ``SerializedPass`` entries work on (once, before the first of them); a caller that
    needs that proto passes a ``serialize`` that keeps it."""
    records = []
    proto: onnx.ModelProto | None = None
    for p in passes:
        if isinstance(p, SerializedPass):
            if proto is None:
                proto = serialize(model)
            target: ir.Model | onnx.ModelProto = proto
        elif proto is not None:
            raise ValueError(f"pass {p.name!r} runs on the onnx_ir model after a serialized pass")
        else:
            target = model
        before = op_histogram(target)
        t = time.perf_counter()
        try:
            result = p(target)
        except (GradientError, UpdateInBackwardError, OrtrainError):
            raise  # the model's own refusals, said as they are
        except Exception as exc:
            raise PassError(f"graph pass {p.name!r} failed: {deepest_cause(exc)}") from exc
        seconds = time.perf_counter() - t
        after = op_histogram(target)
        delta = {k: after[k] - before[k] for k in before | after if after[k] != before[k]}
        records.append(
            PassRecord(
                p.name,
                seconds,
                sum(before.values()),
                sum(after.values()),
                delta,
                p.why_not,
                result.modified,
            )
        )
        if after_each is not None:
            after_each(p.name, target)
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
