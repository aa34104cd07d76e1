"""The exporter's own cleanup keeps the math: a tiny epsilon stays (an RMSNorm over a row
of zeros divided by zero, NaN losses: Helium's default ``rms_norm_eps`` is 1e-8), and two
Dropouts of one input keep two masks (its CSE merged them before they were seeded), and a
ScatterND that adds over every row keeps what it adds to."""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from ortrain import ORTTrainer, TrainerOptions
from ortrain.graph_passes.cleanup.export_cleanup import clean_export
from ortrain.graph_passes.cleanup.forward_cleanup import clean_forward

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _model(nodes, inputs, outputs) -> ir.Model:
    g = helper.make_graph(nodes, "g", inputs, outputs)
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    return ir.serde.deserialize_model(proto)


@pytest.mark.parametrize("eps", [1e-8, 1e-9, 1e-12])
def test_clean_export_keeps_a_tiny_epsilon_and_two_dropouts(eps):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "d")]
    nodes = [
        helper.make_node("Constant", [], ["eps"],
                         value=helper.make_tensor("eps", TensorProto.FLOAT, [], [eps])),
        helper.make_node("Constant", [], ["zero"],
                         value=helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])),
        helper.make_node("Constant", [], ["ratio"],
                         value=helper.make_tensor("ratio", TensorProto.FLOAT, [], [0.5])),
        helper.make_node("Constant", [], ["train"],
                         value=helper.make_tensor("train", TensorProto.BOOL, [], [True])),
        helper.make_node("Mul", ["x", "x"], ["sq"]),
        helper.make_node("Add", ["sq", "eps"], ["v"]),
        helper.make_node("Add", ["v", "zero"], ["v0"]),  # an exact no-op still goes
        helper.make_node("Reciprocal", ["v0"], ["y"]),
        helper.make_node("Dropout", ["x", "ratio", "train"], ["d1"]),
        helper.make_node("Dropout", ["x", "ratio", "train"], ["d2"]),
        helper.make_node("Mul", ["d1", "d2"], ["d"]),
    ]  # fmt: skip
    model = _model(nodes, [x], outs)
    clean_export(model)
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["Add"] == 1 and ops["Dropout"] == 2, ops
    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    y = session.run(["y"], {"x": np.zeros((2, 3), np.float32)})[0]
    np.testing.assert_array_equal(y, np.full((2, 3), np.float32(1) / np.float32(eps)))


@pytest.mark.parametrize("clean", [clean_export, clean_forward], ids=["export", "forward"])
def test_a_node_the_folder_cannot_evaluate_stays_without_a_warning(clean, caplog):
    """A Gather of constants whose index is out of range (a branch's, not taken at run
    time) fails in onnx's reference kernel: the node stays and nothing is logged (the
    folder's "Evaluation failed" reached users as a failure that is none)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [
        helper.make_node("Constant", [], ["data"],
                         value=helper.make_tensor("data", TensorProto.FLOAT, [4], [1, 2, 3, 4])),
        helper.make_node("Constant", [], ["at"],
                         value=helper.make_tensor("at", TensorProto.INT64, [1], [7])),
        helper.make_node("Gather", ["data", "at"], ["g"]),
        helper.make_node("Add", ["x", "g"], ["y"]),
    ]  # fmt: skip
    model = _model(nodes, [x], [out])
    with caplog.at_level(logging.DEBUG, logger="onnxscript"):
        clean(model)
    assert any(n.op_type == "Gather" for n in model.graph)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    # the folder's logger as it was before the cleanup
    assert logging.getLogger("onnxscript.optimizer._constant_folding").level == logging.NOTSET


class _ZeroRows(torch.nn.Module):
    """An RMSNorm (eps 1e-8) over embeddings whose padding row is zeros."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16, padding_idx=0)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-8)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_an_rmsnorm_over_zero_rows_trains_like_eager_as_one_graph():
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(3):
        ids = torch.randint(1, 32, (4, 7), generator=g)
        ids[:, 5:] = 0  # padding tokens: rows of zeros into the norm
        labels = torch.randint(0, 5, (4, 7), generator=g).masked_fill(ids == 0, -100)
        batches.append((ids, labels))
    torch.manual_seed(0)
    eager = _ZeroRows()
    compiled = _ZeroRows()
    compiled.load_state_dict(eager.state_dict())
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.5)
    trainer = ORTTrainer(compiled, torch.optim.SGD(compiled.parameters(), lr=0.5),
                         TrainerOptions(fallback="off"))  # fmt: skip
    for ids, labels in batches:
        loss_e = eager(ids, labels)
        loss_e.backward()
        opt_e.step()
        opt_e.zero_grad()
        loss_o = trainer.train_step(ids, labels)
        assert torch.isfinite(torch.as_tensor(loss_o))
        torch.testing.assert_close(float(loss_o), float(loss_e), rtol=1e-5, atol=1e-6)
    assert trainer.program.whole and trainer.segments is None
    trainer.sync_to_module()
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


class _TwoDropouts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale
        return (F.dropout(h, 0.5, self.training) * F.dropout(h, 0.5, self.training)).mean()


def test_two_dropouts_of_one_input_draw_two_masks():
    # E[d1 * d2] = mean(x²) for independent masks, twice that for one mask drawn twice
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    model = _TwoDropouts()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), TrainerOptions())
    ratio = float(trainer.train_step(x)) / float(x.pow(2).mean())
    assert 0.85 < ratio < 1.15, ratio


@pytest.mark.parametrize("cleanup", ["export", "forward"])
def test_a_dropout_of_a_constant_is_not_folded(cleanup):
    from ortrain.graph_passes.cleanup.forward_cleanup import clean_forward

    c = helper.make_tensor("c", TensorProto.FLOAT, [64], np.linspace(1, 2, 64).tolist())
    nodes = [
        helper.make_node("Constant", [], ["ratio"],
                         value=helper.make_tensor("ratio", TensorProto.FLOAT, [], [0.5])),
        helper.make_node("Constant", [], ["train"],
                         value=helper.make_tensor("train", TensorProto.BOOL, [], [True])),
        helper.make_node("Constant", [], ["const"], value=c),
        helper.make_node("Dropout", ["const", "ratio", "train"], ["d"], seed=3),
        helper.make_node("Mul", ["x", "d"], ["y"]),
    ]  # fmt: skip
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])
    model = _model(nodes, [x], [y])
    (clean_export if cleanup == "export" else clean_forward)(model)
    assert [n.op_type for n in model.graph].count("Dropout") == 1


class _DropsAConstant(torch.nn.Module):
    """Funnel's pattern: dropout of sinusoid position embeddings, built from constants."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.sin(torch.arange(x.shape[1] * 16, dtype=torch.float32) / 7.0)
        return (self.proj(x) + self.drop(pos.view(x.shape[1], 16))).pow(2).mean()


def test_a_dropout_of_a_constant_draws_a_mask_every_step():
    """Folded, the mask was drawn once at build time: every step the same loss, and the
    first step (checked with dropout off) disagreed with eager."""
    torch.manual_seed(0)
    model = _DropsAConstant()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0),
                         TrainerOptions(fallback="off"))  # fmt: skip
    x = torch.randn(4, 12, 16, generator=torch.Generator().manual_seed(0))
    losses = [trainer.train_step(x).item() for _ in range(4)]
    assert trainer.program.whole and len(set(losses)) == 4, losses


@pytest.mark.parametrize("clean", [clean_export, clean_forward], ids=["export", "forward"])
def test_an_input_returned_as_it_is_keeps_its_name(clean):
    """onnx_ir's OutputFixPass puts an Identity behind a graph input that is also an
    output and renamed the input ``<name>_orig``; inputs are bound by name, so ONNX
    Runtime refused the run (``Missing Input: x_orig``). The input keeps its name; the
    Identity's output takes a fresh one, and the session runs."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "x")]
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [x], outs)
    clean(model)
    assert [v.name for v in model.graph.inputs] == ["x"]
    names = [v.name for v in model.graph.outputs]
    assert names[0] == "y" and names[1] != "x" and len(set(names)) == 2
    ident = model.graph.outputs[1].producer()
    assert ident is not None and ident.op_type == "Identity"
    assert ident.inputs[0] is model.graph.inputs[0]
    proto = ir.serde.serialize_model(model)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)
    y, same = sess.run(None, {"x": feed})
    np.testing.assert_array_equal(y, np.maximum(feed, 0))
    np.testing.assert_array_equal(same, feed)


class _ReturnsItsInput(torch.nn.Module):
    """A forward that returns its argument and a parameter as they are, beside the loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 3)
        self.gain = torch.nn.Parameter(torch.ones(3))

    def forward(self, x, y):
        return F.cross_entropy(self.lin(x) * self.gain, y), x, self.gain


def test_a_model_returning_its_input_trains_and_evaluates():
    """Training took the loss only; the evaluation graph returns every output, and its
    run stopped at the renamed input. Both now as eager, on one graph."""
    model, ref = _ReturnsItsInput(), _ReturnsItsInput()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        want = ref(x, y)[0]
        opt.zero_grad()
        want.backward()
        opt.step()
        torch.testing.assert_close(trainer.train_step(x, y), want.detach(), msg=f"step {step}")
    assert trainer.segments is None and len(trainer.train_graphs) == 1
    got = trainer.eval_step(x, y)
    with torch.no_grad():
        loss, same, gain = ref.eval()(x, y)
    torch.testing.assert_close(got["loss"], loss)
    torch.testing.assert_close(got["output_1"], same, rtol=0, atol=0)
    torch.testing.assert_close(got["output_2"], gain)


_PRINTS_NOTHING = """
import torch
from ortrain import ORTTrainer, TrainerOptions


class InversePermutation(torch.nn.Module):
    # rows sorted, then put back by the inverse permutation (inv[perm] = arange, as
    # mixture-of-experts layers undo their sort): an index_put whose translation makes
    # an empty-list attribute
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        perm = torch.argsort(x.sum(-1))
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        return (self.lin(x[perm])[inv] - x).pow(2).mean()


torch.manual_seed(0)
model, ref = InversePermutation(), InversePermutation()
ref.load_state_dict(model.state_dict())
x = torch.randn(6, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
trainer = ORTTrainer(model, opt, TrainerOptions(), loss_fn=lambda out, batch: out)
loss = trainer.train_step(x=x)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
expected = ref(x)
expected.backward()
ref_opt.step()
torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-7)
for p, q in zip(model.parameters(), ref.parameters(), strict=True):
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
assert trainer.build_count == 1
print("trained")
"""


def test_an_export_prints_nothing_of_its_own(tmp_path):
    """The exporter's internal log lines (onnx_ir's "Attribute type is ambiguous", made
    by torchlib's translation of an index_put) do not reach a user's console; the model
    trains like eager. In a fresh interpreter: pytest's log capture would hide them."""
    env = {**os.environ, "ORTRAIN_GRAPH_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", _PRINTS_NOTHING], env=env, capture_output=True, text=True,
        timeout=300, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("trained"), done.stdout
    said = [ln for ln in done.stderr.splitlines() if not ln.startswith("ortrain: ")]
    assert not said, done.stderr


@pytest.mark.parametrize("clean", [clean_export, clean_forward])
@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_a_scatter_over_every_row_is_dropped_only_where_it_replaces(clean, reduction):
    # onnxscript's ScatterAllStatic replaced any such ScatterND by its updates, also one
    # that adds (index_add over every row), dropping the data and its gradient
    data = helper.make_tensor_value_info("data", TensorProto.FLOAT, [3, 2])
    upd = helper.make_tensor_value_info("upd", TensorProto.FLOAT, [3, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])
    idx = helper.make_tensor("idx", TensorProto.INT64, [3, 1], [0, 1, 2])
    attrs = {} if reduction == "none" else {"reduction": reduction}
    nodes = [
        helper.make_node("Constant", [], ["i"], value=idx),
        helper.make_node("ScatterND", ["data", "i", "upd"], ["y"], **attrs),
    ]
    model = _model(nodes, [data, upd], [y])
    clean(model)
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["ScatterND"] == (0 if reduction == "none" else 1), ops
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((3, 2)).astype(np.float32) for n in ("data", "upd")}
    proto = ir.serde.serialize_model(model)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    got = sess.run(None, {k: v for k, v in feeds.items() if k in names})[0]
    d, u = torch.from_numpy(feeds["data"]), torch.from_numpy(feeds["upd"])
    want = {"none": u, "add": d + u, "mul": d * u, "max": torch.maximum(d, u),
            "min": torch.minimum(d, u)}[reduction]  # fmt: skip
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)


class _AddEveryRow(torch.nn.Module):
    def __init__(self, shape: tuple[int, ...], index: list[int], dim: int):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(shape, generator=g))
        self.b = torch.nn.Parameter(torch.randn(shape, generator=g))
        self.register_buffer("index", torch.tensor(index))
        self.register_buffer("w", torch.randn(shape, generator=g))
        self.dim = dim

    def forward(self, x):
        y = torch.index_add(self.a + x, self.dim, self.index, self.b, alpha=-1)
        return (y * self.w).sum()


@pytest.mark.parametrize(
    ("shape", "index", "dim"),
    [((1,), [0], 0), ((3,), [0, 1, 2], 0), ((1, 2), [0], 0), ((2, 1), [0], 1), ((), [0], 0)],
)
def test_index_add_over_every_row_keeps_what_it_adds_to(shape, index, dim):
    # with the first-step check off, nothing else would see a loss without `a`
    model, ref = _AddEveryRow(shape, index, dim), _AddEveryRow(shape, index, dim)
    x = torch.zeros(shape)
    trainer = ORTTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerOptions(build_progress=False, fallback="off", verify=False),
    )
    loss = trainer.train_step(x)
    trainer.sync_to_module()
    assert trainer.segments is None
    want = ref(x)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            getattr(model, name).detach(), (p - 0.1 * p.grad).detach(), rtol=1e-6, atol=1e-6
        )
