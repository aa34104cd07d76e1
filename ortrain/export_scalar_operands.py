"""Python numbers where an aten op takes a tensor, made 0-dim tensors before the translation.

``torch.add(0.3333, mask, alpha=0.6667)`` (Phi-3.5-MoE's routing), ``torch.sub(1, x)``,
``torch.where(c, 0.0, x)`` written with the number first: torch wraps the number as a
tensor when it runs the op, and ``torch.export`` records the call as it was made,
``aten.add.Tensor(0.3333, mask)``. The ONNX exporter matches each argument against its
functions' signatures, finds no function whose tensor takes a number, and stops ("Cannot
find a compatible OpOverload"): such a model trained as segments, that call in eager.

Each such number becomes ``aten.scalar_tensor(value)`` of the dtype torch gives a wrapped
number (``bool`` for a bool, ``int64`` for an int, the default float dtype for a float),
which promotes against the other operands as the number did: a 0-dim tensor does not
raise a dimensioned operand's dtype within its category, as a number does not.

``1.0 - mask`` (XLNet's input mask) is recorded as ``aten.rsub.Scalar(mask, 1.0)``, which
the exporter's decompositions turn into ``aten.sub.Tensor(1.0, mask)``, the same failure
one step later: it becomes ``aten.rsub.Tensor(mask, scalar_tensor(1.0))``.
"""

from __future__ import annotations

import torch


def _dtype(value: bool | int | float) -> torch.dtype:
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    return torch.get_default_dtype()


def _tensor_positions(op: torch._ops.OpOverload) -> list[int]:
    """Positional arguments of ``op`` declared as a plain ``Tensor``."""
    return [
        i
        for i, arg in enumerate(op._schema.arguments)
        if not arg.kwarg_only and isinstance(arg.type, torch._C.TensorType)
    ]


def wrap_scalar_operands(program: torch.export.ExportedProgram) -> int:
    """Replace every Python number given for a tensor argument of an aten op in
    ``program`` by a 0-dim tensor node; returns how many (module docstring)."""
    graph = program.graph_module.graph
    fake_mode = next(
        (
            n.meta["val"].fake_mode
            for n in graph.nodes
            if isinstance(n.meta.get("val"), torch._subclasses.FakeTensor)
        ),
        None,
    )
    count = 0
    for node in list(graph.nodes):
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        if op is torch.ops.aten.rsub.Scalar:
            # (self, other, alpha=1): the same call with ``other`` a tensor, alpha kept
            alpha = node.args[2] if len(node.args) > 2 else node.kwargs.get("alpha", 1)
            node.target = op = torch.ops.aten.rsub.Tensor
            node.args, node.kwargs = node.args[:2], {} if alpha == 1 else {"alpha": alpha}
        args = list(node.args)
        for i in _tensor_positions(op):
            value = args[i] if i < len(args) else None
            if not isinstance(value, bool | int | float):
                continue
            dtype = _dtype(value)
            with graph.inserting_before(node):
                wrapped = graph.call_function(
                    torch.ops.aten.scalar_tensor.default, (value,), {"dtype": dtype}
                )
            if fake_mode is not None:
                with fake_mode:
                    wrapped.meta["val"] = torch.scalar_tensor(value, dtype=dtype)
            args[i] = wrapped
            node.args = tuple(args)
            count += 1
    if count:
        program.graph_module.recompile()
    return count
