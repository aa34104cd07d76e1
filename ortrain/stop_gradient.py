"""``x.detach()`` and ``torch.no_grad()`` kept through the export.

Eager autograd does not differentiate through a detached value or one computed under
``torch.no_grad()`` (spectral_norm's power iteration, a target built from the model's own
output, an exponential moving average). ``torch.export`` records both (``aten.detach``,
the ``wrap_with_set_grad_enabled`` higher-order op), but its decomposition to the ATen
opset that the ONNX exporter runs drops them: autodiff over the ONNX graph would then
differentiate through them, a different gradient with no error.

Here, on the exported program before the ONNX export: every such value that depends on a
floating input (a parameter, a differentiable input) goes through ``ortrain::stop_gradient``,
a custom op that the decomposition keeps and that is translated to
``ortrain.grad::StopGradient``. Autodiff lets no gradient through it
(``rules/nondiff.py``) and ``graph_passes/cleanup/drop_stop_gradients.py`` removes it
after autodiff, before ONNX Runtime sees the graph. Values that depend on no floating
input (masks from token ids, constants) are left as they are: no gradient reaches them
anyway, and the passes may fold them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from ortrain.core.names import GRAD_DOMAIN, STOP_GRADIENT


@torch.library.custom_op("ortrain::stop_gradient", mutates_args=())
def stop_gradient(x: torch.Tensor) -> torch.Tensor:
    """The identity that the export keeps (``x.clone()``: a custom op may not return an
    alias of its input)."""
    return x.clone()


@stop_gradient.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_TYPES = ("float", "double", "float16", "bfloat16", "int8", "int16", "int32", "int64")
_TYPES += ("uint8", "uint16", "uint32", "uint64", "bool")


def _schema() -> None:
    """ONNX's schema of StopGradient, which onnxscript needs to emit the node."""
    import onnx

    if onnx.defs.has(STOP_GRADIENT, GRAD_DOMAIN):
        return
    types = [f"tensor({t})" for t in _TYPES]
    schema = onnx.defs.OpSchema(
        STOP_GRADIENT,
        GRAD_DOMAIN,
        1,
        doc="The identity; autodiff lets no gradient through it.",
        inputs=[onnx.defs.OpSchema.FormalParameter("x", "T")],
        outputs=[onnx.defs.OpSchema.FormalParameter("y", "T")],
        type_constraints=[("T", types, "any tensor")],
    )
    onnx.defs.register_schema(schema)


def _translate(x: Any) -> Any:
    from onnxscript import values

    _schema()
    return values.Opset(GRAD_DOMAIN, 1).StopGradient(x)


def translations() -> dict[Callable, Callable]:
    return {torch.ops.ortrain.stop_gradient.default: _translate}


def _floating(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _grad_off(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is torch.ops.higher_order.wrap_with_set_grad_enabled
        and node.args[0] is False
    )


def _written(node: torch.fx.Node) -> bool:
    """Some reader changes ``node``'s value in place (``Embedding(max_norm=...)``'s renorm
    of its detached weight changes the parameter): an alias, not a copy, so it stays (the
    export refuses the in-place write, and the module trains in eager)."""
    for user in node.users:
        schema = getattr(user.target, "_schema", None)
        if schema is None:
            continue
        for arg, value in zip(schema.arguments, user.args, strict=False):
            if value is node and arg.alias_info is not None and arg.alias_info.is_write:
                return True
    return False


def mark_stop_gradients(program: torch.export.ExportedProgram) -> int:
    """Put ``stop_gradient`` after every detached or no-grad value of ``program`` that
    depends on a floating input; returns how many (module docstring)."""
    graph = program.graph_module.graph
    depends: set[torch.fx.Node] = set()
    sites: list[torch.fx.Node] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            if _floating(node):
                depends.add(node)
            continue
        if node.op != "call_function" or not any(n in depends for n in node.all_input_nodes):
            continue
        depends.add(node)
        if node.target is torch.ops.aten.detach.default and _floating(node) and not _written(node):
            node.target = torch.ops.ortrain.stop_gradient.default
            sites.append(node)
        elif _grad_off(node):
            for user in list(node.users):
                if user.target is operator.getitem and _floating(user):
                    with graph.inserting_after(user):
                        stop = graph.call_function(torch.ops.ortrain.stop_gradient.default, (user,))
                    stop.meta = dict(user.meta)
                    # not in the outputs: a buffer or parameter the block updates keeps
                    # its own value there (the export's mutation record)
                    user.replace_all_uses_with(
                        stop, delete_user_cb=lambda n, s=stop: n is not s and n.op != "output"
                    )
                    sites.append(stop)
    if sites:
        program.graph_module.recompile()
    return len(sites)
