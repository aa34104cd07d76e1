"""A segment's build job: export one call, run the training pipeline seeded by the
outputs' gradients, split the result into a forward and a backward graph.

Like ``ortrain/build.py``'s jobs it returns serialized graphs and records, so it can run
in a forked child; the graph libraries are imported inside it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection
from typing import Any

import torch

from ortrain.core.build_config import BuildConfig, BuildInputs
from ortrain.core.names import BLAS_DOMAIN, CPU_DOMAIN, DROPOUT_OPS, DROPOUT_SWITCH_INPUT
from ortrain.core.roles import GraphIO, Role
from ortrain.segments.calls import Call, Result

GRAD_PREFIX = "grad:"


def seed_name(output: str) -> str:
    """The backward graph's input holding the gradient of forward output ``output``."""
    return f"seed:{output}"


@dataclasses.dataclass
class GraphBytes:
    """One of a segment's two graphs, as ONNX Runtime takes it."""

    data: bytes
    recomputes: bool
    inputs: list[GraphIO]  # every graph input, with its role
    outputs: list[GraphIO]
    blas_gemm: bool
    cpu_kernels: bool
    # output name -> (shape, dtype name): outputs are allocated by the runner
    output_types: dict[str, tuple[tuple[int, ...] | None, str]]
    planned_peak_bytes: int = 0  # what ``make_session`` sizes the CPU arena by
    # random ops no switch fixes (``prepare/random_switch.py``): no check can compare them
    draws: tuple[str, ...] = ()
    dropouts: int = 0  # the Dropouts it draws (the check compares eager's count)
    wrong_optimizers: tuple[str, ...] = ()  # ``session.optimizers_to_disable``

    @property
    def ort_data(self) -> bytes:
        return self.data


@dataclasses.dataclass
class SegmentGraphs:
    """A compiled segment call: its forward and backward graphs and their manifest."""

    forward: GraphBytes
    backward: GraphBytes
    result: Result
    saved: list[str]
    grads: dict[str, str]  # parameter / ``in:<k>`` -> the backward output holding its gradient
    seconds: dict[str, float]  # export, passes, split
    nodes: tuple[int, int]  # forward, backward node counts
    # the backward whose embedding rows add into a gradient already made (``accumulate.py``)
    # and its inputs for them: parameter -> ``acc:`` input name (bound to that gradient)
    backward_acc: GraphBytes | None = None
    accumulators: dict[str, str] = dataclasses.field(default_factory=dict)
    # the backward whose embedding rows are outputs, not a table (ZeRO-2/3 add them into
    # their shard): parameter -> (rows output, updates output)
    backward_rows: GraphBytes | None = None
    row_outputs: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    # the backward whose weight gradients of parameters another module shares (a tied LM
    # head's) are output as their product's two factors: parameter -> (left, right)
    backward_factored: GraphBytes | None = None
    factor_outputs: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    # the call's complex tensors (by position): the graphs take and give their real views
    complex_inputs: tuple[int, ...] = ()


def _is_float(dtype: Any) -> bool:
    return dtype is not None and dtype.is_floating_point()


def _dtype_name(dtype: Any) -> str:
    return dtype.name if dtype is not None else "?"


def _graph_bytes(model: Any, roles: dict[str, GraphIO]) -> GraphBytes:
    from ortrain.graph_passes.infra.serialize import serialize_for_ort
    from ortrain.graph_passes.prepare.random_switch import uncentred_draws
    from ortrain.runtime.session import optimizers_to_disable, random_nodes

    drawn = [op for op, _ in random_nodes(model)]
    draws = tuple(sorted(set(uncentred_draws(model))))
    data, recomputes = serialize_for_ort(model)
    inputs = [roles.get(v.name, GraphIO(v.name, Role.SAVED)) for v in model.graph.inputs]
    outputs = [roles.get(v.name, GraphIO(v.name, Role.SAVED)) for v in model.graph.outputs]
    types = {}
    for v in model.graph.outputs:
        dims = None
        if v.shape is not None and all(isinstance(d, int) for d in v.shape.dims):
            dims = tuple(int(d) for d in v.shape.dims)
        types[v.name] = (dims, _dtype_name(v.dtype))
    return GraphBytes(
        data,
        recomputes,
        inputs,
        outputs,
        BLAS_DOMAIN in model.opset_imports,
        CPU_DOMAIN in model.opset_imports,
        types,
        draws=draws,
        dropouts=sum(op in DROPOUT_OPS for op in drawn),
        wrong_optimizers=optimizers_to_disable(model),
    )


def build_segment(
    module: torch.nn.Module,
    call: Call,
    train: bool,
    config: BuildConfig,
    shared: Collection[str] = (),
) -> SegmentGraphs:
    """The compiled graphs of ``module(*call)`` (raises ``ExportError`` / ``GradientError``
    where it cannot be compiled); ``shared``: its parameters another module holds too
    (their gradients get a factored variant)."""
    from ortrain.graph_passes.infra.pipeline import SerializedPass, run_pipeline
    from ortrain.graph_passes.training_pipeline import BuildProducts, build_pipeline
    from ortrain.segments.accumulate import accumulating_variant, rows_variant
    from ortrain.segments.export import export_segment
    from ortrain.segments.factored import factored_variant
    from ortrain.segments.split import split_forward_backward

    seconds = {}
    t = time.perf_counter()
    ex = export_segment(module, call, train)
    seconds["export"] = time.perf_counter() - t
    model = ex.model
    graph_inputs = {v.name for v in model.graph.inputs}
    wants_grad = [
        r.name
        for r in ex.io
        if r.role is Role.PARAMETER
        or (r.role is Role.SEGMENT_INPUT and call.tensors[int(r.name[3:])].requires_grad)
    ]
    wants_grad = [n for n in wants_grad if n in graph_inputs]
    outputs = {v.name: v for v in model.graph.outputs}
    floats = [o for o in ex.outputs if _is_float(outputs[o].dtype)]
    seeds = {o: seed_name(o) for o in floats}
    inputs = BuildInputs(loss="", wrt=tuple(wants_grad), seeds=seeds)
    products = BuildProducts()
    passes = build_pipeline(config, inputs, products)
    passes = [p for p in passes if not isinstance(p, SerializedPass)]  # per side, below
    t = time.perf_counter()
    run_pipeline(model, passes)
    seconds["passes"] = time.perf_counter() - t
    grads = dict(products.grad_outputs())
    updated = [r for r in ex.io if r.role is Role.UPDATED_BUFFER]
    t = time.perf_counter()
    split = split_forward_backward(
        model, [*ex.outputs, *[r.name for r in updated]], list(grads.values())
    )
    seconds["split"] = time.perf_counter() - t
    roles = {r.name: r for r in ex.io}
    roles.update({s: GraphIO(s, Role.OUTPUT_GRADIENT, of=o) for o, s in seeds.items()})
    for p, g in grads.items():
        kind = Role.INPUT_GRADIENT if p.startswith("in:") else Role.GRADIENT
        roles[g] = GraphIO(g, kind, of=p)
    roles[DROPOUT_SWITCH_INPUT] = GraphIO(DROPOUT_SWITCH_INPUT, Role.DROPOUT_SWITCH)
    fwd = _graph_bytes(split.forward, roles)
    bwd = _graph_bytes(split.backward, roles)
    graphs = SegmentGraphs(
        fwd,
        bwd,
        ex.result,
        split.saved,
        grads,
        seconds,
        (len(split.forward.graph), len(split.backward.graph)),
        complex_inputs=tuple(k for k, t in enumerate(call.tensors) if t.is_complex()),
    )
    variant = accumulating_variant(split.backward, grads)
    if variant is not None:
        model_acc, graphs.accumulators = variant
        for p, name in graphs.accumulators.items():
            roles[name] = GraphIO(name, Role.ACCUMULATOR, of=p)
        graphs.backward_acc = _graph_bytes(model_acc, roles)
    as_rows = rows_variant(split.backward, grads)
    if as_rows is not None:
        model_rows, graphs.row_outputs = as_rows
        for p, (rows, updates) in graphs.row_outputs.items():
            roles[rows] = GraphIO(rows, Role.ROW_INDICES, of=p)
            roles[updates] = GraphIO(updates, Role.ROW_UPDATES, of=p)
        graphs.backward_rows = _graph_bytes(model_rows, roles)
    as_factors = factored_variant(split.backward, grads, shared) if shared else None
    if as_factors is not None:
        model_factored, graphs.factor_outputs = as_factors
        for p, (left, right) in graphs.factor_outputs.items():
            roles[left] = GraphIO(left, Role.FACTOR_LEFT, of=p)
            roles[right] = GraphIO(right, Role.FACTOR_RIGHT, of=p)
        graphs.backward_factored = _graph_bytes(model_factored, roles)
    return graphs
