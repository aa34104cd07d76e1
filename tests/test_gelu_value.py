"""The GELU gradient kernels' optional GELU output and the ``gelu_value`` pass.

- ``GeluGrad`` / ``FastGeluGrad`` with two outputs: Y against numpy's GELU in float64,
  dX bit-identical to the one-output kernel;
- the pass on a hand-built backward: the recomputed copy goes where a matching kernel
  reads the same X, and stays for the other approximation, a kernel that depends on the
  copy (a cycle) and an untagged GELU; the rewritten graph computes the original;
- training an MLP (both GELUs) and GPT-2 with it against eager.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from scipy.special import erf

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.infra.tags import RECOMPUTE_OF
from ortrain.graph_passes.targets.cpu.gelu_value import take_gelu_values
from tests.test_grad_kernels import _assert_close, _f32, _library, _run

F32 = TensorProto.FLOAT


def _gelu64(x: np.ndarray, tanh: bool) -> np.ndarray:
    x = x.astype(np.float64)
    if tanh:
        k = math.sqrt(2 / math.pi)
        return 0.5 * x * (1 + np.tanh(k * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


@pytest.mark.parametrize("tanh", [False, True], ids=["erf", "tanh"])
@pytest.mark.parametrize("shape", [(7,), (3, 33), (5, 4099)], ids=str)
def test_second_output_is_the_gelu(shape: tuple[int, ...], tanh: bool) -> None:
    rng = np.random.default_rng(len(shape) + tanh)
    x, dy = _f32(rng, shape, 3.0), _f32(rng, shape)
    x.reshape(-1)[:4] = [0.0, -60.0, 60.0, 1e-30]
    op = "FastGeluGrad" if tanh else "GeluGrad"
    dx, y = _run(op, {"dY": dy, "X": x}, outputs=2)
    (alone,) = _run(op, {"dY": dy, "X": x})
    np.testing.assert_array_equal(dx, alone)
    # the value's float32 evaluation: a few roundoffs of |x| (x * cdf, cdf <= 1)
    _assert_close(y, _gelu64(x, tanh), np.abs(x.astype(np.float64)), ulps=8)


# --------------------------------------------------------------------------- the pass
def _backward() -> tuple[onnx.ModelProto, ir.Model]:
    """Four recomputed-GELU sites over x0..x3 [6, 40]; each copy feeds a weight gradient
    ``copy^T @ dz``. Only site 0 can take its copy from the kernel."""
    mk = helper.make_node
    nodes = []
    for i, (approx, kernel) in enumerate(
        [("tanh", "FastGeluGrad"), ("none", "FastGeluGrad"), ("tanh", "FastGeluGrad"),
         ("none", "GeluGrad")]
    ):  # fmt: skip
        x, g = f"x{i}", f"g{i}"
        nodes += [
            mk("Gelu", [x], [g], approximate=approx, name=f"copy{i}"),
            mk("Transpose", [g], [f"gt{i}"]),
            mk("MatMul", [f"gt{i}", "dz"], [f"dw{i}"]),
        ]
        dy = "dy" if i != 2 else "dy2"  # site 2: the kernel reads the copy (a cycle)
        if i == 2:
            nodes.append(mk("Mul", [g, "dy"], ["dy2"]))
        nodes.append(mk(kernel, [dy, x], [f"dx{i}"], domain=CPU_DOMAIN))
    shapes = {"dy": [6, 40], "dz": [6, 8], **{f"x{i}": [6, 40] for i in range(4)}}
    vis = [helper.make_tensor_value_info(n, F32, s) for n, s in shapes.items()]
    outs = [helper.make_tensor_value_info(f"{p}{i}", F32, None) for p in "dw dx".split()
            for i in range(4)]  # fmt: skip
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid(CPU_DOMAIN, 1)]
    proto = helper.make_model(helper.make_graph(nodes, "g", vis, outs), opset_imports=opsets)
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))
    for node in model.graph:
        if node.op_type == "Gelu" and node.name != "copy3":  # site 3: not a recompute
            node.metadata_props[RECOMPUTE_OF] = f"forward_gelu_{node.name}"
        for o in node.outputs:
            if o.dtype is None:
                o.dtype, o.shape = ir.DataType.FLOAT, ir.Shape([6, 40])
    return proto, model


def test_pass_takes_the_copy_where_a_kernel_can_make_it() -> None:
    lib = _library()
    proto, model = _backward()
    assert take_gelu_values(model) == 1
    copies = sorted(n.name for n in model.graph if n.op_type == "Gelu")
    assert copies == ["copy1", "copy2", "copy3"]
    kernel = next(n for n in model.graph if n.outputs[0].name == "dx0")
    assert len(kernel.outputs) == 2 and kernel.outputs[1].name == "g0"
    order = [n.outputs[0].name for n in model.graph]
    assert order.index("dx0") < order.index("gt0")  # sorted: the kernel before its reader
    rng = np.random.default_rng(0)
    feeds = {i.name: _f32(rng, tuple(d.dim_value for d in i.type.tensor_type.shape.dim))
             for i in proto.graph.input}  # fmt: skip
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    new = ir.serde.serialize_model(model).SerializeToString()
    got = ort.InferenceSession(new, so, providers=["CPUExecutionProvider"]).run(None, feeds)
    want = ort.InferenceSession(proto.SerializeToString(), so).run(None, feeds)
    for g, w in zip(got, want, strict=True):  # two GELU implementations: a few roundoffs
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * np.abs(w).max())


# --------------------------------------------------------------------------- training
class _MLP(torch.nn.Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.up = torch.nn.Linear(24, 96)
        self.act = torch.nn.GELU(approximate=approximate)
        self.down = torch.nn.Linear(96, 24)
        self.head = torch.nn.Linear(24, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = x + self.down(self.act(self.up(x)))
        return torch.nn.functional.cross_entropy(self.head(h), labels)


@pytest.mark.slow
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_mlp_trains_like_eager_with_the_gelu_from_its_kernel(approximate: str) -> None:
    _library()
    torch.manual_seed(0)
    model = _MLP(approximate)
    ref = _MLP(approximate)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    trainer = ORTTrainer(model, opt, TrainerOptions(cpu_kernels="ortrain"))
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, labels = torch.randn(32, 24, generator=g), torch.randint(0, 5, (32,), generator=g)
        loss = trainer.train_step(x=x, labels=labels)
        ref_opt.zero_grad()
        ref_loss = ref(x, labels)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    rec = next(r for r in trainer.build_log if r.graph == "train" and r.stage == "gelu_value")
    assert rec.op_delta == {"Gelu": -1}, rec.op_delta
    kernel = "FastGeluGrad" if approximate == "tanh" else "GeluGrad"
    graph = trainer.train_graphs[0].graph
    assert [len(n.outputs) for n in graph if n.op_type == kernel] == [2]
    assert not [n for n in graph if n.op_type == "Gelu" and RECOMPUTE_OF in n.metadata_props]
