"""Export one call of a sub-module to an ONNX forward graph (a segment's forward).

Graph inputs: the sub-module's parameters and buffers (named as in its own
``named_parameters()`` / ``named_buffers()``), then the call's tensors ``in:<k>``; graph
outputs: the tensors of its result ``out:<k>`` (then ``updated:<buffer>`` for buffers a
training forward writes). The call's other arguments are constants of the graph.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ortrain.core.errors import ExportError
from ortrain.core.roles import GraphIO, Role
from ortrain.export import _SharedList, trace_to_onnx
from ortrain.segments.calls import Call, Result

if TYPE_CHECKING:
    import onnx_ir as ir


def input_name(k: int) -> str:
    return f"in:{k}"


def output_name(k: int) -> str:
    return f"out:{k}"


class _Segment(torch.nn.Module):
    """forward(*params, *tensors) -> the call's result tensors, through functional_call."""

    def __init__(self, module: torch.nn.Module, pnames: list[str], call: Call):
        super().__init__()
        self.module = module
        self.pnames = pnames
        self.call = call
        # the traced result's structure, set while tracing (survives the exporter's copy)
        self.results: list[Result] = _SharedList()

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(self.pnames)
        args, kwargs = self.call.with_tensors(list(flat[n:]))
        state = dict(zip(self.pnames, flat[:n]))
        out = torch.func.functional_call(self.module, state, args, kwargs, tie_weights=True)
        result = Result.of(out)
        self.results[:] = [result]
        tensors = result.tensors(out)
        if not tensors:
            raise ExportError("the module returns no tensor")
        return tuple(tensors)


@dataclasses.dataclass
class ExportedSegment:
    model: ir.Model
    io: list[GraphIO]  # graph inputs with roles, then the buffer updates
    outputs: list[str]  # ``out:<k>``
    result: Result


def export_segment(module: torch.nn.Module, call: Call, train: bool) -> ExportedSegment:
    """The forward graph of ``module(*call)``; raises ``ExportError`` where the exporter
    cannot trace it."""
    pnames = [n for n, _ in module.named_parameters()]
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    for t in call.tensors:  # one graph input per argument, also where a tensor repeats
        tensors.append(t.detach().clone() if id(t) in seen else t.detach())
        seen.add(id(t))
    wrapper = _Segment(module, pnames, call)
    names = [input_name(k) for k in range(len(tensors))]
    traced = trace_to_onnx(module, wrapper, tensors, names, train)
    if not wrapper.results:
        raise ExportError(f"{type(module).__name__}: the export did not run the forward")
    result = wrapper.results[0]
    graph = traced.model.graph
    outputs = []
    for k, v in enumerate(graph.outputs[: len(traced.outputs)]):
        v.name = output_name(k)
        outputs.append(v.name)
    io = traced.roles(names, Role.SEGMENT_INPUT)
    io += [GraphIO(o, Role.SEGMENT_OUTPUT) for o in outputs]
    return ExportedSegment(traced.model, io, outputs, result)
