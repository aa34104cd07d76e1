"""What a trainer compiled its model into: ``TrainingProgram``.

A program is a list of segments and where the optimizer update runs:

1. a model that is one training graph is one segment of kind "graph" (module ""), with a
   graph per batch signature (and label-row bucket), each checked against eager;
2. a model that is not is segments of kind "compiled" (a sub-module run by its forward and
   backward graphs inside torch autograd), "split" (a module whose children were tried
   instead, its own code in eager) and "eager" (a module that runs in eager PyTorch),
   each fallback with its cause; and "cut" (a module cut at its repeated blocks by choice:
   ``segments="blocks"``, ZeRO-2); the rest of the model is eager glue;
3. ``update``: the update engine's name; "backward" runs inside the training graph,
   every other engine after the backward.

The programs that run are ``WholeProgram`` (``ortrain/whole_program.py``) and
``SegmentedProgram`` (``ortrain/segmented_program.py``); each describes itself as a
``TrainingProgram`` (``describe``). ``ORTTrainer.program`` is the trainer's current one;
``ortrain.explain`` prints it with the build log.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ProgramSegment:
    module: str  # the module's qualified name; "" for the whole model
    kind: str  # "graph" | "compiled" | "split" | "cut" | "eager"
    graphs: int = 0  # compiled graphs (one per call or batch signature)
    checked: int = 0  # of them, checked against eager so far
    cause: str = ""  # why not compiled (split, eager)


@dataclasses.dataclass(frozen=True)
class TrainingProgram:
    segments: tuple[ProgramSegment, ...]
    update: str  # the update engine ("backward": inside the training graph)

    @property
    def whole(self) -> bool:
        """The model is one training graph (no segments, no eager)."""
        return len(self.segments) == 1 and self.segments[0].kind == "graph"

    def format(self) -> str:
        rows = []
        for s in self.segments:
            name = s.module or "(the model)"
            what = f"{s.graphs} graph(s), {s.checked} checked" if s.graphs else ""
            cause = f": {s.cause}" if s.cause else ""
            rows.append(f"  {s.kind:<9} {name}{' (' + what + ')' if what else ''}{cause}")
        where = "inside the training graph" if self.update == "backward" else "after the backward"
        return "\n".join(["program:", *rows, f"  update: {self.update} ({where})"])
