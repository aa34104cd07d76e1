"""graph_passes/ort_order.py: the serialized node order that makes ONNX Runtime compute a
tagged input first (and free what it reads early)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from graph_passes.ort_order import order_for_ort
from graph_passes.tags import RUN_INPUT_FIRST


def _graph(tag: bool, dense_readers: int = 1) -> onnx.ModelProto:
    """``dense = MatMul(x, w)`` (early) and a chain of 6 Tanh from ``x`` (late) meet in a
    ScatterElements into ``dense``; with ``dense_readers=2`` an Identity also reads it."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["dense"], name="dense_mm")]
    prev = "x"
    for i in range(6):
        nodes.append(helper.make_node("Tanh", [prev], [f"t{i}"], name=f"chain{i}"))
        prev = f"t{i}"
    nodes.append(helper.make_node("Slice", [prev, "starts", "ends"], ["upd"], name="rows"))
    scatter = helper.make_node(
        "ScatterElements", ["dense", "idx", "upd"], ["grad"], name="into_sum", reduction="add"
    )
    if tag:
        scatter.metadata_props.add(key=RUN_INPUT_FIRST, value="0")
    nodes.append(scatter)
    outputs = [helper.make_tensor_value_info("grad", TensorProto.FLOAT, [8, 8])]
    if dense_readers == 2:
        nodes.append(helper.make_node("Identity", ["dense"], ["dense_copy"], name="copy"))
        outputs.append(helper.make_tensor_value_info("dense_copy", TensorProto.FLOAT, [8, 8]))
    inits = [
        helper.make_tensor("starts", TensorProto.INT64, [1], [0]),
        helper.make_tensor("ends", TensorProto.INT64, [1], [2]),
        helper.make_tensor("idx", TensorProto.INT64, [2, 8], [0] * 8 + [3] * 8),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 8]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 8]),
        ],
        outputs,
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _names(model: onnx.ModelProto) -> list[str]:
    return [n.name for n in model.graph.node]


def _ort_order(model: onnx.ModelProto, tmp_path) -> tuple[list[str], np.ndarray]:
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal((8, 8)).astype(np.float32) for k in ("x", "w")}
    out = sess.run(["grad"], feeds)[0]
    events = json.load(open(sess.end_profiling()))
    order = [
        e["name"].removesuffix("_kernel_time")
        for e in events
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
    ]
    return order, out


def test_tagged_input_producer_moves_next_to_its_reader(tmp_path):
    model = _graph(tag=True)
    before = _names(model)
    assert before.index("dense_mm") == 0
    assert order_for_ort(model.graph) == 1
    after = _names(model)
    assert after.index("dense_mm") == after.index("into_sum") - 1
    assert sorted(after) == sorted(before)
    onnx.checker.check_model(model)  # still topologically sorted


def test_onnx_runtime_then_runs_it_before_the_long_chain(tmp_path):
    """The reason for the pass: ONNX Runtime's default order visits higher-index producers
    first, so as written the early MatMul runs last, after the whole chain."""
    plain, moved = _graph(tag=True), _graph(tag=True)
    order_for_ort(moved.graph)
    order_plain, out_plain = _ort_order(plain, tmp_path)
    order_moved, out_moved = _ort_order(moved, tmp_path)
    assert order_plain.index("dense_mm") > order_plain.index("chain5")
    assert order_moved.index("dense_mm") < order_moved.index("chain0")
    np.testing.assert_array_equal(out_moved, out_plain)  # same graph, same result


def test_untagged_or_shared_producers_stay(tmp_path):
    untagged = _graph(tag=False)
    assert order_for_ort(untagged.graph) == 0
    shared = _graph(tag=True, dense_readers=2)
    before = _names(shared)
    assert order_for_ort(shared.graph) == 0  # another node reads it: it may not move
    assert _names(shared) == before


def test_gpt2_lm_head_gradient_is_tagged_and_moved():
    """In GPT-2's training graph (tied embedding) the LM head's weight gradient is the
    dense term the embedding's rows are scattered into; serialized for ONNX Runtime it sits
    right before that scatter."""
    import onnx_ir as ir
    import torch

    from ortrain import ORTTrainer
    from tests.conftest import gpt2, lm_batches

    model = gpt2(layers=1, hidden=64, vocab=128)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    trainer.train_step(**lm_batches(1, vocab=128)[0])
    proto = ir.serde.serialize_model(trainer.train_graphs[0])
    tagged = [
        n for n in proto.graph.node if any(p.key == RUN_INPUT_FIRST for p in n.metadata_props)
    ]
    assert [n.op_type for n in tagged] == ["ScatterElements"]
    assert tagged[0].output[0] == "grad:transformer.wte.weight"
    assert order_for_ort(proto.graph) == 1
    names = [n.name for n in proto.graph.node]
    i = names.index(tagged[0].name)
    assert proto.graph.node[i - 1].op_type == "Gemm"
    assert proto.graph.node[i - 1].output[0] == tagged[0].input[0]
