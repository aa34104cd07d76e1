"""A trainer's evaluation: the model in eval mode, forward only, no update (``Evaluation``).

Each batch signature gets an evaluation graph (``WholeGraphs.build_eval``: from the
training export of that signature where its first run agrees with eager and it draws
nothing but Dropout's masks, else from an export in evaluation mode), bound by role
(``runtime/binder.bind_eval_graph``). Its first
run is checked against eager; a signature whose graph cannot be built or disagrees runs
in eager from then on (fallback "auto", with a warning) or raises (fallback "off"). Under
ZeRO-3 evaluation runs in eager with the parameters gathered, and so does a model whose
parameters are not float32 (``param_dtypes.py``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ortrain.core.errors import ExportError, PassError, VerificationError, first_line
from ortrain.core.names import GradientError
from ortrain.program_context import ProgramContext
from ortrain.python_state import describe
from ortrain.runtime.binder import bind_eval_graph
from ortrain.step_errors import from_onnxruntime, run_failed
from ortrain.verify import Tolerance, compare, report
from ortrain.whole_graph import CompiledGraph, signature


class Evaluation:
    def __init__(self, ctx: ProgramContext):
        self.ctx = ctx
        self.in_eager: set[tuple] = set()  # signatures whose graph failed or disagreed
        self.autocast_said: set[tuple] = set()  # signatures evaluated under autocast

    def outputs(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The model's outputs on ``batch`` by key (host tensors)."""
        ctx = self.ctx
        materialized = getattr(ctx.reducer, "materialized", None)
        if materialized is not None:  # ZeRO-3: eager, its parameters gathered meanwhile
            with materialized():
                return ctx.eager.outputs(batch)
        if ctx.dtype_cause:  # parameters other than float32: the model runs in eager
            return ctx.eager.outputs(batch)
        sig = signature(batch)
        device = ctx.device.type
        if torch.is_autocast_enabled(device):  # eager computes in autocast's dtypes
            if sig not in self.in_eager | self.autocast_said:
                self._in_eager(
                    sig,
                    f"eval_step runs inside torch.autocast({device!r}, "
                    f"{torch.get_autocast_dtype(device)}), whose casts a graph does not make",
                    keep=False,
                )
            return ctx.eager.outputs(batch)
        if ctx.eager.stateful and sig not in self.in_eager:  # a graph would freeze them
            said = describe(ctx.eager.stateful, type(ctx.module).__name__)
            self._in_eager(sig, f"its forward changes Python attributes on every call ({said})")
        if sig in self.in_eager:
            return ctx.eager.outputs(batch)
        with ctx.on_stream():
            try:
                compiled = self._graph(batch)
            except Exception as exc:
                refused = from_onnxruntime(exc)  # a kernel it lacks for these types
                if ctx.options.fallback == "off" or not (
                    refused or isinstance(exc, (ExportError, GradientError, PassError))
                ):
                    raise
                said = "ONNX Runtime refused the graph" if refused else type(exc).__name__
                self._in_eager(sig, f"{said}: {first_line(exc)}")
                return ctx.eager.outputs(batch)
            keep = compiled.bind_batch(batch, ctx.device)
            try:
                compiled.session.run()
            except Exception as exc:
                raise run_failed("eval", batch, exc) from exc
            del keep
        outputs = compiled.host_outputs()
        if ctx.options.verify and not compiled.verified:
            want = ctx.eager.outputs(batch, check=True)
            bad = compare(outputs, want, Tolerance.of(ctx.options.mixed_precision).loss)
            if bad and compiled.graph.from_training_export:
                # the model computes otherwise in evaluation mode (BatchNorm's running
                # statistics, ``if self.training``): its own export, checked in turn
                self._graph(batch, fresh=True)
                return self.outputs(batch)
            if bad:
                text = report(f"{type(ctx.module).__name__}'s evaluation graph", bad)
                if ctx.options.fallback == "off":
                    raise VerificationError(text)
                ctx.graphs.eval.pop(sig, None)
                self._in_eager(sig, text)
                outputs = want
            compiled.verified = True
        return outputs

    def _graph(self, batch: dict[str, Any], fresh: bool = False) -> CompiledGraph:
        """``batch``'s evaluation graph (``WholeGraphs.build_eval``), bound by role."""
        ctx = self.ctx
        if not fresh:
            compiled = ctx.graphs.eval.get(signature(batch))
            if compiled is not None:
                return compiled
        built = ctx.graphs.build_eval(
            batch, ctx.settings(), checked=ctx.options.verify, fresh=fresh
        )
        with ctx.graph_cache.session_stage("eval"):
            session = ctx.session(built)
        bind_eval_graph(session, built, ctx.state)
        compiled = CompiledGraph.of(session, built, batch)
        ctx.graphs.add_eval(batch, compiled)
        return compiled

    def _in_eager(self, sig: tuple, cause: str, keep: bool = True) -> None:
        """Warn that ``sig``'s evaluation runs in eager; ``keep``: from now on (else the
        warning is said once and the next call outside the cause builds its graph)."""
        (self.in_eager if keep else self.autocast_said).add(sig)
        warnings.warn(
            f"ortrain: {type(self.ctx.module).__name__}'s evaluation runs in eager PyTorch for "
            f"this batch shape: {cause}",
            stacklevel=5,
        )


class StepOutputs(dict):
    """eval_step's result: a dict of tensors that also allows ``outputs.loss``."""

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc
