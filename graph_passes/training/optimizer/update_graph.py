"""The update graph: gradients in, parameters and optimizer state updated in place.

Inputs: each trained parameter, its (accumulated) gradient and optimizer state, the
per-group hyperparameters, the step counter, the gradient scale (1 / accumulation
steps) and, with clipping, ``max_grad_norm``. Outputs: the new parameter/state values,
each meant to be bound to the same buffer as its input (``aliases``), the new step,
and, with clipping, the global gradient norm. ``check_inplace_safe`` proves that binding is sound.

With clipping and ``global_sq_norm_input``, the global squared gradient norm is an
input (``global_sq_norm``) instead of being computed from the graph's own gradients:
ZeRO-1 (``graph_passes/training/zero.py``) sums the shards' partial sums across ranks first.

With ``skip_nonfinite`` (loss scaling), the graph checks that the gradients' sum of
squares is finite (NaN and Inf propagate into it) and writes every aliased output
through ``Where(grads_finite, new, old)``: on overflow parameters, optimizer state and
the step keep their bit patterns. ``grads_finite`` is an output for the loss scaler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import onnx_ir as ir

from ortrain.core.names import state_key
from ortrain.core.optimizer_spec import OptimizerSpec
from ortrain.core.roles import GraphIO, Role
from ortrain.graph_passes.infra.emitter import Emitter
from ortrain.graph_passes.training.optimizer import adam, clip, lamb, sgd

F = ir.DataType.FLOAT


@dataclasses.dataclass
class UpdateGraph:
    model: ir.Model
    io: list[GraphIO]  # inputs, in order
    outputs: list[GraphIO]
    aliases: dict[str, str]  # output name -> input name whose buffer it overwrites


def _scalar(name: str) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape([]), type=ir.TensorType(F))


def build_update_graph(
    spec: OptimizerSpec,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    clip_grad_norm: bool,
    global_sq_norm_input: bool = False,
    skip_nonfinite: bool = False,
) -> UpdateGraph:
    """``shapes``: the parameters that receive gradients (others are skipped, as torch does)."""
    graph = ir.Graph([], [], nodes=[], name=f"{spec.kind}_update", opset_imports={"": 20})
    em = Emitter(graph, "update")
    io: list[GraphIO] = []
    outs: list[GraphIO] = []
    aliases: dict[str, str] = {}

    input_index: dict[str, int] = {}
    finite: ir.Value | None = None

    def add_input(name: str, role: Role, shape=(), of: str | None = None) -> ir.Value:
        v = ir.Value(name=name, shape=ir.Shape(list(shape)), type=ir.TensorType(F))
        input_index[name] = len(graph.inputs)
        graph.inputs.append(v)
        io.append(GraphIO(name, role, of))
        return v

    def add_output(v: ir.Value, name: str, role: Role, of: str | None = None, alias=None):
        if finite is not None and alias is not None:  # overflow: keep the old value
            v = em.op("Where", finite, v, graph.inputs[input_index[alias]], shape=v.shape)
        if v.is_graph_input() or v.is_graph_output():
            v = em.op("Identity", v)
        v.name = name
        graph.outputs.append(v)
        outs.append(GraphIO(name, role, of))
        if alias is not None:
            aliases[name] = alias

    step = add_input("step", Role.STEP)
    grad_scale = add_input("grad_scale", Role.GRAD_SCALE)
    max_norm = add_input("max_grad_norm", Role.CLIP) if clip_grad_norm else None
    sq_norm = add_input("global_sq_norm", Role.CLIP) if global_sq_norm_input else None
    trained = [(gi, p) for gi, g in enumerate(spec.groups) for p in g.params if p in shapes]
    params, grads, states = {}, {}, {}
    for gi, p in trained:
        params[p] = add_input(p, Role.PARAMETER, shapes[p])
        grads[p] = add_input(f"grad:{p}", Role.GRADIENT, shapes[p], of=p)
        states[p] = {
            s: add_input(state_key(s, p), Role.OPTIMIZER_STATE, shapes[p], of=p)
            for s in spec.state_names(spec.groups[gi])
        }
    hps = [
        {h: add_input(f"group{gi}.{h}", Role.HYPERPARAMETER) for h in spec.hyperparameters}
        for gi in range(len(spec.groups))
    ]

    step_new = em.op("Add", step, em.const(1.0, F), shape=())
    # One scalar carries the mean over micro-steps/ranks and the clipping coefficient;
    # AdamW folds it into its moment coefficients instead of a pass over every gradient.
    gscale = grad_scale
    norm = None
    if max_norm is not None and sq_norm is not None:  # ZeRO-1: summed over ranks outside
        norm = em.op("Sqrt", sq_norm, shape=(), name_hint="global_norm")
    elif max_norm is not None and trained:  # ||s g|| = s ||g|| for the scale s > 0
        raw = clip.global_norm(em, [grads[p] for _, p in trained])
        norm = em.op("Mul", raw, grad_scale, shape=(), name_hint="global_norm")
    if norm is not None and trained:
        coef = clip.clip_coefficient(em, norm, max_norm)
        gscale = em.op("Mul", grad_scale, coef, shape=())
    if skip_nonfinite and trained:
        total = sq_norm if sq_norm is not None else (raw if norm is not None else None)
        if total is None:
            total = clip.global_norm(em, [grads[p] for _, p in trained])
        bad = em.op("Or", em.op("IsNaN", total), em.op("IsInf", total))
        finite = em.op("Not", bad, shape=(), name_hint="grads_finite")
    folds = spec.kind == "adamw"
    scaled = {p: grads[p] if folds else em.op("Mul", grads[p], gscale) for _, p in trained}

    module = {"adam": adam, "adamw": adam, "sgd": sgd, "lamb": lamb}[spec.kind]
    group_sc = {}
    for gi, _ in enumerate(spec.groups):
        if any(p in shapes for p in spec.groups[gi].params):
            group_sc[gi] = module.group_scalars(em, hps[gi], step_new)
            if folds:
                group_sc[gi].update(adam.fold_grad_scale(em, group_sc[gi], hps[gi], gscale))
    for gi, p in trained:
        group = spec.groups[gi]
        if spec.kind in ("adam", "adamw"):
            kw = {"decoupled": spec.kind == "adamw"}
        elif spec.kind == "sgd":
            kw = {"momentum": group.momentum, "nesterov": group.nesterov}
        else:
            kw = {"bias_correction": group.bias_correction}
        p_new, s_new = module.update(
            em, params[p], scaled[p], states[p], hps[gi], group_sc[gi], **kw
        )
        add_output(p_new, f"new:{p}", Role.PARAMETER, of=p, alias=p)
        for s, v in s_new.items():
            add_output(
                v, f"new:{state_key(s, p)}", Role.OPTIMIZER_STATE, of=p, alias=state_key(s, p)
            )
    add_output(step_new, "new:step", Role.STEP, alias="step")
    em.flush_before(None)
    if norm is not None:
        add_output(norm, "grad_norm", Role.CLIP)
    if finite is not None:
        add_output(finite, "grads_finite", Role.GRADS_FINITE)
    em.flush_before(None)
    model = ir.Model(graph, ir_version=10, producer_name="ortrain")
    check_inplace_safe(model, aliases)
    return UpdateGraph(model, io, outs, aliases)


def check_inplace_safe(model: ir.Model, aliases: Mapping[str, str]) -> None:
    """Every reader of an aliased input must run before the node writing its buffer.

    ONNX has no control edges; "before" is only guaranteed for ancestors, so each
    reader of input X must be an ancestor of the producer of X's aliased output.
    """
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    outputs = {v.name: v for v in graph.outputs}
    for out_name, in_name in aliases.items():
        writer = outputs[out_name].producer()
        ancestors: set[int] = set()
        stack = [writer]
        while stack:
            n = stack.pop()
            if n is None or id(n) in ancestors:
                continue
            ancestors.add(id(n))
            stack.extend(v.producer() for v in n.inputs if v is not None)
        for node, _ in inputs[in_name].uses():
            if id(node) not in ancestors:
                raise AssertionError(
                    f"in-place update of '{in_name}' is unsafe: node '{node.name}' reads it "
                    f"but is not an ancestor of '{writer.name}' which overwrites it"
                )
