"""Offline training artifacts (like ORT's generate_artifacts): a serialized training
program, and a session that trains it with no torch model present.

``build_training(IN.onnx, loss=..., ...)`` turns a forward model whose float
initializers are the weights into a program of one compiled segment: ``gradient.onnx``
(forward + minimal backward, standard ops), ``state.npz`` (initial weights) and
``manifest.json`` (the program: every input and output of the graph with its role, where
the update runs, the optimizer and its hyperparameters). ``TrainingSession.load(dir)``
runs it the way a trainer runs its graphs: the weights in a ``TrainingState``, the graph
lowered for this machine by the pipeline's target stage and bound by role
(``runtime/binder.py``), the update by the trainer's update-graph engine
(``runtime/update_engines.py``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common
import torch

from ortrain.core.build_config import BuildConfig, BuildInputs
from ortrain.core.errors import OrtrainError
from ortrain.core.names import GradientError
from ortrain.core.optimizer_spec import HYPERPARAMETERS, GroupSpec, OptimizerSpec
from ortrain.core.roles import GraphIO, Role
from ortrain.graph_passes.autodiff import GradientGraphResult
from ortrain.graph_passes.cleanup.forward_cleanup import clean_forward
from ortrain.graph_passes.infra.pipeline import Pass, run_pipeline
from ortrain.graph_passes.training_pipeline import (
    BuildProducts,
    build_pipeline,
    target_pipeline,
)
from ortrain.optim.lamb import Lamb
from ortrain.options import TrainerOptions
from ortrain.runtime.binder import bind_training_graph
from ortrain.runtime.cpu_ops import has_sgemm_batch, use_blas_gemm, use_grad_kernels
from ortrain.runtime.session import BoundSession, make_session
from ortrain.runtime.training_state import TrainingState
from ortrain.runtime.update_engines import EngineEnv, UpdateEngine, make_engine
from ortrain.safe_files import write_folder

MANIFEST = "manifest.json"
FORMAT = "ortrain.program/1"
GRADIENT_GRAPH = "gradient.onnx"
DEFAULTS = {
    "adamw": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01},
    "adam": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
    "sgd": {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0},
    "lamb": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "weight_decay": 0.01},
}


class ArtifactError(OrtrainError):
    """A model or artifact directory that cannot be turned into / loaded as training."""


def build_training(
    src: str | Path,
    out_dir: str | Path,
    *,
    loss: str,
    frozen: Sequence[str] = (),
    optimizer: str = "adamw",
    lr: float = 1e-3,
    hyper: dict[str, float] | None = None,
    max_grad_norm: float | None = None,
    dims: Mapping[str, int] | None = None,
    optimize: bool = True,
) -> dict[str, Any]:
    """Write the training artifacts for ``src``; returns the manifest.

    The training graph has static shapes: symbolic input dimensions (a dynamic batch or
    sequence axis) take their sizes from ``dims`` by name. ``optimize`` runs the
    trainer's optimization passes (folding, fusions, backward cleanup) around autodiff.
    """
    src, out = Path(src), Path(out_dir)
    if optimizer not in HYPERPARAMETERS:
        raise ArtifactError(f"optimizer {optimizer!r}: use one of {sorted(HYPERPARAMETERS)}")
    values = check_settings(optimizer, lr, hyper or {}, max_grad_norm)
    if not src.is_file():
        raise ArtifactError(f"{src}: no such file")
    try:
        model = ir.serde.deserialize_model(onnx.load(str(src)))
    except Exception as exc:
        raise ArtifactError(f"{src}: not a readable ONNX model ({type(exc).__name__})") from exc
    graph = model.graph
    if loss not in {v.name for v in graph.outputs}:
        outs = [v.name for v in graph.outputs]
        raise ArtifactError(f"loss output {loss!r} is not an output of {src.name}: {outs}")
    floats = {
        name: v
        for name, v in graph.initializers.items()
        if v.const_value is not None and v.dtype == ir.DataType.FLOAT
    }
    unknown = sorted(set(frozen) - set(floats))
    if unknown:
        raise ArtifactError(f"--frozen names no float initializer: {unknown}")
    state: dict[str, np.ndarray] = {}
    for name, v in floats.items():  # weights become graph inputs fed from persistent state
        state[name] = v.const_value.numpy().copy()
        v.const_value = None
        del graph.initializers[name]
        graph.inputs.append(v)
    trainable = [n for n in floats if n not in set(frozen)]
    for v in list(graph.outputs):
        if v.name != loss:
            graph.outputs.remove(v)
    fix_input_dims(model, dims or {}, set(floats))
    # the artifacts keep standard ops and the graph's own order: the CPU lowerings and the
    # serialized passes run where a session is made (``TrainingSession.load``)
    config = BuildConfig(trainable=tuple(trainable), optimize=optimize)
    products = BuildProducts()
    passes = build_pipeline(config, BuildInputs(loss, tuple(trainable)), products)
    try:
        run_pipeline(model, [p for p in passes if isinstance(p, Pass)])
    except (GradientError, ValueError) as exc:
        raise ArtifactError(f"{src.name}: cannot build its gradient graph: {exc}") from exc
    result = products.gradient
    assert result is not None
    grads = [n for n in trainable if n in result.grad_outputs]
    frozen_names = [n for n in floats if n not in grads]
    batch = [v.name for v in graph.inputs if v.name not in floats]
    # the program's one compiled segment: its graph's inputs and outputs by role (the
    # passes wrote the loss's and the gradients'), the update after it
    io = [
        *(GraphIO(n, Role.PARAMETER) for n in grads),
        *(GraphIO(n, Role.FROZEN_PARAMETER) for n in frozen_names),
        *(GraphIO(n, Role.BATCH) for n in batch),
        *(r for r in products.io if r.role is not Role.GRADIENT or r.of in grads),
    ]
    manifest = {
        "format": FORMAT,
        "program": {
            "segments": [{"module": "", "kind": "graph", "graph": GRADIENT_GRAPH}],
            "update": "graph",
        },
        "io": [[r.name, r.role.value, r.of] for r in io],
        "loss": loss,
        "parameters": grads,
        "frozen": frozen_names,
        "batch": batch,
        "batch_shapes": {
            v.name: [int(d) for d in v.shape.dims] for v in graph.inputs if v.name not in floats
        },
        "optimizer": {"kind": optimizer, "hyperparameters": values},
        "max_grad_norm": max_grad_norm,
    }

    def write(folder: Path) -> None:
        ir.save(model, folder / GRADIENT_GRAPH)
        np.savez(folder / "state.npz", **state)
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))

    try:  # a failed write leaves what was at ``out`` as it was
        write_folder(out, write, last=MANIFEST)
    except OSError as exc:
        raise ArtifactError(f"cannot write {out}: {exc.strerror or exc}") from exc
    return manifest


_CLASSES = {
    "adamw": ("torch.optim.AdamW", torch.optim.AdamW),
    "adam": ("torch.optim.Adam", torch.optim.Adam),
    "sgd": ("torch.optim.SGD", torch.optim.SGD),
    "lamb": ("ortrain.optim.Lamb", Lamb),
}


def check_settings(
    optimizer: str, lr: float, hyper: Mapping[str, float], max_grad_norm: float | None
) -> dict[str, float]:
    """The hyperparameters the artifacts carry (defaults filled in), refused as a trainer
    would refuse them, in its words: by the torch optimizer's own constructor (what users of
    ``ORTTrainer`` construct) and ``TrainerOptions``' rule for ``max_grad_norm``."""
    unknown = sorted(set(hyper) - set(HYPERPARAMETERS[optimizer]))
    if unknown:
        raise ArtifactError(f"{optimizer} has no hyperparameter {', '.join(unknown)}")
    values = {**DEFAULTS[optimizer], **hyper, "lr": lr}
    kwargs = {k: v for k, v in values.items() if k not in ("beta1", "beta2")}
    if "beta1" in values:
        kwargs["betas"] = (values["beta1"], values["beta2"])
    name, cls = _CLASSES[optimizer]
    try:
        cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except ValueError as exc:
        raise ArtifactError(f"{exc} ({name} refuses it)") from None
    if max_grad_norm is not None:
        try:
            TrainerOptions(max_grad_norm=max_grad_norm)
        except ValueError as exc:
            raise ArtifactError(str(exc)) from None
    return values


def fix_input_dims(model: ir.Model, dims: Mapping[str, int], weights: set[str]) -> None:
    """Give every symbolic dimension of the batch inputs its size from ``dims``; the
    shapes inside the graph are then inferred again by the forward passes."""
    symbolic = []
    for v in model.graph.inputs:
        if v.name in weights or v.shape is None:
            continue
        symbolic += [d.value for d in v.shape.dims if isinstance(d, ir.SymbolicDim)]
    names = list(dict.fromkeys(str(d) for d in symbolic))
    unknown = sorted(set(dims) - set(names))
    if unknown:
        raise ArtifactError(
            f"no input has a dimension named {', '.join(map(repr, unknown))}; the symbolic "
            f"dimensions are {names or 'none'}"
        )
    missing = [n for n in names if n not in dims]
    if missing:
        raise ArtifactError(
            f"the inputs have symbolic dimensions {missing}: the training graph has static "
            f"shapes, give their sizes with --dim NAME=SIZE (e.g. --dim {missing[0]}=8)"
        )
    if not names:
        return
    for v in model.graph.inputs:
        if v.name not in weights and v.shape is not None:
            v.shape = ir.Shape(
                [dims[str(d.value)] if isinstance(d, ir.SymbolicDim) else d for d in v.shape.dims]
            )
    for node in model.graph:  # stale symbolic shapes would override the inferred ones
        for out in node.outputs:
            out.shape = None
    # Shapes computed from Shape ops (the exporter's Reshape targets) fold to constants.
    clean_forward(model)


class _Weights(torch.nn.Module):
    """An artifact's weights as a module, under their graph input names (which may hold
    dots): what a ``TrainingState`` is made of."""

    def __init__(self, params: Mapping[str, torch.Tensor]):
        super().__init__()
        self._weights = {n: torch.nn.Parameter(t) for n, t in params.items()}

    def named_parameters(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        return iter(self._weights.items())

    def named_buffers(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        return iter(())


@dataclasses.dataclass(frozen=True)
class _Segment:
    """A compiled segment's role manifest, what the binder reads."""

    io: list[GraphIO]

    def roles(self, *roles: Role) -> list[GraphIO]:
        return [r for r in self.io if r.role in roles]


@dataclasses.dataclass
class TrainingSession:
    """Trains built artifacts: ``train_step(**batch) -> loss``; weights in ``parameters``."""

    manifest: dict[str, Any]
    state: TrainingState
    _grad: BoundSession
    _engine: UpdateEngine
    _values: list[dict[str, float]]  # the one parameter group's hyperparameters
    # the target passes that changed the gradient graph at load, in the pipeline's order,
    # each with its op-count change ("ortrain.blas::Gemm": +12, "Gemm": -12, ...)
    lowered: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def parameters(self) -> dict[str, torch.Tensor]:
        return self.state.params

    @classmethod
    def load(
        cls,
        directory: str | Path,
        *,
        threads: int | None = None,
        cpu_gemm: str = "auto",
        cpu_kernels: str = "auto",
    ) -> TrainingSession:
        """``cpu_gemm`` / ``cpu_kernels`` as in ``TrainerOptions``: the artifacts keep
        standard ops, and the training pipeline's target stage (``target_pipeline``, the
        same passes and gates a trainer's build runs) lowers them here, in memory, where
        the kernels are chosen; ``lowered`` names the passes that changed the graph. The
        fused GELU / LayerNorm / Softmax backwards are emitted by the gradient rules, so
        artifacts built offline keep those as standard ops."""
        d = Path(directory)
        if not (d / MANIFEST).is_file():
            raise ArtifactError(f"{d}: no {MANIFEST}; build it with `ortrain build-training`")
        manifest = json.loads((d / MANIFEST).read_text())
        if manifest.get("format") != FORMAT:
            raise ArtifactError(
                f"{d}: artifacts of format {manifest.get('format')!r}, this ortrain reads "
                f"{FORMAT!r}; build them again with `ortrain build-training`"
            )
        with np.load(d / "state.npz") as npz:
            params = {k: torch.from_numpy(npz[k].copy()) for k in npz.files}
        names = manifest["parameters"]
        kind, hp = manifest["optimizer"]["kind"], manifest["optimizer"]["hyperparameters"]
        momentum = kind != "sgd" or float(hp.get("momentum", 0.0)) != 0.0
        spec = OptimizerSpec(kind, (GroupSpec(tuple(names), momentum=momentum),))
        state = TrainingState.of_module(
            _Weights(params), spec, torch.device("cpu"), max_grad_norm=manifest["max_grad_norm"]
        )

        def session(model: Any, *, graph_capture: bool = False) -> BoundSession:
            return BoundSession(make_session(model, threads=threads))

        # where the program says the update runs: the update graph, after the gradient graph
        engine = make_engine(manifest["program"]["update"], state, EngineEnv(session, _no_save))
        state.grad_params = list(names)
        engine.prepare()
        gradient = ir.load(d / manifest["program"]["segments"][0]["graph"])
        blas = use_blas_gemm(cpu_gemm)
        config = BuildConfig(
            trainable=tuple(names),
            blas_gemm=blas,
            blas_batch=blas and has_sgemm_batch(),
            cpu_kernels=use_grad_kernels(cpu_kernels),
        )
        io = [GraphIO(n, Role(r), of) for n, r, of in manifest["io"]]
        grad_outputs = {r.of: r.name for r in io if r.role is Role.GRADIENT and r.of is not None}
        products = BuildProducts(gradient=GradientGraphResult(gradient, grad_outputs, [], 0))
        lowerings = target_pipeline(config, BuildInputs(manifest["loss"], tuple(names)), products)
        lowered = {r.name: r.op_delta for r in run_pipeline(gradient, lowerings) if r.modified}
        io += products.io  # what the lowerings added (a second output of one gradient)
        grad_sess = BoundSession(make_session(gradient, threads=threads))
        dropout_on = torch.ones((), dtype=torch.bool)
        bind_training_graph(grad_sess, _Segment(io), state, engine, dropout_on)  # type: ignore[arg-type]
        values = [{h: float(hp[h]) for h in spec.hyperparameters}]
        return cls(manifest, state, grad_sess, engine, values, lowered)

    def train_step(self, **batch: torch.Tensor | np.ndarray) -> float:
        missing = sorted(set(self.manifest["batch"]) - set(batch))
        if missing:
            raise ArtifactError(f"batch is missing inputs {missing}")
        keep = []
        shapes = self.manifest.get("batch_shapes", {})
        for name in self.manifest["batch"]:
            t = torch.as_tensor(batch[name]).contiguous()
            if name in shapes and list(t.shape) != shapes[name]:
                raise ArtifactError(
                    f"batch input {name!r}: shape {list(t.shape)}, the training graph was built "
                    f"for {shapes[name]} (rebuild with other --dim sizes)"
                )
            keep.append(t)
            self._grad.bind_batch(name, t)
        self._grad.run()
        self._engine.step(self._values, self.state.grad_scale())
        self.state.finish_update()
        del keep
        return float(self.state.loss)

    @property
    def step(self) -> int:
        return self.state.step


def _no_save(model: ir.Model, name: str) -> None:
    """Offline sessions keep no graphs on disk beyond the artifacts."""
