"""Buffers a training step writes (BatchNorm's running statistics and any in-place update).

The exported forward takes the module's buffers as graph inputs; torch.export lifts them
from the module and its graph signature lists which of them the forward mutates
(``buffers_to_mutate``). The ONNX exporter keeps buffers as initializers and drops those
mutations, so :func:`lift_buffers` turns, before the graph is optimized,

1. every buffer initializer into a graph input named as in ``named_buffers()``;
2. in a training graph, every mutated buffer's new value into a graph output
   ``updated:<buffer>`` with the role ``Role.UPDATED_BUFFER``; the trainer writes it into
   its buffer after each step. The traced forward (:class:`WithBuffers`) returns a copy of
   every buffer; the signature picks the mutated ones, the other copies are dropped.
   Evaluation graphs leave buffers unchanged.

BatchNorm in training mode needs two more pieces, both here:

3. :func:`batch_norm_translations`: the exporter's own translation of
   ``_native_batch_norm_legit_functional`` (BatchNorm with running statistics in training
   mode) normalizes with the running statistics and returns them unchanged; ours
   normalizes with the batch statistics and updates the running mean and the unbiased
   running variance as torch does. It spells the batch statistics out (ReduceMean) and
   normalizes with an inference-mode ``BatchNormalization``, as the exporter does for
   ``track_running_stats=False``: ONNX Runtime's training-mode kernel writes its running
   statistics into its mean/var inputs, i.e. into the buffers the graph still reads.
4. :func:`exportable_batch_norms`: ``momentum=None`` (the cumulative average) computes its
   factor ``1 / num_batches_tracked`` as a Python float, which torch.export cannot trace;
   during the export such layers run a forward that keeps the factor a tensor. An
   InstanceNorm tracking running statistics updates them inside ``instance_norm``, which
   the exporter drops; during the export it writes them explicitly.
   ``SyncBatchNorm`` in training mode is refused.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from ortrain.core.errors import ExportError, OrtrainError
from ortrain.core.roles import GraphIO, Role

if TYPE_CHECKING:
    import onnx_ir as ir

UPDATED_PREFIX = "updated:"


def updated_name(buffer: str) -> str:
    return UPDATED_PREFIX + buffer


# --------------------------------------------------------------------------- the graph
class WithBuffers(torch.nn.Module):
    """``inner``'s outputs followed by a copy of each of ``module``'s buffers after the
    forward: the mutated ones become graph outputs (the exporter drops buffer mutations)."""

    def __init__(self, inner: torch.nn.Module, module: torch.nn.Module, names: list[str]):
        super().__init__()
        self.inner, self.names = inner, names
        # Not a submodule: registered twice, its buffers would be two aliased inputs, and
        # torch.export cannot lift aliased mutated buffers.
        self._module = [module]

    def forward(self, *flat: torch.Tensor) -> tuple:
        out = self.inner(*flat)
        out = out if isinstance(out, tuple) else (out,)
        module = self._module[0]
        return (*out, *[module.get_buffer(n).clone() for n in self.names])


def buffer_targets(wrapper: torch.nn.Module, module: torch.nn.Module) -> dict[str, str]:
    """The wrapper's buffer targets (what the exported program calls them) -> the module's
    buffer names."""
    name_of = {id(b): n for n, b in module.named_buffers()}
    return {t: name_of[id(b)] for t, b in wrapper.named_buffers() if id(b) in name_of}


def lift_buffers(
    model: ir.Model,
    signature: Any,
    targets: Mapping[str, str],
    *,
    after: int,
    returned: list[str],
) -> list[str]:
    """In place, on the unoptimized export (cases 1 and 2 of the module docstring).

    ``signature``: the exported program's graph signature; ``targets``: its buffer targets
    -> the module's buffer names; ``after``: how many graph inputs (the parameters) come
    before the buffers; ``returned``: the buffers ``WithBuffers`` appended to the outputs
    (they are removed). Returns the buffers whose update is now an output.
    """
    import onnx_ir as ir

    graph = model.graph
    lifted = []
    for target in signature.inputs_to_buffers.values():
        value = graph.initializers.pop(target, None)
        if value is None:  # not read
            continue
        value.const_value = None
        value.name = targets[target]
        lifted.append(value)
    graph.inputs[after:after] = lifted
    if not returned:
        return []
    trailing = list(graph.outputs[-len(returned) :])
    del graph.outputs[-len(returned) :]
    mutated = {targets[t] for t in signature.buffers_to_mutate.values()}
    updated = []
    for name, value in zip(returned, trailing, strict=True):
        if name not in mutated:
            continue
        # A value of its own: the new value may be read elsewhere or be a graph input.
        node = ir.node("Identity", [value], name=f"update_{name}")
        new = node.outputs[0]
        new.name, new.dtype, new.shape = updated_name(name), value.dtype, value.shape
        graph.append(node)
        graph.outputs.append(new)
        updated.append(name)
    return updated


def drop_unread_buffers(model: ir.Model, buffers: set[str]) -> None:
    """Remove the buffer inputs nothing reads (the exporter left them out before)."""
    graph = model.graph
    for v in [v for v in graph.inputs if v.name in buffers]:
        if not v.uses() and v not in graph.outputs:
            graph.inputs.remove(v)


def updated_io(model: ir.Model, updated: list[str]) -> list[GraphIO]:
    """The roles of the update outputs; each must have kept its name through the passes."""
    outputs = {v.name for v in model.graph.outputs}
    io = []
    for name in updated:
        out = updated_name(name)
        if out not in outputs:
            raise ExportError(f"the update of buffer '{name}' is no longer a graph output")
        io.append(GraphIO(out, Role.UPDATED_BUFFER, of=name))
    return io


def check_updates(model: ir.Model, io: list[GraphIO]) -> None:
    """Every ``UPDATED_BUFFER`` output is still a graph output after the passes."""
    outputs = {v.name for v in model.graph.outputs}
    lost = [r.of for r in io if r.role is Role.UPDATED_BUFFER and r.name not in outputs]
    if lost:
        raise OrtrainError(f"the training graph lost the update of buffers {lost}")


# --------------------------------------------------------------------------- BatchNorm
def _batch_norm_functional(
    input: Any,
    weight: Any = None,
    bias: Any = None,
    running_mean: Any = None,
    running_var: Any = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> tuple:
    """(out, batch mean, batch rstd, new running mean, new running var) as torch computes
    them; ``momentum`` is torch's (ONNX's is 1 - momentum)."""
    from onnxscript import opset18 as op

    rank = len(input.shape)
    channels = op.Shape(input, start=1, end=2)
    if weight is None:
        weight = op.Expand(op.CastLike(op.Constant(value_float=1.0), input), channels)
    if bias is None:
        bias = op.Expand(op.CastLike(op.Constant(value_float=0.0), input), channels)
    axes = op.Constant(value_ints=[0, *range(2, rank)])
    if not training:
        out = op.BatchNormalization(input, weight, bias, running_mean, running_var, epsilon=eps)
        rstd = op.Reciprocal(op.Sqrt(op.Add(running_var, op.CastLike(eps, running_var))))
        return out, running_mean, rstd, op.Identity(running_mean), op.Identity(running_var)
    mean = op.ReduceMean(input, axes, keepdims=0)
    centered = op.Sub(input, op.ReduceMean(input, axes, keepdims=1))
    var = op.ReduceMean(op.Mul(centered, centered), axes, keepdims=0)  # biased
    out = op.BatchNormalization(input, weight, bias, mean, var, epsilon=eps)
    n = 1
    for i, d in enumerate(input.shape):
        n *= d if i != 1 else 1
    unbiased = op.Mul(var, op.CastLike(n / max(n - 1, 1), var))
    new_mean = _blend(op, running_mean, mean, momentum)
    new_var = _blend(op, running_var, unbiased, momentum)
    rstd = op.Reciprocal(op.Sqrt(op.Add(var, op.CastLike(eps, var))))
    return out, mean, rstd, new_mean, new_var


def _blend(op: Any, running: Any, batch: Any, momentum: float) -> Any:
    """momentum * batch + (1 - momentum) * running, torch's update."""
    keep = op.Mul(running, op.CastLike(1.0 - momentum, running))
    return op.Add(op.Mul(op.CastLike(batch, running), op.CastLike(momentum, running)), keep)


def batch_norm_translations() -> dict[Callable, Callable]:
    """``custom_translation_table`` entries for BatchNorm (case 3)."""
    return {torch.ops.aten._native_batch_norm_legit_functional.default: _batch_norm_functional}


def _cumulative_forward(self: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
    """``_BatchNorm.forward`` in training mode with ``momentum=None``, the factor
    ``1 / num_batches_tracked`` kept a tensor (eager: running = f * batch + (1 - f) * running,
    with the unbiased batch variance)."""
    self._check_input_dim(input)
    self.num_batches_tracked.add_(1)
    factor = 1.0 / self.num_batches_tracked.to(self.running_mean.dtype)
    out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
    x = input.detach()
    axes = [0, *range(2, x.dim())]
    mean, var = x.mean(axes), x.var(axes, correction=1)
    self.running_mean.copy_(factor * mean + (1.0 - factor) * self.running_mean)
    self.running_var.copy_(factor * var + (1.0 - factor) * self.running_var)
    return out


def _tracked_instance_norm(self: _InstanceNorm, input: torch.Tensor) -> torch.Tensor:
    """``_InstanceNorm._apply_instance_norm`` in training mode with running statistics,
    their update written out: torch normalizes the batch as one sample of B x C channels
    and averages the B updated copies of each channel's statistics (the unbiased
    variance) back into the buffers."""
    out = F.instance_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
    momentum = self.momentum if self.momentum is not None else 0.0
    x = input.detach()
    axes = list(range(2, x.dim()))
    mean, var = x.mean(axes), x.var(axes, correction=1)
    assert self.running_mean is not None and self.running_var is not None
    self.running_mean.copy_(((1.0 - momentum) * self.running_mean + momentum * mean).mean(0))
    self.running_var.copy_(((1.0 - momentum) * self.running_var + momentum * var).mean(0))
    return out


@contextlib.contextmanager
def exportable_batch_norms(module: torch.nn.Module) -> Iterator[None]:
    """Case 4, while the (training-mode) module is exported."""
    patched = []
    try:
        for name, m in module.named_modules():
            if isinstance(m, _InstanceNorm) and m.training and m.track_running_stats:
                # the exporter drops instance_norm's in-place statistics update (no mutated
                # buffer in the graph signature): torch's own layer writes them explicitly
                # while it exports; another is refused rather than kept at zero
                own = type(m)._apply_instance_norm is _InstanceNorm._apply_instance_norm
                if not own or "_apply_instance_norm" in m.__dict__:
                    raise ExportError(
                        f"{type(m).__name__} '{name or type(module).__name__}' tracks "
                        "running statistics in training through its own code, which "
                        "ortrain's export cannot write back; use track_running_stats=False "
                        "(normalizing by each batch's statistics in eval as well), or "
                        "GroupNorm"
                    )
                m._apply_instance_norm = types.MethodType(_tracked_instance_norm, m)
                patched.append((m, "_apply_instance_norm"))
                continue
            if not isinstance(m, _BatchNorm) or not m.training:
                continue
            if isinstance(m, torch.nn.SyncBatchNorm):
                raise ExportError(
                    f"SyncBatchNorm '{name or type(module).__name__}' is not supported in "
                    "training: ortrain keeps BatchNorm statistics per rank; convert it "
                    "back to BatchNorm (per-rank statistics) to train with ortrain"
                )
            # Only torch's own forward is replaced (a subclass's or an instance's is kept:
            # the export then fails on float(num_batches_tracked) unless it avoids it).
            standard = type(m).forward is _BatchNorm.forward and "forward" not in m.__dict__
            if standard and m.momentum is None and m.track_running_stats:
                m.forward = types.MethodType(_cumulative_forward, m)
                patched.append((m, "forward"))
        yield
    finally:
        for m, attr in patched:
            delattr(m, attr)
