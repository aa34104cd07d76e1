"""ReLU's backward on ortrain's kernel (``ReluGrad`` in ``ortrain/runtime/grad_kernels.c``,
emitted by the Relu rule of ``graph_passes/autodiff/rules/elementwise.py`` on fp32 CPU
builds with the library):

- bit for bit the rule's standard spelling ``Where(X > 0, dY, 0)``, at zeros of both
  signs, NaN, infinities, one and several blocks, on one thread and two;
- a ``Y`` of another shape refused naming the op;
- a residual CNN and an MLP trained through ``ORTTrainer`` like eager, element by element,
  with every ReLU's backward on the kernel and no ``Greater``/``Where`` left for them.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.names import CPU_DOMAIN
from tests.test_grad_kernels import _library

F32 = TensorProto.FLOAT


def _graph(kernel: bool) -> onnx.ModelProto:
    """dX of a ReLU of x from dy: the kernel on Y, or the standard spelling on X."""
    zero = helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("z", F32, [], [0]))
    relu = helper.make_node("Relu", ["x"], ["y"])
    if kernel:
        back = [helper.make_node("ReluGrad", ["dy", "y"], ["dx"], domain=CPU_DOMAIN)]
    else:
        back = [
            helper.make_node("Greater", ["x", "zero"], ["pos"]),
            helper.make_node("Where", ["pos", "dy", "zero"], ["dx"]),
        ]
    vis = [helper.make_tensor_value_info(n, F32, None) for n in ("x", "dy")]
    outs = [helper.make_tensor_value_info("dx", F32, None)]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]
    return helper.make_model(helper.make_graph([zero, relu, *back], "g", vis, outs),
                             opset_imports=opsets)  # fmt: skip


def _run(kernel: bool, feeds: dict[str, np.ndarray], threads: int = 2) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(_library())
    session = ort.InferenceSession(_graph(kernel).SerializeToString(), so)
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("shape", [(1,), (3, 7), (64, 1000), (2, 3, 5555)])
def test_the_kernel_is_the_rules_standard_spelling(shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    specials = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-45]
    flat[: len(specials)] = specials[: flat.size]
    dy = rng.standard_normal(shape).astype(np.float32)
    want = _run(False, {"x": x, "dy": dy})
    for threads in (1, 2):
        got = _run(True, {"x": x, "dy": dy}, threads)
        np.testing.assert_array_equal(got, want)
    assert (want == 0).any() and ((want != 0).any() or x.size == 1)


def test_a_y_of_another_shape_is_refused_naming_the_op():
    so = ort.SessionOptions()
    so.register_custom_ops_library(_library())
    node = helper.make_node("ReluGrad", ["dy", "y"], ["dx"], domain=CPU_DOMAIN)
    vis = [helper.make_tensor_value_info(n, F32, None) for n in ("dy", "y")]
    outs = [helper.make_tensor_value_info("dx", F32, None)]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]
    model = helper.make_model(helper.make_graph([node], "g", vis, outs), opset_imports=opsets)
    session = ort.InferenceSession(model.SerializeToString(), so)
    feeds = {"dy": np.ones((4, 6), np.float32), "y": np.ones((4, 5), np.float32)}
    with pytest.raises(Exception, match=r"ortrain\.cpu\.ReluGrad: dY is \[4, 6\] but Y"):
        session.run(None, feeds)


# ---------------------------------------------------------------------------- training
class _ResidualCnn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.a = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x, y):
        h = F.relu(self.stem(x))
        h = F.relu(h + self.norm(self.a(h)))
        return F.cross_entropy(self.head(h.mean((2, 3))), y)


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
            torch.nn.Linear(32, 1),
        )  # fmt: skip

    def forward(self, x, y):
        return F.mse_loss(self.net(x).squeeze(-1), y)


def _batches(kind: str, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if kind == "cnn":
        return [{"x": torch.randn(6, 3, 8, 8, generator=g),
                 "y": torch.randint(0, 5, (6,), generator=g)} for _ in range(n)]  # fmt: skip
    return [{"x": torch.randn(16, 12, generator=g), "y": torch.randn(16, generator=g)}
            for _ in range(n)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_models_with_relus_train_like_eager_on_the_kernel(kind):
    _library()
    torch.manual_seed(0)
    ref = _ResidualCnn() if kind == "cnn" else _Mlp()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.05), TrainerOptions(graph_cache=False)
    )
    for batch in _batches(kind, 5):
        opt_ref.zero_grad()
        want = ref(**batch)
        want.backward()
        opt_ref.step()
        got = trainer.train_step(**batch)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    (graph,) = trainer.train_graphs
    relus = [n for n in graph.graph if n.op_type == "Relu"]
    grads = [n for n in graph.graph if n.op_type == "ReluGrad" and n.domain == CPU_DOMAIN]
    assert relus and len(grads) == len(relus)
    assert {g.inputs[1].name for g in grads} == {r.outputs[0].name for r in relus}
    inputs = {r.inputs[0].name for r in relus}  # the standard spelling's Greater(X, 0)
    assert not [n for n in graph.graph if n.op_type == "Greater" and n.inputs[0].name in inputs]
