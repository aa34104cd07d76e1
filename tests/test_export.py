"""export_forward in a forked child vs in this process (ortrain/export.py)."""

from __future__ import annotations

import collections
import copy
import os
import warnings

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import ExportError
from ortrain.core.roles import Role
from ortrain.export import export_forward
from tests.conftest import bert_batches, bert_mlm

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph)


def _run(model: ir.Model, feeds: dict) -> list[np.ndarray]:
    data = ir.serde.serialize_model(model).SerializeToString()
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return sess.run(None, {v.name: feeds[v.name] for v in model.graph.inputs})


@pytest.mark.slow
def test_child_export_equals_in_process_export(monkeypatch):
    model = bert_mlm(hidden=64, layers=1)
    batch = bert_batches(1, batch=2, seq=16)[0]
    forks = []
    real_fork = os.fork

    def counting_fork() -> int:
        forks.append(1)
        return real_fork()

    monkeypatch.setattr(os, "fork", counting_fork)
    child = export_forward(model, batch, train=False, with_outputs=True)
    assert forks == [1]
    monkeypatch.setenv("ORTRAIN_EXPORT_IN_PROCESS", "1")
    here = export_forward(model, batch, train=False, with_outputs=True)
    assert forks == [1]
    assert _ops(child.model) == _ops(here.model)
    assert [v.name for v in child.model.graph.inputs] == [v.name for v in here.model.graph.inputs]
    assert (child.io, child.output_names, child.output_keys) == (
        here.io,
        here.output_names,
        here.output_keys,
    )
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    feeds = {n: t.detach().numpy() for n, t in state.items()}
    feeds.update({k: v.numpy() for k, v in batch.items()})
    for a, b in zip(_run(child.model, feeds), _run(here.model, feeds), strict=True):
        np.testing.assert_array_equal(a, b)
    with torch.no_grad():
        want = model.eval()(**batch)
    np.testing.assert_allclose(_run(child.model, feeds)[0], want.loss.numpy(), rtol=1e-5)


class _NoScalarLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)  # not a scalar: export_forward refuses it


def test_child_export_errors_reach_the_caller():
    with pytest.raises(ExportError, match="the loss must be a scalar"):
        export_forward(_NoScalarLoss(), {"x": torch.randn(2, 4)}, train=True)


class _BatchNormNet(torch.nn.Module):
    def __init__(self, norm: type[torch.nn.Module] = torch.nn.BatchNorm1d) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 8)
        self.norm = norm(8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.lin(x)).relu()
        return torch.nn.functional.cross_entropy(self.head(h), y)


def test_batch_norm_running_statistics_are_graph_outputs():
    """BatchNorm's running-statistics update (torch.export's buffer mutations) becomes
    outputs with the UPDATED_BUFFER role; an eval graph reads the buffers and writes none
    (training parity: tests/test_batch_norm.py)."""
    model = _BatchNormNet()
    batch = {"x": torch.randn(16, 6), "y": torch.randint(0, 2, (16,))}
    ex = export_forward(model, batch, train=True)
    stats = ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    updated = {r.of: r.name for r in ex.io if r.role is Role.UPDATED_BUFFER}
    assert sorted(updated) == sorted(stats)
    outputs = [v.name for v in ex.model.graph.outputs]
    assert outputs[0] == ex.output_names[0] and set(updated.values()) <= set(outputs)
    assert [r.name for r in ex.io if r.role is Role.BUFFER] == stats
    # normalized with the batch statistics, in inference mode (ortrain/buffer_updates.py)
    (bn,) = [n for n in ex.model.graph if n.op_type == "BatchNormalization"]
    assert bn.attributes.get_int("training_mode", 0) == 0
    assert not any(v.is_graph_input() for v in bn.inputs[3:])
    ev = export_forward(model, batch, train=False)
    (bn,) = [n for n in ev.model.graph if n.op_type == "BatchNormalization"]
    assert [v.name for v in bn.inputs[3:]] == stats[:2]
    assert not [r for r in ev.io if r.role is Role.UPDATED_BUFFER]
    assert len(ev.model.graph.outputs) == len(ev.output_names)
    assert model.training and model.norm.num_batches_tracked.item() == 0


def test_sync_batch_norm_in_training_is_named_and_nothing_changes():
    """SyncBatchNorm in training mode would share statistics across ranks, which ortrain
    does not do: the trainer names the layer, leaves the module's mode and weights alone,
    and an eval graph (no update) still builds. In evaluation mode it is a BatchNorm on its
    running statistics and trains as eager does."""
    model = _BatchNormNet(torch.nn.SyncBatchNorm).train()
    ref = copy.deepcopy(model).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opts = TrainerOptions(fallback="off")  # the refusal (eager itself refuses it on CPU)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), opts)
    x, y = torch.randn(16, 6), torch.randint(0, 2, (16,))
    with pytest.raises(ExportError, match=r"SyncBatchNorm 'norm' is not supported in training"):
        trainer.train_step(x, y)
    assert model.training and model.norm.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    out = trainer.eval_step(x, y)
    with torch.no_grad():
        torch.testing.assert_close(out["loss"], ref(x, y), rtol=1e-5, atol=1e-6)
    model.eval()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = ref(x, y)
    want.backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "trains it in evaluation mode"
        torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=1e-6)
    for (k, v), r in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(v, r, rtol=1e-5, atol=1e-6, msg=k)


_GARBAGE_SESSION = """
import gc, os, sys
import numpy as np, onnxruntime as ort, torch
from onnx import TensorProto, helper
from ortrain.export import export_forward

g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
so = ort.SessionOptions(); so.intra_op_num_threads = 2
finalized = []

class Holder:
    def __del__(self):
        with open(sys.argv[1], "a") as f:
            f.write(f"{os.getpid()}\\n")

gc.disable()
holder = Holder()
holder.session = ort.InferenceSession(m.SerializeToString(), so)
holder.session.run(None, {"x": np.ones(4, np.float32)})  # its pool's threads exist now
holder.self = holder  # a cycle: garbage that only the collector frees
del holder  # (the collector stays off until the export has forked)

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        gc.collect()  # runs in the exporting child
        return self.lin(x).square().mean()

ex = export_forward(Model(), {"x": torch.randn(2, 4)}, train=True)
gc.collect()  # here the parent finalizes it
print("exported", len(ex.model.graph), os.getpid())
"""


@pytest.mark.slow
def test_child_export_finalizes_nothing_it_inherited(tmp_path):
    # Garbage at fork time (here an ONNX Runtime session in a cycle) must not be
    # finalized in the child: a session's destructor joins thread-pool threads that the
    # fork did not copy, and can hang there (seen in CI before gc.freeze()).
    import subprocess
    import sys

    from tests.conftest import ROOT

    marker = tmp_path / "finalized"
    proc = subprocess.run([sys.executable, "-c", _GARBAGE_SESSION, str(marker)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "exported" in proc.stdout, proc.stderr[-2000:]
    parent = proc.stdout.split()[-1]
    assert marker.read_text().split() == [parent]  # once, by the parent only


def test_embedding_padding_idx_is_tagged_on_its_gather():
    """BERT's word embedding has padding_idx = pad_token_id (0); the position and token-type
    embeddings have none. The Gather gradient rule reads the tag."""
    from ortrain.graph_passes.infra.tags import PADDING_IDX

    model = bert_mlm()
    ex = export_forward(model, bert_batches(1)[0], train=True)
    tags = {
        n.inputs[0].name: n.metadata_props.get(PADDING_IDX)
        for n in ex.model.graph
        if n.op_type == "Gather" and n.inputs[0] is not None and n.inputs[0].name.endswith("weight")
    }
    assert tags == {
        "bert.embeddings.word_embeddings.weight": "0",
        "bert.embeddings.position_embeddings.weight": None,
        "bert.embeddings.token_type_embeddings.weight": None,
    }


@pytest.mark.slow
def test_pad_row_of_an_embedding_gets_no_gradient():
    """Left padding with the pad token's row in the loss (a causal LM predicting the first
    real token from the last pad): eager leaves the padding_idx row out of the gradient."""
    import copy

    from transformers import OPTConfig, OPTForCausalLM

    from ortrain import ORTTrainer

    torch.manual_seed(0)
    ref = OPTForCausalLM(OPTConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64,
        max_position_embeddings=16, word_embed_proj_dim=32, attn_implementation="eager",
        pad_token_id=1, dropout=0.0, tie_word_embeddings=False,
    ))  # fmt: skip
    model = copy.deepcopy(ref)
    ids = torch.randint(2, 64, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids[0, :4] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    ref(**batch).loss.backward()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.train_step(**batch)
    name = "model.decoder.embed_tokens.weight"
    ref_grad = dict(ref.named_parameters())[name].grad
    assert not ref_grad[1].any() and ref_grad[2:].abs().sum() > 0
    torch.testing.assert_close(trainer.grads[name], ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "fx, scopes, expected",
    [
        ("call_function[target=torch.ops.aten.embedding.default](args = (%w, %i, 2), kwargs = {})",
         None, "2"),
        ("call_function[target=torch.ops.aten.embedding.default](args = (%w, %i), "
         "kwargs = {padding_idx: 3})", None, "3"),
        ("call_function[target=torch.ops.aten.embedding.default](args = (%w, %i), kwargs = {})",
         None, None),
        ("call_function[target=torch.ops.aten.index.Tensor](args = (%w, [%i]), kwargs = {})",
         None, None),
        # No FX record: the nn.Embedding named by the node's scope (padding_idx=1 below).
        (None, "['', 'module', 'module.emb', 'embedding']", "1"),
        (None, "['', 'module', 'module.other', 'embedding']", None),
    ],
)  # fmt: skip
def test_padding_idx_from_fx_record_or_module_scope(fx, scopes, expected):
    from ortrain.graph_passes.infra.tags import PADDING_IDX
    from ortrain.padding_rows import tag_padding_rows

    module = torch.nn.Module()
    module.emb = torch.nn.Embedding(5, 3, padding_idx=1)
    w = ir.Value(name="emb.weight", shape=ir.Shape([5, 3]), type=ir.TensorType(ir.DataType.FLOAT))
    i = ir.Value(name="ids", shape=ir.Shape([4]), type=ir.TensorType(ir.DataType.INT64))
    meta = {}
    if fx is not None:
        meta["pkg.torch.onnx.fx_node"] = fx
    if scopes is not None:
        meta["pkg.torch.onnx.name_scopes"] = scopes
    node = ir.Node("", "Gather", [w, i], metadata_props=meta)
    graph = ir.Graph([w, i], node.outputs, nodes=[node], opset_imports={"": 20})
    assert tag_padding_rows(ir.Model(graph, ir_version=10), module) == (expected is not None)
    assert node.metadata_props.get(PADDING_IDX) == expected


class _ChecksItsLabels(torch.nn.Module):
    """A forward that validates its labels by value (as HF's CTC heads do): torch.export
    cannot trace a branch on data."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if y.max() >= 3:
            raise ValueError("labels out of range")
        return torch.nn.functional.cross_entropy(self.lin(x), y)


def test_export_error_names_the_model_line_and_prints_nothing(capfd):
    """The error names the model's source line where tracing stopped; torch's partial
    graph and its guard warnings do not reach the user's terminal."""
    with pytest.raises(ExportError) as info:
        batch = {"x": torch.randn(2, 4), "y": torch.tensor([0, 2])}
        export_forward(_ChecksItsLabels(), batch, train=True)
    message = str(info.value)
    assert "torch.onnx.export failed for _ChecksItsLabels" in message
    assert "(at test_export.py:" in message and "in forward: `if y.max() >= 3:`)" in message
    out, err = capfd.readouterr()
    assert "def forward" not in out + err and "Unable to find user code" not in err
    assert "Traceback" not in err
