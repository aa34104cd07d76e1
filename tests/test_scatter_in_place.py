"""graph_passes/targets/cpu/scatter_in_place.py: a tied embedding's LM-head weight gradient
written into the gradient buffer, the closing row scatter adding to it in place."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.names import CPU_DOMAIN
from ortrain.core.roles import Role
from ortrain.graph_passes.targets.cpu.scatter_in_place import (
    BASE_PREFIX,
    READY_PREFIX,
    scatter_into_gradients,
)
from ortrain.runtime import cpu_ops
from ortrain.runtime.session import DISABLED_OPTIMIZERS, RECOMPUTE_DISABLED, BoundSession
from tests.test_grad_kernels import _library

V, N, D, R = 37, 11, 6, 9  # vocab rows, product depth, width, scattered rows
GRAD = "grad:w"


def _head_graph(extra_reader: bool = False, base_input: bool = False) -> ir.Model:
    """``grad:w = ScatterAddRows(MatMul(a, b), rows, updates)``: a tied table's gradient.
    ``extra_reader``: the product is also a graph output; ``base_input``: the scatter's base
    is a graph input."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    base = "a" if base_input else "dw"
    nodes = [] if base_input else [helper.make_node("MatMul", ["a", "b"], ["dw"], name="dW")]
    nodes.append(
        helper.make_node(
            "ScatterAddRows", [base, "rows", "updates"], [GRAD], domain=CPU_DOMAIN, name="scatter"
        )
    )
    a_shape = [V, D] if base_input else [V, N]
    inputs = [
        helper.make_tensor_value_info("a", f, a_shape),
        helper.make_tensor_value_info("b", f, [N, D]),
        helper.make_tensor_value_info("rows", i64, [R]),
        helper.make_tensor_value_info("updates", f, [R, D]),
    ]
    outputs = [helper.make_tensor_value_info(GRAD, f, [V, D])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("dw", f, [V, D]))
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(CPU_DOMAIN, 1)]
    infos = [] if extra_reader or base_input else [helper.make_tensor_value_info("dw", f, [V, D])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, value_info=infos)
    proto = helper.make_model(graph, opset_imports=opsets)
    return ir.serde.deserialize_model(proto)


def _feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a": rng.standard_normal((V, N)).astype(np.float32),
        "b": rng.standard_normal((N, D)).astype(np.float32),
        "rows": rng.integers(0, V, R).astype(np.int64),  # repeats included
        "updates": rng.standard_normal((R, D)).astype(np.float32),
    }


def _want(feeds: dict[str, np.ndarray]) -> np.ndarray:
    out = feeds["a"].astype(np.float64) @ feeds["b"].astype(np.float64)
    np.add.at(out, feeds["rows"], feeds["updates"].astype(np.float64))
    return out


def _session(model: ir.Model) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.register_custom_ops_library(_library())
    data = ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def test_rewrite_structure() -> None:
    model = _head_graph()
    assert scatter_into_gradients(model, [GRAD]) == {BASE_PREFIX + GRAD: GRAD}
    g = model.graph
    names = [v.name for v in g.outputs]
    assert names == [GRAD, BASE_PREFIX + GRAD, READY_PREFIX + GRAD]
    scatter = next(n for n in g if n.op_type == "ScatterAddRows")
    product = next(n for n in g if n.op_type == "MatMul")
    assert scatter.inputs[0] is product.outputs[0]  # still an edge: any order is correct
    order = [n.op_type for n in g]
    assert order == ["MatMul", "Slice", "ScatterAddRows"]  # the leaf right after dW
    ready = g.outputs[2]
    assert list(ready.shape) == [0, D] and ready.producer().inputs[0] is product.outputs[0]


@pytest.mark.parametrize("extra_reader, base_input", [(True, False), (False, True)])
def test_left_alone(extra_reader: bool, base_input: bool) -> None:
    model = _head_graph(extra_reader, base_input)
    before = [n.op_type for n in model.graph]
    assert scatter_into_gradients(model, [GRAD]) == {}
    assert [n.op_type for n in model.graph] == before


def test_not_a_gradient_output_left_alone() -> None:
    model = _head_graph()
    assert scatter_into_gradients(model, ["grad:other"]) == {}
    assert len(model.graph.outputs) == 1


def test_outputs_unbound_keep_their_meaning() -> None:
    """Run apart, ``base:`` holds the product and the gradient the product plus the rows."""
    model = _head_graph()
    scatter_into_gradients(model, [GRAD])
    feeds = _feeds()
    grad, base, ready = _session(model).run(None, feeds)
    np.testing.assert_allclose(base, feeds["a"] @ feeds["b"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, _want(feeds), rtol=1e-5, atol=1e-5)
    assert ready.shape == (0, D)


def test_outputs_bound_to_one_buffer_scatter_in_place() -> None:
    """Bound as the trainer binds them (both to the gradient buffer), repeatedly: the
    buffer ends as the product plus the rows, whatever it held before."""
    model = _head_graph()
    shared = scatter_into_gradients(model, [GRAD])
    sess = BoundSession(_session(model))
    buf = torch.full((V, D), 123.0)
    sess.bind_outputs({GRAD: buf, **{out: buf for out in shared}})
    for seed in range(3):
        feeds = _feeds(seed)
        for k, v in feeds.items():
            sess.bind_batch(k, torch.from_numpy(v))
        sess.binding.bind_output(READY_PREFIX + GRAD, "cpu")
        sess.run()
        np.testing.assert_allclose(buf.numpy(), _want(feeds), rtol=1e-5, atol=1e-5)


def _gpt2_trainer(**options: object) -> tuple[ORTTrainer, torch.nn.Module, list[dict]]:
    from tests.conftest import gpt2, lm_batches

    model = gpt2(layers=2, hidden=64, vocab=128)
    options.setdefault("update_engine", "torch")  # gradients bound to the trainer's buffers
    trainer = ORTTrainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), TrainerOptions(**options)
    )
    return trainer, model, lm_batches(3, vocab=128)


def test_gpt2_tied_table_rewritten_and_trains_like_eager() -> None:
    """GPT-2's tied token table: the LM head's gradient Gemm becomes ``base:`` and ONNX
    Runtime runs it right after the head (before any block's backward), and three steps
    of AdamW match eager's parameters."""
    from tests.conftest import gpt2

    trainer, model, batches = _gpt2_trainer()
    eager = gpt2(layers=2, hidden=64, vocab=128)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    for b in batches:
        trainer.train_step(**b)
        opt.zero_grad()
        eager(**b).loss.backward()
        opt.step()
    built = next(iter(trainer._graphs.train.values())).graph
    table = "grad:transformer.wte.weight"
    # the manifest: the base is a second gradient output of the table (one buffer)
    outputs = {r.name: r.of for r in built.roles(Role.GRADIENT)}
    assert outputs[table] == outputs[BASE_PREFIX + table] == "transformer.wte.weight"
    # the position table's zero base too: every rewrite pairs a gradient with its base
    bases = [n for n in outputs if n.startswith(BASE_PREFIX)]
    assert len(bases) == 2 and all(outputs[b] == outputs[b[len(BASE_PREFIX) :]] for b in bases)
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-4, atol=2e-5, msg=name)


@pytest.mark.slow
def test_gpt2_head_gradient_runs_early_in_ort(tmp_path) -> None:
    """ONNX Runtime's profiled order: the node writing ``base:`` runs before the first
    LayerNorm backward (the last block's), so the logit gradient it reads dies there."""
    trainer, _, batches = _gpt2_trainer()
    trainer.train_step(**batches[0])
    built = next(iter(trainer._graphs.train.values())).graph
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # the library as make_session picks it (the BLAS build holds the ortrain.cpu ops too)
    lib = cpu_ops.blas_library_path() if built.blas_gemm else cpu_ops.library_path()
    so.register_custom_ops_library(str(lib))
    disabled = DISABLED_OPTIMIZERS + (RECOMPUTE_DISABLED if built.recomputes else [])
    sess = ort.InferenceSession(
        built.ort_data, so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
    )
    feeds = {}
    for i in sess.get_inputs():
        shape = [int(d) for d in i.shape]
        if "int64" in i.type:
            feeds[i.name] = np.ones(shape, dtype=np.int64)
        else:
            feeds[i.name] = np.full(shape, 0.01, dtype=np.float32)
    sess.run(None, feeds)
    events = json.load(open(sess.end_profiling()))
    order = [
        e["args"]["op_name"]
        for e in events
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
    ]
    names = [
        e["name"].removesuffix("_kernel_time")
        for e in events
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
    ]
    model = built.model()
    table = BASE_PREFIX + "grad:transformer.wte.weight"
    base = next(v for v in model.graph.outputs if v.name == table)
    producer = base.producer().name
    assert producer in names
    first_ln_grad = order.index("LayerNormGrad")
    assert names.index(producer) < first_ln_grad, (names.index(producer), first_ln_grad)
