"""Label sparsity (graph_passes/training/label_sparsity.py): loss heads on labelled rows only."""

from __future__ import annotations

import collections
import copy
import math

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.names import label_rows_bucket
from ortrain.graph_passes.autodiff import build_gradient_graph
from ortrain.graph_passes.training.label_sparsity import find_label_sites, shrink_label_rows
from tests.conftest import bert_batches, bert_mlm

PARAMS = {"w1": [8, 8], "b1": [8], "g": [8], "beta": [8], "w2": [16, 8], "b2": [16]}


def _head(
    reduction: str = "mean", relu_is_output: bool = False, ignore: int | None = -100
) -> ir.Model:
    """x [2,3,8] -> rows -> MatMul, Add, Relu, LayerNorm, Gemm (16 classes) -> SCE."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    sce_attrs = {"reduction": reduction}
    if ignore is not None:
        sce_attrs["ignore_index"] = ignore
    nodes = [
        helper.make_node("Reshape", ["x", "rows_shape"], ["h"]),
        helper.make_node("MatMul", ["h", "w1"], ["m"]),
        helper.make_node("Add", ["m", "b1"], ["a"]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("LayerNormalization", ["r", "g", "beta"], ["ln"], axis=-1),
        helper.make_node("Gemm", ["ln", "w2", "b2"], ["logits"], transB=1),
        helper.make_node("Reshape", ["labels", "flat_shape"], ["flat"]),
        helper.make_node(
            "SoftmaxCrossEntropyLoss", ["logits", "flat"], ["loss"], name="sce", **sce_attrs
        ),
    ]
    inputs = [helper.make_tensor_value_info("x", f, [2, 3, 8])]
    inputs += [helper.make_tensor_value_info("labels", i64, [2, 3])]
    inputs += [helper.make_tensor_value_info(k, f, s) for k, s in PARAMS.items()]
    outputs = [helper.make_tensor_value_info("loss", f, [])]
    if relu_is_output:
        outputs.append(helper.make_tensor_value_info("r", f, [6, 8]))
    inits = [
        helper.make_tensor("rows_shape", i64, [2], [6, 8]),
        helper.make_tensor("flat_shape", i64, [1], [6]),
    ]
    graph = helper.make_graph(nodes, "head", inputs, outputs, inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    model = ir.serde.deserialize_model(proto)
    shapes = {"h": [6, 8], "m": [6, 8], "a": [6, 8], "r": [6, 8], "ln": [6, 8]}
    shapes |= {"logits": [6, 16], "flat": [6]}
    for node in model.graph:
        for out in node.outputs:
            if out.name in shapes:
                out.shape = ir.Shape(shapes[out.name])
                out.dtype = ir.DataType.INT64 if out.name == "flat" else ir.DataType.FLOAT
    return model


def _feeds(labelled: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in PARAMS.items()}
    feeds["x"] = rng.standard_normal((2, 3, 8)).astype(np.float32)
    labels = np.full(6, -100, dtype=np.int64)
    rows = rng.choice(6, size=labelled, replace=False)
    labels[rows] = rng.integers(0, 16, size=labelled)
    feeds["labels"] = labels.reshape(2, 3)
    return feeds


def _run(model: ir.Model, feeds: dict, outputs: list[str] | None = None) -> list[np.ndarray]:
    data = ir.serde.serialize_model(model).SerializeToString()
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return sess.run(outputs, feeds)


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph)


def _rows(model: ir.Model, op: str) -> list[int]:
    return [n.outputs[0].shape[0] for n in model.graph if n.op_type == op]


def test_bucket_rounds_up_to_a_sixteenth_of_the_rows():
    assert label_rows_bucket(130, 1024) == 192
    assert label_rows_bucket(128, 1024) == 128
    assert label_rows_bucket(0, 1024) == 64  # never an empty graph
    assert label_rows_bucket(1000, 1024) == 1024
    assert label_rows_bucket(5, 7) == 5


def test_site_found_only_for_an_ignore_index_loss_over_input_labels():
    (site,) = find_label_sites(_head())
    assert (site.input, site.ignore_index, site.rows) == ("labels", -100, 6)
    assert find_label_sites(_head(reduction="none")) == []
    assert find_label_sites(_head(ignore=None)) == []


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("labelled", [1, 3, 4])
def test_shrunk_head_gives_the_same_loss(reduction, labelled):
    model = _head(reduction)
    feeds = _feeds(labelled, seed=labelled)
    (want,) = _run(model, feeds)
    site = find_label_sites(model)[0]
    assert shrink_label_rows(model, {site.node: 4}) == 1
    (got,) = _run(model, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    ops = _ops(model)
    assert ops["TopK"] == 1 and ops["Gather"] == 2  # row indices; rows of x and labels
    # Every row-wise op now runs on 4 rows instead of 6.
    for op in ("MatMul", "Add", "Relu", "LayerNormalization", "Gemm"):
        assert _rows(model, op) == [4], op
    (sce,) = (n for n in model.graph if n.op_type == "SoftmaxCrossEntropyLoss")
    assert list(sce.inputs[0].shape) == [4, 16] and list(sce.inputs[1].shape) == [4]


def test_gather_stops_below_a_value_read_elsewhere():
    model = _head(relu_is_output=True)
    site = find_label_sites(model)[0]
    feeds = _feeds(2)
    want = _run(model, feeds)
    shrink_label_rows(model, {site.node: 3})
    got = _run(model, feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_array_equal(got[1], want[1])  # the full Relu output is still there
    assert _rows(model, "Relu") == [6] and _rows(model, "MatMul") == [6]
    assert _rows(model, "LayerNormalization") == [3] and _rows(model, "Gemm") == [3]


def test_full_cap_or_no_site_leaves_the_graph_alone():
    model = _head()
    site = find_label_sites(model)[0]
    before = _ops(model)
    assert shrink_label_rows(model, {site.node: 6}) == 0
    assert shrink_label_rows(model, {}) == 0
    assert _ops(model) == before


def test_gradients_through_the_gathered_rows_equal_the_full_head():
    wrt = ["x", *PARAMS]
    feeds = _feeds(3, seed=7)
    full = _head()
    build_gradient_graph(full, "loss", wrt)
    shrunk = _head()
    shrink_label_rows(shrunk, {find_label_sites(shrunk)[0].node: 4})
    build_gradient_graph(shrunk, "loss", wrt)
    names = [f"grad:{w}" for w in wrt]
    want = _run(full, feeds, names)
    got = _run(shrunk, feeds, names)
    for name, a, b in zip(names, want, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=name)
    # Rows of x that carry no label get exactly zero gradient.
    unlabelled = (feeds["labels"].reshape(-1) == -100).reshape(2, 3)
    assert np.all(got[0][unlabelled] == 0)


class TaggerHead(torch.nn.Module):
    """Not a transformers model: embedding, GELU MLP, LayerNorm, wide classifier, a
    cross-entropy with ignore_index=-1 (a different convention from HF's -100)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, classes: int = 300):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.out = torch.nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + torch.roll(h, 1, dims=1)  # rows mix here: the gather must stay below
        h = self.norm(torch.nn.functional.gelu(self.mix(h)))
        logits = self.out(h)
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tags.reshape(-1), ignore_index=-1
        )


def _tag_batches(n: int, labelled: list[int], seed: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        tags = torch.full((64,), -1)
        k = labelled[i % len(labelled)]
        # the last position labelled: a tail that every row ignores is padding's (its rows
        # kept in a new graph: a longer batch fills them)
        rows = torch.cat([torch.tensor([63]), torch.randperm(63, generator=g)[: k - 1]])
        tags[rows] = torch.randint(0, 300, (k,), generator=g)
        out.append({"ids": ids, "tags": tags.reshape(4, 16)})
    return out


@pytest.mark.parametrize("limit", [None, 2])
def test_trainer_matches_eager_and_builds_one_graph_per_bucket(limit, monkeypatch):
    from ortrain import whole_graph

    if limit is not None:
        monkeypatch.setattr(whole_graph, "BORROW_LIMIT", limit)
    torch.manual_seed(0)
    eager = TaggerHead()
    model = copy.deepcopy(eager)
    # buckets of 4 rows, built with 2 sqrt(n) headroom: 5 labels build 12 rows (5 + 5),
    # 9 run on it, 64 all rows; 3 would build 8 (3 + 4: 12 spares more than one bucket),
    # but borrows the 12 rows' graph ``BORROW_LIMIT`` times first (three times here)
    batches = _tag_batches(12, labelled=[5, 9, 3, 64])
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = ORTTrainer(model, opt, TrainerOptions(intra_op_threads=1))
    for b in batches:
        opt_e.zero_grad()
        want = eager(**b)
        want.backward()
        opt_e.step()
        got = trainer.train_step(**b)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    rows = sorted(_rows(g, "Softmax")[0] for g in trainer.train_graphs)
    assert rows == ([12, 64] if limit is None else [8, 12, 64])


@pytest.mark.slow
@pytest.mark.parametrize("labelled", [[55, 49, 55, 50], [2, 1, 3, 2], [30, 31, 29, 30]])
def test_a_batch_seen_before_never_builds_again(labelled):
    # 55 labels of 64 rows: the build's headroom reaches every row (64), which spares more
    # than one bucket for 55 (56 + 4 < 64); the cache must still run the batch on it.
    torch.manual_seed(0)
    eager = TaggerHead()
    model = copy.deepcopy(eager)
    batches = _tag_batches(3 * len(labelled), labelled=labelled)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    counts = []
    for i, b in enumerate(batches):
        opt_e.zero_grad()
        want = eager(**b)
        want.backward()
        opt_e.step()
        got = trainer.train_step(**b)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        counts.append(trainer.build_count)
        if i >= len(labelled):  # every label count of the cycle has been seen once
            assert trainer.build_count == counts[len(labelled) - 1], counts
    assert counts[-1] <= len(set(labelled)), counts


def test_graph_for_picks_the_smallest_graph_within_one_bucket():
    from ortrain.build import graph_for, label_rows
    from ortrain.core.names import LabelSite

    a, b = LabelSite("a", "la", -100, 64), LabelSite("b", "lb", -100, 32)  # steps 4 and 2
    sites = [a, b]
    assert graph_for(sites, (("a", 8),), [(("a", 12),), (("a", 8),)]) == (("a", 8),)
    assert graph_for(sites, (("a", 8),), [(("a", 16),), (("a", 12),)]) == (("a", 12),)
    assert graph_for(sites, (("a", 8),), [(("a", 16),), (("a", 4),)]) is None
    # a site left out holds all its rows: b needs 32, so only graphs with b whole fit
    assert graph_for(sites, (("a", 8),), [(("a", 8), ("b", 30))]) is None
    assert graph_for(sites, (("a", 8), ("b", 30)), [(("a", 12),)]) == (("a", 12),)
    assert graph_for(sites, (("a", 8), ("b", 26)), [(("a", 12),)]) is None
    labels = torch.full((64,), -100)
    labels[:9] = 1
    batch = {"la": labels, "lb": torch.full((32,), -100)}
    assert label_rows(sites, batch) == (("a", 12), ("b", 2))
    assert label_rows(sites, batch, headroom=True) == (("a", 16), ("b", 2))  # 9 + 6


def test_bert_mlm_decoder_runs_on_the_masked_rows():
    model = bert_mlm(hidden=64, layers=1, vocab=1000)
    batch = bert_batches(1, batch=4, seq=32, vocab=1000)[0]
    labelled = int((batch["labels"] != -100).sum())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = ORTTrainer(model, opt, TrainerOptions(intra_op_threads=1))
    trainer.train_step(**batch)
    (graph,) = trainer.train_graphs
    cap = label_rows_bucket(labelled + math.ceil(2 * math.sqrt(labelled)), 128)  # headroom
    assert labelled <= cap < 128
    shapes = [tuple(n.outputs[0].shape) for n in graph.graph if n.outputs[0].shape is not None]
    wide = [s for s in shapes if len(s) == 2 and s[1] == 1000 and s[0] != 1]
    # Decoder GEMM, softmax and their gradients: only the gathered rows.
    assert len(wide) >= 3 and all(s[0] == cap for s in wide), wide
    assert _ops(graph)["TopK"] == 1


def test_a_right_padded_batch_builds_for_the_rows_its_padding_may_hold():
    """Bucketing pads labels with the ignore index: a longer batch of the same bucket fills
    the padded tail, so a new graph keeps its rows (the rows of a tail that every row
    ignores); ``holding`` lends any graph with enough rows."""
    from ortrain.build import holding, label_rows
    from ortrain.core.names import LabelSite

    site = LabelSite("a", "la", -1, 64)  # labels [4, 16], rows in steps of 4
    labels = torch.randint(0, 9, (4, 16))
    labels[:, 10:] = -1  # the padded tail: 24 rows
    labels[0, :3] = -1  # ignored inside the data: not a tail
    assert label_rows([site], {"la": labels}) == (("a", 40),)  # 37 labelled
    # 37 + 2 sqrt(37) + the tail's 24: every row
    assert label_rows([site], {"la": labels}, headroom=True) == ()
    labels[:, 15] = 2  # a real label in the last column: no tail
    assert label_rows([site], {"la": labels}, headroom=True) == (("a", 56),)  # 41 + 13
    assert holding([site], (("a", 20),), [(("a", 56),), (("a", 24),), ()]) == (("a", 24),)
    assert holding([site], (("a", 60),), [(("a", 56),)]) is None
