"""graph_passes/memory/ort_order.py: the serialized node order that makes ONNX Runtime finish
each gradient output as soon as the graph's order would (and free what it reads)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from ortrain.graph_passes.memory.ort_order import order_for_ort

H = 8


def _two_layer_backward() -> onnx.ModelProto:
    """A hand-made backward of two linear layers, in the graph's order: the output
    gradient ``g2``, the last layer's weight gradient (``dw2``, early), the input-gradient
    chain through it (``g1``, a few Tanh standing in for more layers), then ``dw1``."""
    n = helper.make_node
    nodes = [
        n("Tanh", ["seed"], ["g2"], name="g2"),
        n("Gemm", ["x2", "g2"], ["dw2"], name="dw2", transA=1),  # leaf, early
        n("Gemm", ["g2", "w2"], ["g1_0"], name="dx2", transB=1),
    ]
    prev = "g1_0"
    for i in range(4):
        nodes.append(n("Tanh", [prev], [f"g1_{i + 1}"], name=f"chain{i}"))
        prev = f"g1_{i + 1}"
    nodes.append(n("Gemm", ["x1", prev], ["dw1"], name="dw1", transA=1))  # leaf, late
    nodes.append(n("Gemm", [prev, "w1"], ["dx1"], name="dx1", transB=1))  # leaf, last
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(k, f, [H, H]) for k in ("seed", "x1", "x2", "w1", "w2")]
    outputs = [helper.make_tensor_value_info(k, f, [H, H]) for k in ("dw2", "dw1", "dx1")]
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _names(model: onnx.ModelProto) -> list[str]:
    return [node.name for node in model.graph.node]


def _ort_order(model: onnx.ModelProto, tmp_path) -> tuple[list[str], list[np.ndarray]]:
    """The order ONNX Runtime executed the nodes in (its profiler), and the outputs."""
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal((H, H)).astype(np.float32) for i in sess.get_inputs()}
    outs = sess.run(None, feeds)
    events = json.load(open(sess.end_profiling()))
    order = [
        e["name"].removesuffix("_kernel_time")
        for e in events
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
    ]
    return order, outs


def test_leaves_move_to_the_end_in_reverse_order():
    model = _two_layer_backward()
    before = _names(model)
    assert order_for_ort(model.graph) == 3
    after = _names(model)
    assert after[-3:] == ["dx1", "dw1", "dw2"]
    assert after[:-3] == [name for name in before if name not in ("dw2", "dw1", "dx1")]
    onnx.checker.check_model(model)  # still topologically sorted


def test_onnx_runtime_then_computes_the_early_weight_gradient_early(tmp_path):
    """The reason for the pass: as written, ONNX Runtime's reverse DFS runs the whole
    input-gradient chain before the early weight gradient."""
    plain, moved = _two_layer_backward(), _two_layer_backward()
    order_for_ort(moved.graph)
    order_plain, out_plain = _ort_order(plain, tmp_path)
    order_moved, out_moved = _ort_order(moved, tmp_path)
    assert order_plain.index("dw2") > order_plain.index("chain3")
    assert order_moved.index("dw2") < order_moved.index("chain0")
    for a, b in zip(out_moved, out_plain):
        np.testing.assert_array_equal(a, b)  # same graph, same results


def test_a_value_read_inside_a_subgraph_is_not_a_leaf():
    """An If branch reading ``y`` makes the If its reader: ``y``'s producer stays."""
    n = helper.make_node
    f = TensorProto.FLOAT
    then = helper.make_graph(
        [n("Neg", ["y"], ["t"], name="neg")],
        "then",
        [],
        [helper.make_tensor_value_info("t", f, [2])],
    )
    other = helper.make_graph(
        [n("Abs", ["y"], ["e"], name="abs")],
        "else",
        [],
        [helper.make_tensor_value_info("e", f, [2])],
    )
    nodes = [
        n("Relu", ["x"], ["y"], name="y"),
        n("If", ["c"], ["z"], name="if", then_branch=then, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", f, [2]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("z", f, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert order_for_ort(model.graph) == 1
    assert _names(model) == ["y", "if"]


def test_gpt2_training_graph_gradients_last_in_reverse_order():
    """In GPT-2's gradient graph the gradient outputs' producers are leaves (but fused
    LayerNorm backwards); serialized for ONNX Runtime they close the file, the one the
    graph computes first last."""
    import onnx_ir as ir
    import torch

    from ortrain import ORTTrainer, TrainerOptions
    from tests.conftest import gpt2, lm_batches

    model = gpt2(layers=2, hidden=64, vocab=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = ORTTrainer(model, opt, TrainerOptions(update_engine="torch"))  # gradient outputs
    trainer.train_step(**lm_batches(1, vocab=128)[0])
    proto = ir.serde.serialize_model(trainer.train_graphs[0])
    grads = {o.name for o in proto.graph.output if o.name.startswith("grad:")}
    assert len(grads) == len(trainer.grad_params)
    # the leaves among the producers of gradient outputs, in graph order (a fused
    # LayerNormGrad kernel also makes the input gradient, which later nodes read)
    read = {i for n in proto.graph.node for i in n.input}
    producers = [n for n in proto.graph.node if grads & set(n.output)]
    graph_order = [n.name for n in producers if not read & set(n.output)]
    assert len(graph_order) >= len(grads) // 2
    count = order_for_ort(proto.graph)
    assert count >= len(graph_order)
    tail = [n.name for n in list(proto.graph.node)[-count:] if n.name in graph_order]
    assert tail == graph_order[::-1]
