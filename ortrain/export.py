"""Export an ``nn.Module`` to an ONNX forward graph whose inputs are its state.

A functional wrapper (``torch.func.functional_call(..., tie_weights=True)``) makes
every parameter and buffer a named graph input (named exactly as in
``named_parameters()``/``named_buffers()``), followed by the batch tensors named
after the forward signature. Outputs: the loss first, then (for evaluation graphs)
the model's other tensor outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import io
import logging
import os
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from ortrain import nested_batch
from ortrain.buffer_updates import (
    WithBuffers,
    batch_norm_translations,
    buffer_targets,
    drop_unread_buffers,
    exportable_batch_norms,
    lift_buffers,
    updated_io,
)
from ortrain.core.errors import ExportError, LossShapeError, first_line
from ortrain.core.roles import GraphIO, Role
from ortrain.export_aten import aten_translations
from ortrain.export_attention import draw_attention_dropout
from ortrain.export_casts import unchanged_module_casts
from ortrain.export_checkpoints import reentrant_checkpoints_inline
from ortrain.export_decompositions import exporter_decompositions
from ortrain.export_functional import functional_for_export
from ortrain.export_hints import without_value_hints
from ortrain.export_losses import loss_translations
from ortrain.export_ops import custom_translations, export_hint, known_cause
from ortrain.export_scalar_operands import wrap_scalar_operands
from ortrain.exporter_registry import cached_registry
from ortrain.forked import call_forked, can_fork, run_here
from ortrain.padding_rows import tag_padding_rows
from ortrain.stop_gradient import mark_stop_gradients
from ortrain.stop_gradient import translations as stop_gradient_translations
from ortrain.verify import in_mode

if TYPE_CHECKING:  # the training process does not import them (ortrain/build.py)
    import onnx_ir as ir

LossFn = Callable[[Any, Mapping[str, Any]], torch.Tensor]


@dataclasses.dataclass
class ExportedForward:
    model: ir.Model
    io: list[GraphIO]  # graph inputs, in order, with roles
    output_names: list[str]  # graph outputs; the first is the loss
    output_keys: list[str]  # user-facing key of each output ("loss", "logits", ...)
    # an export with symbolic sizes (``ortrain/length_family.py``): each symbol's range
    # of values the trace holds for, (lowest, highest or None)
    ranges: dict[str, tuple[int, int | None]] = dataclasses.field(default_factory=dict)

    def to_wire(self) -> tuple:
        """Picklable form (the model as serialized ONNX)."""
        import onnx_ir as ir

        data = ir.serde.serialize_model(self.model).SerializeToString()
        return data, self.io, self.output_names, self.output_keys, self.ranges

    @classmethod
    def from_wire(cls, wire: tuple) -> ExportedForward:
        import onnx
        import onnx_ir as ir

        data, roles, outs, keys, ranges = wire
        model = ir.serde.deserialize_model(onnx.ModelProto.FromString(data))
        return cls(model, roles, outs, keys, ranges)


_P = inspect.Parameter
# forward's signature by the class's function (``forward_signature``); weak: a class let go
# takes its entry with it
_SIGNATURES: weakref.WeakKeyDictionary[Callable, inspect.Signature] = weakref.WeakKeyDictionary()


def forward_signature(module: torch.nn.Module) -> inspect.Signature:
    """``inspect.signature(module.forward)``, made once per forward function: every step
    names its batch by it. A forward set on the instance (a wrapper library's partial) is
    looked at anew each time."""
    fn = module.forward
    func = getattr(fn, "__func__", None)
    if func is None or getattr(fn, "__self__", None) is not module:
        return inspect.signature(fn)
    try:
        return _SIGNATURES[func]
    except KeyError:
        sig = _SIGNATURES[func] = inspect.signature(fn)
        return sig
    except TypeError:  # not weakly referenceable
        return inspect.signature(fn)


def _var_positional(params: Mapping[str, inspect.Parameter]) -> str | None:
    """The name of the forward's ``*args`` parameter, if it has one."""
    return next((n for n, p in params.items() if p.kind is _P.VAR_POSITIONAL), None)


def _takes_var_keyword(params: Mapping[str, inspect.Parameter]) -> bool:
    return any(p.kind is _P.VAR_KEYWORD for p in params.values())


def _positional_key(var: str, i: int) -> str:
    """The batch key of the ``i``-th value of ``*var`` (``args_0``, ``args_1``, ...)."""
    return f"{var}_{i}"


def normalize_batch(
    module: torch.nn.Module, args: tuple, kwargs: dict, *, allow_extra: bool = False
) -> dict[str, Any]:
    """Positional and keyword batch arguments as one name -> value mapping.

    Values of ``*args`` are named by position (``args_0``, ``args_1``, ...), items of
    ``**kwargs`` by key. ``allow_extra``: keywords the forward does not take (targets for a
    ``loss_fn``). ``call_arguments`` turns the mapping back into the forward's call.
    """
    params = forward_signature(module).parameters
    named = {n for n, p in params.items() if p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)}
    var = _var_positional(params)
    if var is not None:
        # A keyword spelled like a positional key would be read back as that position.
        reserved = [k for k in kwargs if k not in named and re.fullmatch(rf"{var}_\d+", k)]
        if reserved:
            raise TypeError(
                f"batch does not match {type(module).__name__}.forward: keyword {reserved[0]!r} "
                f"names a value of *{var} (ortrain's name for positional inputs); pass it "
                "positionally"
            )
    extra = {}
    if allow_extra and not _takes_var_keyword(params):
        extra = {k: v for k, v in kwargs.items() if k not in named}
        kwargs = {k: v for k, v in kwargs.items() if k in named}
    try:
        bound = forward_signature(module).bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"batch does not match {type(module).__name__}.forward: {exc}") from exc
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = params[name].kind
        if kind is _P.VAR_KEYWORD:
            clash = sorted(set(value) & set(out))
            if clash:  # def forward(self, x, /, **kw) called with kw["x"]
                raise TypeError(
                    f"batch does not match {type(module).__name__}.forward: {clash[0]!r} is "
                    f"both a positional-only input and a key of **{name}"
                )
            out.update(value)
        elif kind is _P.VAR_POSITIONAL:
            keys = [_positional_key(name, i) for i in range(len(value))]
            if set(keys) & named:  # def forward(self, args_0, *args)
                raise TypeError(
                    f"{type(module).__name__}.forward: a parameter is named like a value of "
                    f"*{name} ({sorted(set(keys) & named)[0]!r}); ortrain cannot name its inputs"
                )
            out.update(zip(keys, value))
        else:
            out[name] = value
    out.update(extra)
    return out


def var_positional_keys(module: torch.nn.Module, batch: Mapping[str, Any]) -> list[str] | None:
    """The keys of ``batch`` that hold the forward's ``*args`` values, in order (None: the
    forward has no ``*args``)."""
    var = _var_positional(forward_signature(module).parameters)
    if var is None:
        return None
    keys: list[str] = []
    while _positional_key(var, len(keys)) in batch:
        keys.append(_positional_key(var, len(keys)))
    return keys


def call_arguments(module: torch.nn.Module, inputs: Mapping[str, Any]) -> tuple[tuple, dict]:
    """The forward's positional and keyword arguments from a ``normalize_batch`` mapping;
    keys the forward does not take (a ``loss_fn``'s targets) are left out."""
    params = forward_signature(module).parameters
    rest = dict(inputs)
    varargs = [rest.pop(k) for k in var_positional_keys(module, inputs) or []]
    args = []
    for name, p in params.items():
        # Before *args values, every named input goes by position (as it was bound).
        by_position = p.kind is _P.POSITIONAL_ONLY or (
            p.kind is _P.POSITIONAL_OR_KEYWORD and varargs
        )
        if not by_position or name not in rest:
            break
        args.append(rest.pop(name))
    if not _takes_var_keyword(params):
        rest = {k: v for k, v in rest.items() if k in params}
    return (*args, *varargs), rest


def step_loss(outputs: Any, batch: Mapping[str, Any], loss_fn: LossFn | None) -> torch.Tensor:
    """The step's loss: ``loss_fn``'s, else the model's (``find_loss``). A loss of one
    element in any shape (``[1]``: a ``keepdim`` reduction, a gathered loss) is taken as
    0-dim, as eager's ``backward()`` takes it without a gradient argument."""
    loss = loss_fn(outputs, batch) if loss_fn is not None else find_loss(outputs)
    if isinstance(loss, torch.Tensor) and loss.dim() > 0 and loss.numel() == 1:
        loss = loss.reshape(())
    return loss


def find_loss(outputs: Any) -> torch.Tensor:
    """The loss in a model's output: a tensor, ``.loss`` (or a mapping's ``"loss"``), or in a
    tuple or list the first item where it is a 0-dim floating tensor, else the tuple's one
    0-dim floating tensor (``(logits, loss)``, nanoGPT's shape); raises naming the
    ``loss_fn`` to pass where no item or several items could be the loss."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    loss = getattr(outputs, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(outputs, Mapping) and isinstance(outputs.get("loss"), torch.Tensor):
        return outputs["loss"]
    if isinstance(outputs, (tuple, list)) and outputs:
        scalars = [
            i
            for i, v in enumerate(outputs)
            if isinstance(v, torch.Tensor) and v.ndim == 0 and v.is_floating_point()
        ]
        if scalars and scalars[0] == 0:
            return outputs[0]
        if len(scalars) == 1:
            return outputs[scalars[0]]
        items = ", ".join(
            f"Tensor{list(v.shape)} {str(v.dtype).removeprefix('torch.')}"
            if isinstance(v, torch.Tensor)
            else type(v).__name__.replace("NoneType", "None")
            for v in outputs
        )
        kind = type(outputs).__name__
        if scalars:
            picks = " or ".join(f"loss_fn=lambda out, batch: out[{i}]" for i in scalars)
            raise ExportError(
                f"the model returned a {kind} ({items}) with several 0-dim float tensors: "
                f"pass the loss to ORTTrainer, {picks}"
            )
        raise ExportError(
            f"the model returned a {kind} ({items}) with no loss (no 0-dim float tensor): "
            "pass the targets in the batch (labels=..., targets=...), or "
            "loss_fn=lambda out, batch: <the loss from out and batch> to ORTTrainer"
        )
    if hasattr(outputs, "loss") or (isinstance(outputs, Mapping) and "loss" in outputs):
        raise ExportError(
            f"the model returned loss=None ({type(outputs).__name__}): pass the targets in the "
            "batch (labels=... for HF models) or loss_fn=(outputs, batch) -> loss to ORTTrainer"
        )
    raise ExportError(
        f"cannot find a loss in the model output of type {type(outputs).__name__}: return a "
        "loss tensor, a tuple holding it (first, or its only 0-dim float tensor), an object "
        "with .loss, or pass loss_fn=(outputs, batch) -> loss to ORTTrainer"
    )


def other_outputs(outputs: Any) -> list[tuple[str, torch.Tensor]]:
    """Tensor outputs besides the loss, with a user-facing key each: a mapping's key (a
    dataclass's field) or ``output_<i>`` for a tuple's item, and inside a tuple, list or
    dict among them the path to the tensor (``hidden_states.3``: per-layer states)."""
    if isinstance(outputs, Mapping) or _is_dataclass_instance(outputs):
        items = [(k, v) for k, v in _named_items(outputs) if k != "loss"]
    elif isinstance(outputs, (tuple, list)):
        items = [(f"output_{i}", v) for i, v in enumerate(outputs) if i]
    else:
        return []
    return [found for key, value in items for found in _nested_tensors(key, value)]


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _named_items(value: Any) -> list[tuple[str, Any]]:
    """A mapping's items, or a dataclass's fields (a hand-written output class)."""
    if isinstance(value, Mapping):
        return [(str(k), v) for k, v in value.items()]
    return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]


def _nested_tensors(key: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors in plain containers (not a model's cache objects, which stay out)."""
    if isinstance(value, torch.Tensor):
        return [(key, value)]
    if isinstance(value, Mapping) or _is_dataclass_instance(value):
        inner = [(f"{key}.{k}", v) for k, v in _named_items(value)]
    elif isinstance(value, (tuple, list)):
        inner = [(f"{key}.{i}", v) for i, v in enumerate(value)]
    else:
        return []
    return [found for k, v in inner for found in _nested_tensors(k, v)]


class _SharedList(list):
    """A list that survives the exporter's deepcopy of the module (it records keys)."""

    def __deepcopy__(self, memo: dict) -> _SharedList:
        return self


def _containers(value: Any) -> Any:
    """What says that a forward changed a Python container it was given: the nesting and
    which object each item is (``bank.append(h)``, ``cfg["k"] = v``)."""
    leaves, spec = pytree.tree_flatten(value)
    return spec, [id(v) for v in leaves]


class _Functional(torch.nn.Module):
    """forward(*params, *buffers, *batch) -> (loss, *others) through functional_call."""

    def __init__(self, module, pnames, bnames, batch_keys, const_kwargs, loss_fn, with_outputs):
        super().__init__()
        self.module = module
        self.pnames, self.bnames, self.batch_keys = pnames, bnames, batch_keys
        self.const_kwargs = const_kwargs
        self.loss_fn = loss_fn
        self.with_outputs = with_outputs
        self.output_keys = _SharedList()

    def forward(self, *flat):
        n, nb = len(self.pnames), len(self.bnames)
        state = dict(zip(self.pnames, flat[:n]))
        state.update(zip(self.bnames, flat[n : n + nb]))
        batch = dict(zip(self.batch_keys, flat[n + nb :]))
        # the batch's Python containers as copies (a list the forward appends to), their
        # tensors the graph's inputs (ortrain/nested_batch.py)
        const = {k: nested_batch.filled(v, batch) for k, v in self.const_kwargs.items()}
        before = {k: _containers(v) for k, v in const.items()}
        leaves = {
            leaf.name
            for v in self.const_kwargs.values()
            for leaf in pytree.tree_leaves(v)
            if isinstance(leaf, nested_batch.Slot)
        }
        kwargs = {**const, **{k: v for k, v in batch.items() if k not in leaves}}
        args, model_kwargs = call_arguments(self.module, kwargs)
        outputs = torch.func.functional_call(
            self.module, state, args, model_kwargs, tie_weights=True
        )
        if changed := [k for k, v in const.items() if _containers(v) != before[k]]:
            raise ExportError(
                f"{type(self.module).__name__}'s forward changes its argument "
                f"{', '.join(changed)} in place (a Python container: eager changes the "
                "caller's, a graph cannot)"
            )
        loss = step_loss(outputs, kwargs, self.loss_fn)
        if isinstance(loss, torch.Tensor) and loss.dtype == torch.float64:
            # float64 targets (numpy's default) promote the loss: the graph reports it in
            # float32, as the step's loss buffer is; its gradient flows back through the cast
            loss = loss.float()
        # Mutate in place: the exporter may not keep attribute assignments on the module.
        self.output_keys.clear()
        self.output_keys.append("loss")
        if not self.with_outputs:
            return loss
        others = other_outputs(outputs)
        self.output_keys.extend(k for k, _ in others)
        return (loss, *[v for _, v in others])


def _attention_dropout(module: torch.nn.Module) -> float:
    """The attention-probability dropout of an HF model using ``sdpa`` attention, else 0."""
    cfg = getattr(module, "config", None)
    if cfg is None or getattr(cfg, "_attn_implementation", None) != "sdpa":
        return 0.0
    return max(
        float(getattr(cfg, name, 0.0) or 0.0)
        for name in ("attn_pdrop", "attention_probs_dropout_prob", "attention_dropout")
    )


@contextlib.contextmanager
def _eager_attention_for_dropout(module: torch.nn.Module, train: bool):
    """Export a training graph of an sdpa model with attention dropout through HF's eager
    attention (same math, and its dropout is exported), then switch back."""
    switch = (
        train
        and module.training
        and _attention_dropout(module) > 0
        and hasattr(module, "set_attn_implementation")
    )
    if switch:
        try:
            module.set_attn_implementation("eager")
        except (ValueError, ImportError):  # no eager attention: sdpa's dropout is kept
            switch = False  # by the export's own attention (export_functional.py, 6.)
    try:
        yield
    finally:
        if switch:
            module.set_attn_implementation("sdpa")


def export_forward(
    module: torch.nn.Module,
    batch: Mapping[str, Any],
    *,
    train: bool,
    loss_fn: LossFn | None = None,
    with_outputs: bool = False,
) -> ExportedForward:
    """Export ``module`` on ``batch`` (a normalized name -> value mapping).

    On Linux CPU the exporter runs in a forked child that sends the graph back
    (``ortrain/forked.py``): what dynamo and the exporter leave behind (never returned to
    the OS) stays out of this process.
    """
    export = functools.partial(export_here, module, batch, train, loss_fn, with_outputs)
    if not can_fork(_tensors(module, batch)):
        return run_here(export)
    return ExportedForward.from_wire(call_forked(lambda: export().to_wire(), what="ONNX export"))


def _tensors(module: torch.nn.Module, batch: Mapping[str, Any]) -> list[torch.Tensor]:
    tensors = [*module.parameters(), *module.buffers()]
    return tensors + [v for v in batch.values() if isinstance(v, torch.Tensor)]


def _root_cause(exc: BaseException, outer: BaseException | None = None) -> BaseException:
    """The innermost exception of ``exc``'s cause/context chain, short of ``outer``: the
    exception being handled where the export began (a segment's export runs while the
    whole model's failure is handled; its cause is not this export's)."""
    seen = {id(exc)}
    while True:
        nxt = exc.__cause__ or exc.__context__
        if nxt is None or id(nxt) in seen or nxt is outer:
            return exc
        seen.add(id(nxt))
        exc = nxt


_TRACED_LINE = re.compile(
    r"# File: (?P<path>[^\n]*?):(?P<line>\d+) in (?P<fn>\w+), code: (?P<code>[^\n]*)"
)


def _failing_code(exc: BaseException) -> str:
    """' (at file.py:N in fn: `code`)': the last line of the model's source that
    torch.export traced before it stopped, from the partial graph its errors carry."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        graph = getattr(cur, "partial_fx_graph", None)
        if isinstance(graph, str):
            found = _TRACED_LINE.findall(graph)
            if found:
                path, line, fn, code = found[-1]
                return f" (at {os.path.basename(path)}:{line} in {fn}: `{code.strip()}`)"
        cur = cur.__cause__ or cur.__context__
    return ""


def _unaliased(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy for every batch tensor passed again under another name.

    The exporter makes one graph input of one tensor object: with ``input_ids=ids,
    labels=ids`` (the usual causal-LM call) the graph would read ``labels`` for both, and a
    later batch with other labels would be fed to the embedding too.
    """
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        out[k] = v.clone() if id(v) in seen else v
        seen.add(id(v))
    return out


def export_here(
    module: torch.nn.Module,
    batch: Mapping[str, Any],
    train: bool,
    loss_fn: LossFn | None,
    with_outputs: bool,
    dynamic: Mapping[str, Sequence[int]] | None = None,
) -> ExportedForward:
    """The export itself, in this process. ``dynamic``: batch tensor -> the axes whose
    size is symbolic in the export (``ortrain/length_family.py``)."""
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    tensors, consts = nested_batch.split(batch)
    clash = set(tensors) & (set(params) | set(buffers))
    if clash:
        raise ExportError(f"batch input names clash with parameter names: {sorted(clash)}")
    # The trace needs the batch where the module is (a trainer on CUDA passes the host batch
    # it will copy per step; only shapes and dtypes matter here).
    device = next((t.device for t in [*params.values(), *buffers.values()]), None)
    if device is not None:
        tensors = {k: v.to(device) for k, v in tensors.items()}
    tensors = _unaliased(tensors)
    pnames, keys = list(params), list(tensors)
    wrapper = _Functional(module, pnames, [], keys, consts, loss_fn, with_outputs)
    axes = [tuple((dynamic or {}).get(k, ())) for k in keys]
    traced = trace_to_onnx(module, wrapper, list(tensors.values()), keys, train, axes)
    model = traced.model
    roles = traced.roles(keys)
    outs = traced.outputs
    if len(outs) != len(wrapper.output_keys):
        raise ExportError(f"export produced {len(outs)} outputs, expected {wrapper.output_keys}")
    loss_v = model.graph.outputs[0]
    if loss_v.shape is None or len(loss_v.shape) != 0:
        raise LossShapeError(
            f"the loss must be a scalar (0-dim or one element) tensor, got shape {loss_v.shape} "
            "(eager's backward() needs one element too); reduce it in the model or in loss_fn"
        )
    return ExportedForward(model, roles, outs, list(wrapper.output_keys), traced.ranges)


@dataclasses.dataclass
class Traced:
    """An exported module: parameters, then buffers, then the given tensors are graph
    inputs; the wrapper's outputs, then the updated buffers, are graph outputs."""

    model: ir.Model
    params: dict[str, bool]  # parameter name -> requires_grad
    buffers: list[str]
    updated: list[str]  # buffers whose new value is an output (``updated:<name>``)
    outputs: list[str]  # the wrapper's outputs (the updated buffers' follow them)
    ranges: dict[str, tuple[int, int | None]] = dataclasses.field(default_factory=dict)

    def roles(self, input_names: list[str], role: Role = Role.BATCH) -> list[GraphIO]:
        """Every graph input with its role (``role`` for the given tensors), then the
        buffer updates."""
        graph_inputs = {v.name for v in self.model.graph.inputs}
        roles = [
            GraphIO(n, Role.PARAMETER if trains else Role.FROZEN_PARAMETER)
            for n, trains in self.params.items()
        ]
        roles += [GraphIO(n, Role.BUFFER) for n in self.buffers]
        roles += [GraphIO(n, role) for n in input_names]
        # The exporter drops inputs that the graph does not read (e.g. an unused buffer).
        roles = [r for r in roles if r.name in graph_inputs]
        return roles + updated_io(self.model, self.updated)


# torch's loggers that a failed export writes to (a data-dependent guard logs the whole
# FX graph, a failing shape check its fake-tensor traceback): the failure reaches the user
# as the ExportError or the fallback's warning, which name the cause and the model's line.
_EXPORT_LOGGERS = (
    "torch.onnx",
    "torch.export",
    "torch._dynamo",
    "torch._subclasses.fake_tensor",
    "torch.fx.experimental.symbolic_shapes",
    # torchlib's own empty-list attributes ("Attribute type is ambiguous"): nothing a
    # user can act on (an index_put of a 1-D index makes one)
    "onnx_ir._convenience",
)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _EXPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _refuse_full_dropout(model: ir.Model) -> None:
    """A Dropout of probability 1 (eager: zeros, and zero gradients) is outside ONNX's
    range [0, 1), which ONNX Runtime's kernels refuse at the first run: refused here,
    so that its module runs in eager (fallback) instead of failing mid-step."""
    for node in model.graph:
        if node.op_type != "Dropout" or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        ratio = node.inputs[1].const_value
        if ratio is not None and float(ratio.numpy().reshape(-1)[0]) >= 1.0:
            raise ExportError(
                f"a dropout of probability 1 ({node.name}), outside the range ONNX's Dropout takes"
            )


def _refuse_input_mutations(module: torch.nn.Module, signature: Any, names: list[str]) -> None:
    """The forward changes a tensor it was given in place (``x.mul_(0.5)`` on a batch
    input, ``p.clamp_()`` on a parameter under ``no_grad``): eager changes the caller's
    tensor, which a graph's outputs do not; refused, so that the module runs in eager
    (fallback) instead of training on with the caller's tensor unchanged."""
    mutated = set(signature.user_inputs_to_mutate.values())
    if not mutated:
        return
    which = [
        f"its input {n[3:]}" if n.startswith("in:") else n  # (a segment's inputs: in:0, ...)
        for n, arg in zip(names, signature.user_inputs, strict=False)
        if arg in mutated
    ]
    raise ExportError(
        f"{type(module).__name__}'s forward changes {', '.join(which) or 'an input'} in "
        "place, which a graph cannot do to the caller's tensor"
    )


def _exported(
    traced: torch.nn.Module, flat: tuple, axes: Sequence[Sequence[int]] = ()
) -> torch.export.ExportedProgram:
    """``traced`` exported as the ONNX exporter would first try it (non-strict), with its
    detached and no-grad values marked (``ortrain/stop_gradient.py``).

    Where that fails, its error is the export's: the exporter's own fallback would try
    non-strict again and then dynamo (strict), seconds per model, and over the
    ``torch.nn`` coverage table strict never exported a model non-strict could not
    (data-dependent shapes stop both); the segments take such a model apart instead."""
    # On failure torch.export prints its partial FX graph to stderr (pages for a model);
    # the ExportError that follows names the cause.
    with (
        without_value_hints(),
        unchanged_module_casts(),
        functional_for_export(),
        reentrant_checkpoints_inline(),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        program = torch.export.export(
            traced, flat, dynamic_shapes=_dynamic_shapes(flat, axes), strict=False
        )
    mark_stop_gradients(program)
    wrap_scalar_operands(program)
    return program


def _dynamic_shapes(flat: tuple, axes: Sequence[Sequence[int]]) -> tuple | None:
    """torch.export's ``dynamic_shapes`` for ``forward(*flat)``: the last ``len(axes)``
    tensors' given axes left to the trace (``Dim.AUTO``: a size the code fixes stays
    fixed, one it bounds keeps the bound, in ``range_constraints``)."""
    if not any(axes):
        return None
    from torch.export import Dim

    specs: list[dict[int, Any] | None] = [None] * (len(flat) - len(axes))
    specs += [{a: Dim.AUTO for a in ax} or None for ax in axes]
    return (tuple(specs),)


def _ranges(program: torch.export.ExportedProgram) -> dict[str, tuple[int, int | None]]:
    """Each size symbol's values the trace holds for (no bound: 0, None)."""
    out: dict[str, tuple[int, int | None]] = {}
    for sym, vr in program.range_constraints.items():
        lower = 0 if "oo" in str(vr.lower) else int(vr.lower)
        upper = None if "oo" in str(vr.upper) else int(vr.upper)
        out[str(sym)] = (lower, upper)
    return out


def trace_to_onnx(
    module: torch.nn.Module,
    wrapper: torch.nn.Module,
    tensors: list[torch.Tensor],
    input_names: list[str],
    train: bool,
    axes: Sequence[Sequence[int]] = (),
) -> Traced:
    """Export ``wrapper`` (a functional view of ``module`` that takes ``module``'s
    parameters, then ``tensors``) with dynamo; ``module``'s buffers become graph inputs
    and, in training mode, the ones the forward writes also outputs."""
    from ortrain.graph_passes.cleanup.export_cleanup import clean_export

    params = dict(module.named_parameters())
    bnames = [n for n, _ in module.named_buffers()]
    pnames = list(params)
    # Buffers stay the module's: torch.export lifts them and lists the ones the forward
    # updates (ortrain/buffer_updates.py makes them graph inputs, the updates outputs).
    returned = bnames if train else []
    traced = WithBuffers(wrapper, module, returned) if returned else wrapper
    flat = tuple(p.detach() for p in params.values()) + tuple(tensors)
    sink = io.StringIO()
    outer = sys.exc_info()[1]  # handled by a caller: not part of this export's chain
    try:
        with (
            in_mode(module, train),
            warnings.catch_warnings(),
            contextlib.redirect_stdout(sink),
            _eager_attention_for_dropout(module, train),
            exportable_batch_norms(module),
            cached_registry(),
            exporter_decompositions(),
            _quiet_torch_logs(),
        ):
            warnings.simplefilter("ignore")
            exported = _exported(traced, flat, axes)
            program = torch.onnx.export(
                exported,
                flat,
                dynamo=True,
                optimize=False,  # below, once the buffers are inputs (not folded)
                verbose=False,
                input_names=pnames + input_names,
                custom_translation_table={
                    **custom_translations(),
                    **loss_translations(),
                    **aten_translations(),
                    **batch_norm_translations(),
                    **stop_gradient_translations(),
                },
            )
            signature = program.exported_program.graph_signature
            _refuse_input_mutations(module, signature, pnames + input_names)
            first_batch = next(
                (i for i, v in enumerate(program.model.graph.inputs) if v.name not in params),
                len(program.model.graph.inputs),
            )
            updated = lift_buffers(
                program.model,
                signature,
                buffer_targets(traced, module),
                after=first_batch,
                returned=returned,
            )
            draw_attention_dropout(program.model)  # before the cleanup removes it
            # not program.optimize(): its no-op rules drop an epsilon below 1e-8 and its
            # CSE merges Dropouts of one input (graph_passes/cleanup/export_cleanup.py)
            clean_export(program.model)
            _refuse_full_dropout(program.model)
    except ExportError:
        raise  # ours, after the trace (an input changed in place)
    except Exception as exc:
        root = _root_cause(exc, outer)
        if isinstance(root, ExportError):  # ours, raised inside the trace (e.g. no loss)
            raise ExportError(str(root)) from exc
        # The exporter wraps the model's own error in pages of advice: name the cause.
        said = f"{type(root).__name__}: {first_line(root)}{_failing_code(exc)}"
        known = known_cause(module)
        if known:
            said = f"{known} (the exporter: {said})"
        raise ExportError(
            f"torch.onnx.export failed for {type(module).__name__}: {said}{export_hint(module)}"
        ) from exc
    model = program.model
    drop_unread_buffers(model, set(bnames))
    model.graph.name = type(module).__name__
    tag_padding_rows(model, module)
    outs = [v.name for v in model.graph.outputs[: len(model.graph.outputs) - len(updated)]]
    trains = {n: p.requires_grad for n, p in params.items()}
    ranges = _ranges(exported) if any(axes) else {}
    return Traced(model, trains, bnames, updated, outs, ranges)
