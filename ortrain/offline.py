"""Offline training artifacts (like ORT's generate_artifacts), and a session that trains
them with no torch model present.

``build_training(IN.onnx, loss=..., ...)`` turns a forward model whose float
initializers are the weights into ``gradient.onnx`` (forward + minimal backward),
``update.onnx`` (optimizer), ``state.npz`` (initial weights) and ``manifest.json`` (the
role of every graph input/output). ``TrainingSession.load(dir)`` runs them.
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
from ortrain.graph_passes.autodiff import GradientGraphResult
from ortrain.graph_passes.cleanup.forward_cleanup import clean_forward
from ortrain.graph_passes.infra.pipeline import Pass, run_pipeline
from ortrain.graph_passes.training.optimizer import build_update_graph
from ortrain.graph_passes.training.optimizer.update_graph import state_key
from ortrain.graph_passes.training_pipeline import (
    BuildProducts,
    build_pipeline,
    target_pipeline,
)
from ortrain.optim.lamb import Lamb
from ortrain.options import TrainerOptions
from ortrain.runtime.cpu_ops import has_sgemm_batch, use_blas_gemm, use_grad_kernels
from ortrain.runtime.session import BoundSession, make_session
from ortrain.safe_files import write_folder

MANIFEST = "manifest.json"
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
    spec = OptimizerSpec(optimizer, (GroupSpec(tuple(grads), momentum=True),))
    shapes = {n: tuple(state[n].shape) for n in grads}
    update = build_update_graph(spec, shapes, clip_grad_norm=max_grad_norm is not None)
    manifest = {
        "format": "ortrain.artifacts/1",
        "loss": loss,
        "parameters": grads,
        "frozen": [n for n in floats if n not in grads],
        "batch": [v.name for v in graph.inputs if v.name not in floats],
        "batch_shapes": {
            v.name: [int(d) for d in v.shape.dims] for v in graph.inputs if v.name not in floats
        },
        "grad_outputs": {n: result.grad_outputs[n] for n in grads},
        "optimizer": {
            "kind": optimizer,
            "hyperparameters": values,
            "states": list(spec.state_names(spec.groups[0])),
        },
        "max_grad_norm": max_grad_norm,
        "update_aliases": update.aliases,
    }

    def write(folder: Path) -> None:
        ir.save(model, folder / "gradient.onnx")
        ir.save(update.model, folder / "update.onnx")
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


@dataclasses.dataclass
class TrainingSession:
    """Trains built artifacts: ``train_step(**batch) -> loss``; weights in ``parameters``."""

    manifest: dict[str, Any]
    parameters: dict[str, torch.Tensor]
    _grad: BoundSession
    _update: BoundSession
    _loss: torch.Tensor
    _scalars: dict[str, torch.Tensor]
    # the target passes that changed the gradient graph at load, in the pipeline's order,
    # each with its op-count change ("ortrain.blas::Gemm": +12, "Gemm": -12, ...)
    lowered: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

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
        with np.load(d / "state.npz") as npz:
            params = {k: torch.from_numpy(npz[k].copy()) for k in npz.files}
        names = manifest["parameters"]
        grads = {n: torch.zeros_like(params[n]) for n in names}
        states = {
            state_key(s, n): torch.zeros_like(params[n])
            for s in manifest["optimizer"]["states"]
            for n in names
        }
        hp = manifest["optimizer"]["hyperparameters"]
        scalars = {"step": torch.zeros(()), "grad_scale": torch.ones(())}
        scalars.update({f"group0.{k}": torch.tensor(float(v)) for k, v in hp.items()})
        if manifest["max_grad_norm"] is not None:
            scalars["max_grad_norm"] = torch.tensor(float(manifest["max_grad_norm"]))
        loss = torch.zeros(())
        gradient = ir.load(d / "gradient.onnx")
        blas = use_blas_gemm(cpu_gemm)
        config = BuildConfig(
            trainable=tuple(names),
            blas_gemm=blas,
            blas_batch=blas and has_sgemm_batch(),
            cpu_kernels=use_grad_kernels(cpu_kernels),
        )
        grad_outputs = dict(manifest["grad_outputs"])
        products = BuildProducts(gradient=GradientGraphResult(gradient, grad_outputs, [], 0))
        lowerings = target_pipeline(config, BuildInputs(manifest["loss"], tuple(names)), products)
        lowered = {r.name: r.op_delta for r in run_pipeline(gradient, lowerings) if r.modified}
        shared = products.shared_outputs  # output -> the gradient output sharing its buffer
        grad_sess = BoundSession(make_session(gradient, threads=threads))
        grad_sess.bind_inputs(params)
        grad_sess.bind_outputs({manifest["loss"]: loss})
        grad_sess.bind_outputs({manifest["grad_outputs"][n]: grads[n] for n in names})
        param_of = {out: n for n, out in manifest["grad_outputs"].items()}
        grad_sess.bind_outputs({out: grads[param_of[g]] for out, g in shared.items()})
        upd = BoundSession(make_session(ir.load(d / "update.onnx"), threads=threads))
        upd.bind_inputs({**params, **states, **scalars})
        upd.bind_inputs({f"grad:{n}": grads[n] for n in names})
        aliased = {**params, **states, "step": scalars["step"]}
        outputs = {out: aliased[src] for out, src in manifest["update_aliases"].items()}
        if manifest["max_grad_norm"] is not None:
            scalars["grad_norm"] = torch.zeros(())
            outputs["grad_norm"] = scalars["grad_norm"]
        upd.bind_outputs(outputs)
        return cls(manifest, params, grad_sess, upd, loss, scalars, lowered)

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
        self._update.run()
        del keep
        return float(self._loss)

    @property
    def step(self) -> int:
        return int(self._scalars["step"])
