"""x.detach() and torch.no_grad() through the export (ortrain/stop_gradient.py) and the
pass that removes their markers (graph_passes/cleanup/drop_stop_gradients.py).

The graphs here train with ``verify=False``: the check against eager would catch a
gradient through a detached value and fall back, so only without it does the graph show
whether it stops the gradient itself."""

from __future__ import annotations

import onnx_ir as ir
import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.names import GRAD_DOMAIN, STOP_GRADIENT
from ortrain.graph_passes.cleanup.drop_stop_gradients import drop_stop_gradients
from ortrain.stop_gradient import mark_stop_gradients

UNCHECKED = TrainerOptions(verify=False, fallback="off", build_progress=False)


class _Detached(torch.nn.Module):
    """A loss that reads a value both through the gradient and detached / under no_grad:
    differentiated through, the weight gradient is about twice eager's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 1)

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        with torch.no_grad():
            target = y * 0.5 + 0.1
        gate = torch.sigmoid(self.head(y)).detach()
        return ((y - target) ** 2 * gate).mean() + self.head(y).pow(2).mean()


class _Ema(torch.nn.Module):
    """A target network kept in a buffer and a no-grad decorated helper (BYOL's shape)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.online = torch.nn.Linear(5, 5)
        self.register_buffer("scale", torch.ones(5))

    @torch.no_grad()
    def _target(self, x):
        return torch.nn.functional.normalize(self.online(x) * self.scale, dim=-1)

    def forward(self, x):
        online = torch.nn.functional.normalize(self.online(x), dim=-1)
        return (2 - 2 * (online * self._target(x.flip(0))).sum(-1)).mean()


def _spectral():
    torch.manual_seed(2)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(8, 5)),
    )


class _SpectralLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _spectral()

    def forward(self, x):
        return self.net(x).pow(2).mean()


@pytest.mark.parametrize("make, shape", [(_Detached, (4, 6)), (_Ema, (3, 5)),
                                         (_SpectralLoss, (3, 8))])  # fmt: skip
def test_detached_values_get_no_gradient_in_the_graph(make, shape):
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.3), UNCHECKED)
    opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        x = torch.randn(*shape, generator=g)
        got = trainer.train_step(x)
        opt.zero_grad()
        want = ref(x)
        want.backward()
        if step == 0:
            for name, p in ref.named_parameters():
                torch.testing.assert_close(trainer.grads[name], p.grad, rtol=1e-5, atol=1e-6,
                                           msg=name)  # fmt: skip
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-7)
    assert trainer.segments is None and trainer.build_count == 1
    trainer.sync_to_module()
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    (graph,) = trainer.train_graphs
    nodes = ir.traversal.RecursiveGraphIterator(graph.graph)
    assert not any(n.domain == GRAD_DOMAIN for n in nodes)
    assert GRAD_DOMAIN not in graph.opset_imports


def _program(module: torch.nn.Module, *args) -> torch.export.ExportedProgram:
    return torch.export.export(module, args, strict=False)


def test_only_values_that_depend_on_a_floating_input_are_marked():
    class _Masks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)

        def forward(self, ids):
            with torch.no_grad():
                mask = (ids > 0).float().unsqueeze(-1)  # from integer ids: left alone
                count = mask.sum().clamp(min=1).detach()
            h = self.emb(ids)
            scale = h.detach().abs().mean()  # from a parameter: marked
            return (h * mask).sum() / count / scale

    program = _program(_Masks(), torch.tensor([[1, 0, 3]]))
    assert mark_stop_gradients(program) == 1
    marked = [n for n in program.graph.nodes if n.target is torch.ops.ortrain.stop_gradient.default]
    assert len(marked) == 1 and marked[0].args[0].target is torch.ops.aten.embedding.default


def test_a_no_grad_block_marks_each_floating_output():
    class _Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            y = self.lin(x)
            with torch.no_grad():
                a, b = y * 2, y.argmax(-1)
            return (y * a).sum() + b.sum()

    program = _program(_Two(), torch.randn(2, 3))
    assert mark_stop_gradients(program) == 1  # a; b is an integer


def _stop(x: ir.Value) -> ir.Node:
    return ir.node(STOP_GRADIENT, [x], domain=GRAD_DOMAIN)


def test_the_pass_rewires_readers_and_keeps_an_output_name():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    inner = _stop(x)
    relu = ir.node("Relu", [inner.outputs[0]])
    last = _stop(relu.outputs[0])
    last.outputs[0].name = "out"
    graph = ir.Graph([x], [last.outputs[0]], nodes=[inner, relu, last],
                     opset_imports={"": 18, GRAD_DOMAIN: 1})  # fmt: skip
    model = ir.Model(graph, ir_version=10)
    assert drop_stop_gradients(model) == 2
    assert [n.op_type for n in graph] == ["Relu", "Identity"]
    assert relu.inputs[0] is x and graph.outputs[0].name == "out"
    assert graph.outputs[0].producer().domain == "" and GRAD_DOMAIN not in model.opset_imports


def test_a_detached_alias_written_in_place_is_left_alone():
    # Embedding(max_norm=...) renormalizes its detached weight in place, which changes the
    # parameter: a copy there would drop the write (the export refuses it instead)
    class _Renorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4, max_norm=1.0)

        def forward(self, ids):
            return self.emb(ids).pow(2).sum()

    program = _program(_Renorm(), torch.tensor([[1, 2, 3]]))
    assert mark_stop_gradients(program) == 0
    targets = [n.target for n in program.graph.nodes]
    assert torch.ops.aten.detach.default in targets
