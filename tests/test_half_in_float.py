"""bf16 nodes ONNX Runtime's CPU provider has no kernel for, computed in float32
(graph_passes/targets/cpu/half_in_float.py): the session that refused the graph runs it,
with torch's values, and a model that computes a part in bfloat16 (or keeps a bfloat16
buffer) trains as one graph."""

from __future__ import annotations

import copy

import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from ortrain.graph_passes.targets.cpu.half_in_float import compute_half_in_float

BF16, FP16, F32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT


def _graph(bf16: int = BF16, fp16: int = FP16) -> onnx.ModelProto:
    """bf16 element-wise ops, a softmax and a product, ops ONNX Runtime has bf16 kernels
    for (Transpose, Gather), and an fp16 product (ONNX Runtime casts float16 itself)."""
    nodes = [
        oh.make_node("Cast", ["x"], ["xb"], to=bf16),
        oh.make_node("Cast", ["y"], ["yb"], to=bf16),
        oh.make_node("Mul", ["xb", "yb"], ["m"]),
        oh.make_node("Add", ["m", "xb"], ["a"]),
        oh.make_node("Div", ["a", "yb"], ["d"]),
        oh.make_node("Transpose", ["d"], ["t"], perm=[1, 0]),
        oh.make_node("Softmax", ["t"], ["s"], axis=-1),
        oh.make_node("MatMul", ["s", "d"], ["p"]),
        oh.make_node("Gather", ["p", "idx"], ["g"], axis=0),
        oh.make_node("Cast", ["g"], ["out"], to=F32),
        oh.make_node("Cast", ["x"], ["xh"], to=fp16),
        oh.make_node("Mul", ["xh", "xh"], ["hh"]),
        oh.make_node("Cast", ["hh"], ["out_h"], to=F32),
    ]
    graph = oh.make_graph(
        nodes,
        "half",
        [oh.make_tensor_value_info(n, F32, [4, 4]) for n in ("x", "y")],
        [oh.make_tensor_value_info(n, F32, [None, None]) for n in ("out", "out_h")],
        [oh.make_tensor("idx", onnx.TensorProto.INT64, [2], [3, 1])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(model)  # every value typed, as an export's are


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_refused_nodes_run_in_float32_with_torchs_values():
    proto = _graph()
    with pytest.raises(Exception, match="NOT_IMPLEMENTED"):
        _session(proto)
    model = ir.serde.deserialize_model(proto)
    assert compute_half_in_float(model) == 5  # Mul Add Div Softmax MatMul
    ops = [n.op_type for n in model.graph]
    assert ops.count("Transpose") == 1 and ops.count("Gather") == 1  # kernels at bf16: kept
    (fp16_mul,) = [n for n in model.graph if n.op_type == "Mul" and n.inputs[0].name == "xh"]
    assert fp16_mul.inputs[0].dtype == ir.DataType.FLOAT16  # left to ONNX Runtime
    # each 16-bit input cast up once (xb, yb, a... as read), each output cast back
    ops5 = ("Mul", "Add", "Div", "Softmax", "MatMul")
    rewritten = [n for n in model.graph if n.op_type in ops5 and n is not fp16_mul]
    assert len(rewritten) == 5
    for node in rewritten:
        assert all(v.dtype == ir.DataType.FLOAT for v in node.inputs), node
        assert all(v.dtype == ir.DataType.FLOAT for v in node.outputs), node
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 4, generator=g), torch.rand(4, 4, generator=g) + 0.5
    got = _session(ir.serde.serialize_model(model)).run(None, {"x": x.numpy(), "y": y.numpy()})
    xb, yb = x.bfloat16(), y.bfloat16()
    d = (xb * yb + xb) / yb  # torch's bf16 CPU ops: float32 math, rounded once each
    want = (d.T.softmax(-1) @ d)[[3, 1]].float()
    # element-wise results are torch's exactly; the softmax and product accumulate in
    # float32 as torch's do, in another order: bf16 rounding of the result apart at most
    torch.testing.assert_close(torch.from_numpy(got[0]), want, rtol=2**-7, atol=1e-6)
    assert got[1].shape == (4, 4)  # the float16 node runs: ONNX Runtime's own casts


def test_float32_graphs_are_left_alone():
    proto = _graph(F32, F32)
    model = ir.serde.deserialize_model(proto)
    before = [(n.op_type, [v.name for v in n.inputs]) for n in model.graph]
    assert compute_half_in_float(model) == 0
    assert [(n.op_type, [v.name for v in n.inputs]) for n in model.graph] == before


def test_graphs_without_bfloat16_never_list_the_kernel_registry(monkeypatch):
    """Listing ONNX Runtime's kernel registry makes every provider of the build: in
    onnxruntime-gpu it starts CUDA and crashes without TensorRT's libnvinfer (as an H200
    run found). A graph without a bfloat16 value must not ask it."""
    import ortrain.graph_passes.targets.cpu.half_in_float as pass_mod

    def refuse():
        raise AssertionError("the kernel registry was listed")

    monkeypatch.setattr(pass_mod, "cpu_kernels", refuse)
    monkeypatch.setattr(pass_mod, "_session_accepts", lambda *a: refuse())
    for dtypes in ((F32, F32), (F32, FP16)):
        assert compute_half_in_float(ir.serde.deserialize_model(_graph(*dtypes))) == 0


def _ops_graph() -> onnx.ModelProto:
    """bf16 nodes of many ops (unary, binary, reductions, shapes, normalization, index),
    each with or without a CPU kernel at bfloat16."""
    x = "xb"
    nodes = [oh.make_node("Cast", ["x"], [x], to=BF16)]
    unary = ["Relu", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Neg", "Abs", "Erf", "Identity",
             "Softplus", "Reciprocal", "Floor", "Sin", "Cos"]  # fmt: skip
    binary = ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Equal", "Less", "Greater"]
    for op in unary:
        nodes.append(oh.make_node(op, [x], [f"u_{op}"]))
    for op in binary:
        nodes.append(oh.make_node(op, [x, x], [f"b_{op}"]))
    nodes += [
        oh.make_node("ReduceSum", [x, "axes"], ["r_sum"], keepdims=1),
        oh.make_node("ReduceMean", [x, "axes"], ["r_mean"], keepdims=1),
        oh.make_node("ReduceMax", [x, "axes"], ["r_max"], keepdims=1),
        oh.make_node("Transpose", [x], ["t"], perm=[1, 0]),
        oh.make_node("Reshape", [x, "shape"], ["rs"]),
        oh.make_node("Concat", [x, x], ["cc"], axis=0),
        oh.make_node("Slice", [x, "starts", "ends"], ["sl"]),
        oh.make_node("Gather", [x, "idx"], ["g"], axis=0),
        oh.make_node("Where", ["cond", x, x], ["w"]),
        oh.make_node("LayerNormalization", [x, "scale", "bias"], ["ln"], axis=-1),
        oh.make_node("Softmax", [x], ["sm"], axis=-1),
        oh.make_node("MatMul", [x, x], ["mm"]),
        oh.make_node("Gemm", [x, x], ["gm"]),
        oh.make_node("Expand", [x, "shape"], ["ex"]),
        oh.make_node("Cast", [x], ["c16"], to=FP16),
    ]
    nodes += [
        oh.make_node("Cast", ["x"], ["cond"], to=onnx.TensorProto.BOOL),
        oh.make_node("Cast", ["w1"], ["scale"], to=BF16),
        oh.make_node("Cast", ["w1"], ["bias"], to=BF16),
    ]
    ints = onnx.TensorProto.INT64
    graph = oh.make_graph(
        nodes,
        "ops",
        [oh.make_tensor_value_info("x", F32, [4, 4]), oh.make_tensor_value_info("w1", F32, [4])],
        [],
        [
            oh.make_tensor("axes", ints, [1], [1]),
            oh.make_tensor("shape", ints, [2], [4, 4]),
            oh.make_tensor("starts", ints, [1], [1]),
            oh.make_tensor("ends", ints, [1], [3]),
            oh.make_tensor("idx", ints, [2], [3, 1]),
        ],
    )
    model = onnx.shape_inference.infer_shapes(
        oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    )
    inferred = {v.name: v for v in model.graph.value_info}
    # every op's result an output, with its inferred element type
    model.graph.output.extend(inferred[n.output[0]] for n in nodes[1:-3])
    return model


@pytest.mark.parametrize("make", [_graph, _ops_graph], ids=["mixed", "ops"])
def test_one_node_sessions_decide_as_the_kernel_registry(monkeypatch, make):
    """Builds whose registry is unsafe to list (onnxruntime-gpu) ask one-node sessions on
    the CPU provider: the same nodes are computed in float32 as the registry decides, and
    the rewritten graph makes a session."""
    import ortrain.graph_passes.targets.cpu.half_in_float as pass_mod

    def rewritten(safe: bool) -> tuple[int, list[str]]:
        monkeypatch.setattr(pass_mod, "registry_is_safe", lambda: safe)
        model = ir.serde.deserialize_model(make())
        count = compute_half_in_float(model)
        _session(ir.serde.serialize_model(model))
        floats = [
            n.name or n.outputs[0].name
            for n in model.graph
            if n.op_type != "Cast" and any(v.dtype == ir.DataType.FLOAT for v in n.inputs)
        ]
        return count, floats

    by_registry, by_sessions = rewritten(True), rewritten(False)
    assert by_sessions == by_registry
    assert by_registry[0] >= 5, by_registry  # nodes refused at bfloat16 ...
    kept = [n for n in ir.serde.deserialize_model(make()).graph if n.op_type != "Cast"]
    assert by_registry[0] < len(kept)  # ... and nodes with a bfloat16 kernel, kept


class AlibiBf16(torch.nn.Module):
    """Attention with ALiBi slopes computed in bfloat16, as Falcon computes them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(40, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 40)

    def forward(self, ids, labels):
        h = self.emb(ids)
        b, n, _ = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, 2, 8).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        slopes = torch.tensor([0.5, 0.25])
        positions = (ids >= 0).long().cumsum(-1) - 1  # from the batch, as Falcon's mask's
        alibi = slopes[None, :, None].bfloat16() * positions[:, None, :].bfloat16()
        scores = q @ k.transpose(-1, -2) / 8**0.5 + alibi[:, :, None, :].float()
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        att = scores.masked_fill(causal, float("-inf")).softmax(-1)
        out = (att @ v).transpose(1, 2).reshape(b, n, 16)
        return F.cross_entropy(self.head(out).flatten(0, 1), labels.flatten())


def test_a_model_computing_in_bfloat16_trains_as_one_graph_like_eager():
    model = AlibiBf16()
    ref = copy.deepcopy(model)
    options = TrainerOptions(graph_cache=False, fallback="off")
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 40, (2, 12), generator=g)
        opt.zero_grad()
        want = ref(ids, ids)
        want.backward()
        opt.step()
        torch.testing.assert_close(trainer.train_step(ids, ids), want.detach(), rtol=1e-5, atol=0)
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert [s.kind for s in trainer.program.segments] == ["graph"]
    (graph,) = trainer.train_graphs
    # the graph computes in bf16 still (its casts), and nothing is left without a kernel
    to_bf16 = [n for n in graph.graph if n.op_type == "Cast" and n.attributes["to"].value == BF16]
    assert to_bf16 and compute_half_in_float(graph) == 0


class _Bf16Buffer(torch.nn.Module):
    """A bfloat16 buffer the forward scales by (RecurrentGemma's embedding normalizer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(30, 8)
        self.head = torch.nn.Linear(8, 30)
        self.register_buffer("normalizer", torch.tensor(8**0.5, dtype=torch.bfloat16))

    def forward(self, ids, labels):
        h = self.emb(ids) * self.normalizer.type(torch.float32)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_a_bfloat16_buffer_is_bound_and_trains_like_eager():
    """The buffer is a bfloat16 graph input, bound as ONNX's BFLOAT16 (numpy has none)."""
    model = _Bf16Buffer()
    ref = copy.deepcopy(model)
    options = TrainerOptions(graph_cache=False, fallback="off")
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        ids = torch.randint(0, 30, (2, 6), generator=g)
        opt.zero_grad()
        want = ref(ids, ids)
        want.backward()
        opt.step()
        torch.testing.assert_close(trainer.train_step(ids, ids), want.detach(), rtol=1e-5, atol=0)
    (graph,) = trainer.train_graphs
    inputs = {v.name: v.dtype for v in graph.graph.inputs}
    assert inputs["normalizer"] == ir.DataType.BFLOAT16
    assert [s.kind for s in trainer.program.segments] == ["graph"]
