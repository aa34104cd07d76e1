"""A trainer's graph builds (export + passes) as jobs that return serialized graphs.

``ORTTrainer`` runs each job in a forked child (``ortrain/forked.py``) where it can, so
the training process never imports the pass libraries (onnxscript's rewriter and
optimizer) or keeps what the export and the passes leave behind; it gets back bytes
to load into ONNX Runtime, the graph's roles and the build log. Where it cannot fork
(CUDA, ``ORTRAIN_BUILD_IN_PROCESS=1``) the same jobs run in process.

The pass modules are imported inside the jobs for that reason: importing this module
costs the training process nothing but the record types.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ortrain.bucketing import pad_token_id
from ortrain.buffer_updates import check_updates
from ortrain.build_progress import stage
from ortrain.core.build_config import BuildConfig, BuildInputs
from ortrain.core.errors import OrtrainError, PassError, deepest_cause
from ortrain.core.names import DROPOUT_OPS, RANDOM_OPS, LabelSite, label_rows_bucket
from ortrain.core.roles import GraphIO, Role
from ortrain.export import ExportedForward, LossFn, export_here
from ortrain.index_check import ComputedIndices, computed_indices, index_ranges

if TYPE_CHECKING:
    import onnx_ir as ir

    from ortrain.graph_passes.infra.serialize import Serialized
    from ortrain.length_family import LengthFamily


@dataclasses.dataclass
class StageRecord:
    graph: str
    stage: str
    seconds: float
    nodes_before: int
    nodes_after: int
    op_delta: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ForwardSource:
    """The exported training forward of one batch signature, kept to build the graph of
    another labelled-row count (``graph_passes/training/label_sparsity.py``) without exporting."""

    wire: tuple  # ExportedForward.to_wire()
    sites: list[LabelSite]
    # the signature's other sizes' export (``ortrain/length_family.py``), carried back
    # from the build to the training process (not stored with the forward)
    family: LengthFamily | None = None


@dataclasses.dataclass
class BuiltGraph:
    """A built graph as the training process takes it."""

    ort_data: bytes  # serialized, nodes in the order ONNX Runtime should run them
    data: bytes  # serialized in the graph's own order (inspection, memory report)
    recomputes: bool  # holds recomputed copies (ONNX Runtime's CSE must stay off)
    # the manifest: every input and output the runtime binds, with its role (the export
    # wrote the model's, each pass the ones it created; ``ortrain/runtime/binder.py``)
    io: list[GraphIO]
    output_names: list[str]  # the model's outputs (an evaluation graph's, in key order)
    output_keys: list[str]
    log: list[StageRecord] = dataclasses.field(default_factory=list)
    # graph_passes/memory/memory_plan.py's arena size for this graph: sizes ONNX Runtime's arena
    planned_peak_bytes: int = 0
    blas_gemm: bool = False  # has ortrain.blas.Gemm nodes: the session needs that library
    cpu_kernels: bool = False  # has ortrain.cpu nodes: the session needs the library too
    # batch input -> its uses as an index: checked before a batch is bound (index_check.py)
    index_checks: dict[str, list] = dataclasses.field(default_factory=dict)
    # indices computed from batch values: checked by a small graph of their own
    computed_indices: ComputedIndices | None = None
    # ("input|output <name>", "dtype shape"): compared across ranks (distributed/fingerprint.py)
    signature: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    # an evaluation graph built from the training export (``build_eval``), not its own
    from_training_export: bool = False
    # its forward from the symbolic export of its signature's sizes, not its own export
    # (``ortrain/length_family.py``): one that disagrees with eager is built again so
    specialized: bool = False
    # (op type, node name) of the nodes that draw random numbers (``random_nodes``): the
    # training process reads them without loading the graph libraries
    random_ops: tuple[tuple[str, str], ...] = ()
    # op types of the draws no switch fixes (``prepare/random_switch.uncentred_draws``): a
    # first step with any is not compared with eager
    unfixed_draws: tuple[str, ...] = ()
    # ONNX Runtime optimizers that would compute this graph wrongly (``optimizers_to_disable``)
    wrong_optimizers: tuple[str, ...] = ()
    # whether padding the batch's sequence axis changes the loss (``padding_proof``)
    padding: tuple[str, str] = ("", "")

    def model(self) -> ir.Model:
        import onnx
        import onnx_ir as ir

        return ir.serde.deserialize_model(onnx.ModelProto.FromString(self.data))

    def roles(self, *roles: Role) -> list[GraphIO]:
        return [r for r in self.io if r.role in roles]

    @property
    def grad_params(self) -> list[str]:
        """The parameters the graph differentiates (a gradient or an update of each)."""
        found = self.roles(Role.GRADIENT, Role.UPDATE_APPLIED)
        return list(dict.fromkeys(r.of for r in found if r.of is not None))


def label_rows(sites: list[LabelSite], batch: Mapping[str, Any], headroom: bool = False) -> tuple:
    """(loss node, rows to build) per label site: this batch's labelled rows, bucketed.

    ``headroom`` (what a new graph is built for): two standard deviations more, i.e. 2
    sqrt(labelled). Labels drawn at random (masked-LM: each token with p = 0.15) vary by
    about sqrt(count) from batch to batch, so a graph built for one batch's exact count
    would sit on a bucket edge half the time and the next batch would build another
    (on bert-tiny: a second graph, with the memory it holds); with headroom the
    next batches fit the first graph (``graph_for``)."""
    rows = []
    for site in sites:
        labels = batch.get(site.input)
        if isinstance(labels, torch.Tensor):
            labelled = int(torch.count_nonzero(labels != site.ignore_index))
            if headroom:  # and the rows of a padded tail: a longer batch fills them
                labelled += math.ceil(2 * math.sqrt(labelled)) + _tail(labels, site.ignore_index)
            bucket = label_rows_bucket(labelled, site.rows)
            if bucket < site.rows:
                rows.append((site.node, bucket))
    return tuple(rows)


def _tail(labels: torch.Tensor, ignore: int) -> int:
    """The labels in the trailing columns (axis 1) that every row ignores: right padding's."""
    if labels.ndim < 2 or labels.shape[1] == 0:
        return 0
    columns = (labels != ignore).transpose(0, 1).reshape(labels.shape[1], -1).any(1)
    real = torch.nonzero(columns)
    last = int(real[-1]) + 1 if real.numel() else 0
    return (labels.shape[1] - last) * (labels.numel() // labels.shape[1])


def graph_for(sites: list[LabelSite], needed: tuple, built: Iterable[tuple]) -> tuple | None:
    """The built label-row choice to run a batch that needs ``needed`` on: ``needed``
    itself, else the smallest that holds every site's rows with at most one bucket (a
    16th of the rows) to spare per site; None: build one. The spare rows are ignored rows
    the loss skips (the same loss and gradients), at a 16th of the head's work each."""
    full = {site.node: site.rows for site in sites}
    step = {site.node: label_rows_bucket(1, site.rows) for site in sites}
    need = {**full, **dict(needed)}
    best, best_rows = None, None
    for rows in built:
        have = {**full, **dict(rows)}
        if rows == needed:
            return rows
        if all(need[n] <= have[n] <= need[n] + step[n] for n in full):
            total = sum(have.values())
            if best_rows is None or total < best_rows:
                best, best_rows = rows, total
    return best


def holding(sites: list[LabelSite], needed: tuple, built: Iterable[tuple]) -> tuple | None:
    """The built label-row choice with the fewest rows that holds ``needed`` at every
    site, however many it spares; None: none does."""
    full = {site.node: site.rows for site in sites}
    need = {**full, **dict(needed)}
    fits = [r for r in built if all(need[n] <= {**full, **dict(r)}[n] for n in full)]
    return min(fits, key=lambda r: sum({**full, **dict(r)}.values()), default=None)


class _Log:
    """The build log of one job; with a graph directory, the graph after each pass."""

    def __init__(self, graph: str, config: BuildConfig, first: int):
        self.graph = graph
        self.dir = Path(config.graph_dir) if config.graph_dir else None
        self.next = first  # files are numbered in build order across the trainer's builds
        self.records: list[StageRecord] = []

    def export(
        self,
        module: torch.nn.Module,
        batch: Mapping[str, Any],
        train: bool,
        loss_fn: LossFn | None,
        dynamic: Mapping[str, tuple[int, ...]] | None = None,
    ) -> ExportedForward:
        """The forward of ``batch`` with the model's other outputs too (a training build
        drops them; its evaluation graph is built from the same export); ``dynamic``:
        those axes' sizes symbolic."""
        import time

        stage("export")  # the line a long build prints (ortrain/build_cache.py)
        t = time.perf_counter()
        ex = export_here(module, batch, train, loss_fn, True, dynamic)
        seconds = time.perf_counter() - t
        self.records.append(StageRecord(self.graph, "export", seconds, 0, len(ex.model.graph)))
        self.next += 1
        return ex

    def specialize(self, wire: tuple, batch: Mapping[str, Any]) -> ExportedForward:
        """A symbolic export (``ExportedForward.to_wire``) at ``batch``'s sizes."""
        import time

        from ortrain.length_family import specialize

        stage("specialize")
        t = time.perf_counter()
        ex = specialize(ExportedForward.from_wire(wire), batch)
        seconds = time.perf_counter() - t
        self.records.append(StageRecord(self.graph, "specialize", seconds, 0, len(ex.model.graph)))
        self.next += 1
        return ex

    def family_export(
        self,
        module: torch.nn.Module,
        batch: Mapping[str, Any],
        loss_fn: LossFn | None,
        family: LengthFamily,
    ) -> tuple[ExportedForward | None, LengthFamily]:
        """``batch``'s training forward from its signature's symbolic export (traced
        now where there is none yet): None where that does not give it (exported as
        before then), and the family as it stands."""
        from ortrain.core.errors import first_line

        if family.failed:
            return None, family
        try:
            if family.wire is None:
                sym = self.export(module, batch, True, loss_fn, family.axes)
                family = dataclasses.replace(family, wire=sym.to_wire())
            return self.specialize(family.wire, batch), family
        except Exception as exc:  # the export at the batch's own sizes stands, as ever
            if family.wire is None:  # (a size out of range tells nothing of the others)
                why = f"{type(exc).__name__}: {first_line(exc)}"
                family = dataclasses.replace(family, failed=why)
            return None, family

    def run(self, model: ir.Model, passes: list, serialized: Serialized) -> None:
        import onnx
        import onnx_ir as ir

        from ortrain.graph_passes.infra.pipeline import run_pipeline

        def save(name: str, m: ir.Model | onnx.ModelProto) -> None:
            if self.dir is not None:
                path = self.dir / f"{self.graph}.{self.next:02d}.{name}.onnx"
                if isinstance(m, onnx.ModelProto):
                    onnx.save(m, str(path))
                else:
                    ir.save(m, path)
            self.next += 1

        stage("passes")
        for r in run_pipeline(model, passes, after_each=save, serialize=serialized):
            self.records.append(
                StageRecord(
                    self.graph, r.name, r.seconds, r.nodes_before, r.nodes_after, r.op_delta
                )
            )


def _graph_signature(model: ir.Model) -> list[tuple[str, str]]:
    """(name, "dtype shape") of each input and output of a built graph: what ranks compare
    (``distributed/fingerprint.py``)."""
    out = []
    for kind, values in (("input", model.graph.inputs), ("output", model.graph.outputs)):
        for v in values:
            dims = [d if isinstance(d, int) else str(d) for d in v.shape.dims] if v.shape else None
            dtype = v.dtype.name if v.dtype is not None else "?"
            out.append((f"{kind} {v.name}", f"{dtype} {dims}"))
    return out


def _built(
    model: ir.Model, ex: ExportedForward, log: _Log, serialized: Serialized, **extra: Any
) -> BuiltGraph:
    from ortrain.core.names import BLAS_DOMAIN, CPU_DOMAIN
    from ortrain.graph_passes.infra.tags import RECOMPUTE_OF
    from ortrain.graph_passes.memory.memory_plan import planned_peak_bytes
    from ortrain.graph_passes.prepare.random_switch import uncentred_draws
    from ortrain.runtime.session import optimizers_to_disable, random_nodes

    try:
        ort_data = serialized.ort_data(model)
        peak = planned_peak_bytes(model)  # (re-reads the graph: an invalid one stops here)
    except OrtrainError:
        raise
    except Exception as exc:
        raise PassError(f"the built graph is not valid: {deepest_cause(exc)}") from exc
    return BuiltGraph(
        ort_data=ort_data,
        data=serialized.data,
        recomputes=any(RECOMPUTE_OF in n.metadata_props for n in model.graph),
        io=extra.pop("io", ex.io),
        output_names=ex.output_names,
        output_keys=ex.output_keys,
        log=log.records,
        planned_peak_bytes=peak,
        blas_gemm=BLAS_DOMAIN in model.opset_imports,
        cpu_kernels=CPU_DOMAIN in model.opset_imports,
        signature=_graph_signature(model),
        random_ops=tuple(random_nodes(model)),
        unfixed_draws=tuple(uncentred_draws(model)),
        wrong_optimizers=optimizers_to_disable(model),
        **extra,
    )


def build_train(
    module: torch.nn.Module,
    batch: Mapping[str, Any],
    loss_fn: LossFn | None,
    config: BuildConfig,
    forward: ForwardSource | None,
    first: int,
    family: LengthFamily | None = None,
) -> tuple[ForwardSource, tuple, BuiltGraph]:
    """The gradient graph of ``batch``'s signature and labelled-row count, exporting the
    forward unless ``forward`` is given (``family``: from the symbolic export of the
    signature's sizes where it gives it). Returns (forward, label rows, graph)."""
    from ortrain.graph_passes.training.label_sparsity import find_label_sites
    from ortrain.graph_passes.training_pipeline import BuildProducts, build_pipeline

    log = _Log("train", config, first)
    specialized = False
    if forward is None:
        full = None
        if family is not None:
            full, family = log.family_export(module, batch, loss_fn, family)
            specialized = full is not None
        if full is None:
            full = log.export(module, batch, True, loss_fn)
        wire = full.to_wire()  # with the model's outputs: an evaluation graph's source
        ex = training_view(full)
        sites = find_label_sites(ex.model) if config.optimize else []
        forward = ForwardSource(wire, sites, family)
    else:
        ex = training_view(ExportedForward.from_wire(forward.wire))
    rows = label_rows(forward.sites, batch, headroom=True)
    checks = index_ranges(ex.model, ex.io)  # of the exported forward, before the passes
    padding = padding_proof(batch, ex, pad_token_id(module))
    computed = computed_indices(ex.model, ex.io)
    model = ex.model  # from_wire / a fresh export: the passes may rewrite it in place
    inputs = {r.name for r in ex.io}
    build_inputs = BuildInputs(
        loss=ex.output_names[0],
        wrt=tuple(n for n in config.trainable if n in inputs),
        label_rows=dict(rows),
    )
    products = BuildProducts()
    from ortrain.graph_passes.infra.serialize import Serialized

    serialized = Serialized()
    log.run(model, build_pipeline(config, build_inputs, products), serialized)
    check_updates(model, ex.io)  # the buffer updates the trainer writes back
    graph = _built(
        model,
        ex,
        log,
        serialized,
        io=ex.io + products.io,
        index_checks=checks,
        computed_indices=computed,
        padding=padding,
        specialized=specialized,
    )
    return forward, rows, graph


def padding_proof(
    batch: Mapping[str, Any],
    ex: ExportedForward,
    pad_id: int = 0,
    holds: Mapping[str, float | None] | None = None,
) -> tuple[str, str]:
    """Whether padding ``batch``'s sequence axis as bucketing would changes the training
    forward's outputs (``ortrain/padding/``): (verdict, detail); ("", "") where the
    batch has no sequence axis to pad, or where what a tensor's padding holds is learned
    (``ortrain/padding_roles.py``) and not given in ``holds`` (the trainer proves it
    then, on the export it keeps)."""
    from ortrain.bucketing import layout
    from ortrain.padding import prove

    plan = layout(batch, pad_id)
    if isinstance(plan, str) or (plan.learn and holds is None):
        return ("", "")
    said = plan.holds if holds is None else {**plan.holds, **holds}
    padded = {k: said.get(k) for k in plan.pads}
    outputs = [v.name for v in ex.model.graph.outputs]
    return prove(ex.model, ex.io, outputs, padded, plan.length).as_tuple()


def training_view(ex: ExportedForward) -> ExportedForward:
    """The export a training graph is built from: the loss and the buffer updates as its
    outputs, the model's other outputs dropped (in place)."""
    graph = ex.model.graph
    others = set(ex.output_names[1:])
    for v in [v for v in graph.outputs if v.name in others]:
        graph.outputs.remove(v)
    return ExportedForward(ex.model, ex.io, ex.output_names[:1], ex.output_keys[:1])


def evaluation_view(ex: ExportedForward) -> ExportedForward:
    """A training export as an evaluation forward (in place): no buffer updates, and every
    Dropout in inference mode. Whatever else the model does by mode (BatchNorm's batch
    statistics, ``if self.training``) the evaluation graph's first run finds against
    eager, and the trainer exports in evaluation mode then."""
    import numpy as np
    import onnx_ir as ir

    graph = ex.model.graph
    updated = {r.name for r in ex.io if r.role is Role.UPDATED_BUFFER}
    for v in [v for v in graph.outputs if v.name in updated]:
        graph.outputs.remove(v)
    off = None
    for node in graph:
        if node.op_type == "Dropout" and len(node.inputs) > 2 and node.inputs[2] is not None:
            if off is None:
                off = ir.Value(name="dropout_off", const_value=ir.tensor(np.array(False)))
                graph.register_initializer(off)
            node.replace_input_with(2, off)
    io = [r for r in ex.io if r.role is not Role.UPDATED_BUFFER]
    return ExportedForward(ex.model, io, ex.output_names, ex.output_keys)


def draws_by_mode(model: ir.Model) -> list[str]:
    """The random draws other than Dropout in ``model`` (subgraphs included): a layer
    that draws in training (RReLU's slopes, a noise layer, drop-path's mask) computes
    otherwise in evaluation, and a first run cannot tell: an average over the draws can
    land within the loss's tolerance of evaluation's value."""
    return sorted(
        n.op_type for n in model.graph.all_nodes() if n.op_type in RANDOM_OPS - DROPOUT_OPS
    )


def build_eval(
    module: torch.nn.Module,
    batch: Mapping[str, Any],
    loss_fn: LossFn | None,
    config: BuildConfig,
    first: int,
    forward: ForwardSource | None = None,
) -> BuiltGraph:
    """The evaluation graph of ``batch``'s signature (loss and the model's outputs), from
    the training export ``forward`` where given (one export per model and signature; its
    first run is checked against eager), else from an export in evaluation mode."""
    from ortrain.graph_passes.training_pipeline import eval_pipeline

    log = _Log("eval", config, first)
    ex = None
    if forward is not None:
        ex = evaluation_view(ExportedForward.from_wire(forward.wire))
        if draws_by_mode(ex.model):
            ex = forward = None
    if ex is None:
        ex = log.export(module, batch, False, loss_fn)
    from ortrain.graph_passes.infra.serialize import Serialized

    checks = index_ranges(ex.model, ex.io)
    computed = computed_indices(ex.model, ex.io)
    serialized = Serialized()
    log.run(ex.model, eval_pipeline(config), serialized)
    outputs = [
        GraphIO(name, Role.LOSS if k == "loss" else Role.OUTPUT)
        for name, k in zip(ex.output_names, ex.output_keys)
    ]
    built = _built(
        ex.model,
        ex,
        log,
        serialized,
        io=ex.io + outputs,
        index_checks=checks,
        computed_indices=computed,
    )
    built.from_training_export = forward is not None
    return built
