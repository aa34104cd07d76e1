"""Memory planning: the planner on made-up lifetimes, liveness and the report on hand-built
graphs (exact bytes), and the recompute pass (structure, and bit-identical numerics with
fewer bytes kept on an exported GPT-2 training graph)."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from ortrain.export import export_forward
from ortrain.graph_passes.infra.pipeline import run_pipeline
from ortrain.graph_passes.infra.tags import GRAD_OF, RECOMPUTE_OF
from ortrain.graph_passes.memory.memory_plan import (
    Lifetime,
    MemoryPlan,
    lifetimes,
    live_peak_bytes,
    memory_report,
    plan_offsets,
    planned_peak_bytes,
)
from ortrain.graph_passes.memory.recompute import RecomputePolicy, recompute_cheap_values
from ortrain.graph_passes.training_pipeline import (
    BuildConfig,
    BuildInputs,
    BuildProducts,
    build_pipeline,
)
from tests.conftest import gpt2, lm_batches


# ----------------------------------------------------------------------- planner
def _check(lts: list[Lifetime], plan: MemoryPlan) -> None:
    """Every pair live at the same time occupies disjoint bytes; peak bounds everything."""
    for a, b in itertools.combinations(lts, 2):
        if a.overlaps(b) and a.nbytes and b.nbytes:
            oa, ob = plan.offsets[a.name], plan.offsets[b.name]
            assert oa + a.nbytes <= ob or ob + b.nbytes <= oa, (a, b, oa, ob)
    assert all(plan.offsets[lt.name] + lt.nbytes <= plan.peak_bytes for lt in lts)
    assert plan.peak_bytes >= live_peak_bytes(lts)
    assert plan.naive_bytes == sum(lt.nbytes for lt in lts)


def test_disjoint_lifetimes_share_memory():
    lts = [Lifetime("a", 100, 0, 1), Lifetime("b", 100, 2, 3), Lifetime("c", 60, 4, 4)]
    plan = plan_offsets(lts)
    assert plan.offsets == {"a": 0, "b": 0, "c": 0}
    assert (plan.peak_bytes, plan.naive_bytes, plan.saved_bytes) == (100, 260, 160)


def test_overlapping_lifetimes_never_overlap_in_memory():
    # Touching at one step counts as overlapping (a step reads its inputs while writing).
    lts = [Lifetime("a", 100, 0, 2), Lifetime("b", 50, 2, 4), Lifetime("c", 30, 1, 3)]
    plan = plan_offsets(lts)
    _check(lts, plan)
    assert plan.peak_bytes == live_peak_bytes(lts) == 180


def test_best_fit_uses_the_smallest_gap():
    # Over steps 5..9 only a, c, e are live: free gaps are [100, 160) (60 bytes, left by b)
    # and [215, 265) (50 bytes, left by d). f (25 bytes) takes the smaller one.
    lts = [
        Lifetime("a", 100, 0, 9),
        Lifetime("b", 60, 0, 3),
        Lifetime("c", 55, 0, 9),
        Lifetime("d", 50, 0, 3),
        Lifetime("e", 40, 0, 9),
        Lifetime("f", 25, 5, 9),
    ]
    plan = plan_offsets(lts)
    _check(lts, plan)
    assert plan.offsets == {"a": 0, "b": 100, "c": 160, "d": 215, "e": 265, "f": 215}
    assert plan.peak_bytes == live_peak_bytes(lts) == 305


def test_zero_size_single_and_empty():
    assert plan_offsets([]) == MemoryPlan({}, 0, 0)
    one = plan_offsets([Lifetime("x", 12, 3, 3)])
    assert (one.offsets, one.peak_bytes, one.naive_bytes) == ({"x": 0}, 12, 12)
    lts = [Lifetime("z", 0, 0, 5), Lifetime("x", 8, 0, 5), Lifetime("y", 8, 0, 5)]
    plan = plan_offsets(lts)
    _check(lts, plan)
    assert plan.offsets["z"] == 0 and plan.peak_bytes == 16


def test_off_switch_and_alignment():
    lts = [Lifetime("a", 10, 0, 1), Lifetime("b", 10, 2, 3)]
    off = plan_offsets(lts, reuse=False)
    assert off.peak_bytes == off.naive_bytes == 20
    aligned = plan_offsets([Lifetime("a", 10, 0, 1), Lifetime("b", 10, 0, 1)], alignment=64)
    assert sorted(aligned.offsets.values()) == [0, 64] and aligned.peak_bytes == 74


def test_bad_lifetimes_raise():
    with pytest.raises(ValueError, match="unique"):
        plan_offsets([Lifetime("a", 1, 0, 0), Lifetime("a", 1, 1, 1)])
    with pytest.raises(ValueError, match="bad lifetime"):
        plan_offsets([Lifetime("a", 1, 3, 2)])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 512), st.integers(0, 30), st.integers(0, 10)),
        max_size=25,
    )
)
def test_random_lifetimes_are_planned_safely(specs):
    lts = [Lifetime(f"v{i}", n, s, s + d) for i, (n, s, d) in enumerate(specs)]
    _check(lts, plan_offsets(lts))
    _check(lts, plan_offsets(lts, alignment=64))


def test_equal_sizes_reach_the_live_peak():
    # Equal sizes: best fit never fragments, so the plan is optimal.
    lts = [Lifetime(f"v{i}", 64, i, i + 3) for i in range(10)]
    assert plan_offsets(lts).peak_bytes == live_peak_bytes(lts) == 4 * 64


# ----------------------------------------------------------------------- graphs
def _graph(nodes, inputs, outputs, backward: dict[str, str], opset: int = 20) -> ir.Model:
    """An onnx_ir model; ``backward`` maps backward node names to the node they
    differentiate (the ``ortrain.grad_of`` marker the autodiff builder sets)."""
    g = helper.make_graph(nodes, "g", inputs, outputs)
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    proto.ir_version = 10
    model = ir.serde.deserialize_model(proto)
    for node in model.graph:
        if node.name in backward:
            node.metadata_props[GRAD_OF] = backward[node.name]
    return model


def _vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def _toy() -> ir.Model:
    """Forward h = x @ w, r = relu(h), s = sum(r), xt = x^T; a made-up backward reads r
    and xt: dh = sign(r), gw = xt @ dh."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["r"], name="act"),
        helper.make_node("Transpose", ["x"], ["xt"], name="xt", perm=[1, 0]),
        helper.make_node("ReduceSum", ["r"], ["s"], name="loss", keepdims=0),
        helper.make_node("Sign", ["r"], ["dh"], name="g_act"),
        helper.make_node("MatMul", ["xt", "dh"], ["gw"], name="g_mm"),
    ]
    value_info = [_vi("h", [4, 16]), _vi("r", [4, 16]), _vi("xt", [8, 4]), _vi("dh", [4, 16])]
    model = _graph(
        nodes,
        [_vi("x", [4, 8]), _vi("w", [8, 16])],
        [_vi("s", []), _vi("gw", [8, 16])],
        {"g_act": "act", "g_mm": "mm"},
    )
    shapes = {v.name: v for v in value_info}
    for node in model.graph:  # record the intermediate shapes the way the builders do
        for v in node.outputs:
            if v.name in shapes:
                v.shape = ir.Shape([d.dim_value for d in shapes[v.name].type.tensor_type.shape.dim])
                v.dtype = ir.DataType.FLOAT
    return model


def test_lifetimes_of_a_hand_built_graph():
    lts = {lt.name: lt for lt in lifetimes(_toy())}
    # Graph inputs (x, w) are not activations; graph outputs (s, gw) live to the last step.
    assert lts == {
        "h": Lifetime("h", 256, 0, 1),
        "r": Lifetime("r", 256, 1, 4),
        "xt": Lifetime("xt", 128, 2, 5),
        "s": Lifetime("s", 4, 3, 5),
        "dh": Lifetime("dh", 256, 4, 5),
        "gw": Lifetime("gw", 512, 5, 5),
    }


def test_memory_report_counts_bytes_kept_for_backward():
    report = memory_report(_toy())
    assert report.planned_peak_bytes == report.live_peak_bytes == 512 + 256 + 128 + 4
    assert planned_peak_bytes(_toy()) == report.planned_peak_bytes
    assert report.naive_bytes == 1412 and report.num_values == 6
    assert (report.kept_count, report.kept_bytes) == (2, 384)
    assert [(k.name, k.nbytes, k.op_type) for k in report.largest_kept] == [
        ("r", 256, "Relu"),
        ("xt", 128, "Transpose"),
    ]
    assert report.kept_bytes_by_dtype == (("FLOAT", 384),)
    assert report.recomputed_nodes == 0 and report.unknown_size == ()
    text = report.format()
    assert "kept for backward: 2 values" in text and "Transpose" in text


def test_memory_report_infers_shapes_the_graph_does_not_record():
    model = _toy()
    for node in model.graph:
        if node.name == "g_act":
            node.outputs[0].shape = None
    assert "dh" in [lt.name for lt in lifetimes(model) if lt.nbytes == 0]
    report = memory_report(model)
    assert report.naive_bytes == 1412 and report.unknown_size == ()


def test_fp16_values_count_two_bytes():
    nodes = [
        helper.make_node("Cast", ["x"], ["x16"], name="c", to=TensorProto.FLOAT16),
        helper.make_node("Relu", ["x16"], ["y"], name="r"),
    ]
    model = _graph(nodes, [_vi("x", [4, 8])], [_vi("y", [4, 8], TensorProto.FLOAT16)], {})
    for node in model.graph:
        node.outputs[0].shape, node.outputs[0].dtype = ir.Shape([4, 8]), ir.DataType.FLOAT16
    assert [lt.nbytes for lt in lifetimes(model)] == [64, 64]


def test_a_value_read_in_a_subgraph_lives_until_its_owner_runs():
    then_g = helper.make_graph(
        [helper.make_node("Identity", ["a"], ["t"])], "then", [], [_vi("t", [4])]
    )
    else_g = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["e"])], "else", [], [_vi("e", [4])]
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="n0"),
        helper.make_node("Neg", ["x"], ["c"], name="n1"),
        helper.make_node("Abs", ["x"], ["d"], name="n2"),
        helper.make_node("If", ["cond"], ["y"], name="n3", then_branch=then_g, else_branch=else_g),
    ]
    model = _graph(nodes, [_vi("x", [4]), _vi("cond", [], TensorProto.BOOL)], [_vi("y", [4])], {})
    for node in model.graph:
        for v in node.outputs:
            v.shape, v.dtype = ir.Shape([4]), ir.DataType.FLOAT
    lts = {lt.name: (lt.start, lt.end) for lt in lifetimes(model)}
    assert lts == {"a": (0, 3), "c": (1, 3), "d": (2, 2), "y": (3, 3)}


# ----------------------------------------------------------------------- recompute
def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def test_recompute_moves_a_weight_transpose_into_the_backward():
    model = _toy()
    assert recompute_cheap_values(model, RecomputePolicy.CHEAP_VIEWS) == 1
    ir.passes.common.RemoveUnusedNodesPass()(model)
    # The forward Transpose had no forward reader left: it is gone; its copy runs right
    # before the backward MatMul that reads it.
    assert _ops(model) == ["MatMul", "Relu", "ReduceSum", "Sign", "Transpose", "MatMul"]
    clone = list(model.graph)[4]
    assert clone.metadata_props[RECOMPUTE_OF] == "xt"
    assert clone.metadata_props[GRAD_OF] == "mm"
    assert clone.inputs[0].name == "x" and list(clone.attributes["perm"].value) == [1, 0]
    report = memory_report(model)
    assert (report.kept_count, report.kept_bytes, report.recomputed_nodes) == (1, 256, 1)


def test_recompute_nothing_is_the_off_switch():
    model = _toy()
    assert recompute_cheap_values(model, RecomputePolicy.NOTHING) == 0
    assert _ops(model) == ["MatMul", "Relu", "Transpose", "ReduceSum", "Sign", "MatMul"]


def test_recompute_clones_chains_and_keeps_what_saves_nothing():
    # k = Reshape(Transpose(w)) is rebuilt from w (a chain); m = Reshape(Exp(x)) is kept:
    # Exp is not cheap, so recomputing the Reshape would keep e alive instead.
    nodes = [
        helper.make_node("Constant", [], ["shape"], value_ints=[16, 8]),
        helper.make_node("Transpose", ["w"], ["wt"], name="t", perm=[1, 0]),
        helper.make_node("Reshape", ["wt", "shape"], ["k"], name="k"),
        helper.make_node("Exp", ["x"], ["e"], name="exp"),
        helper.make_node("Reshape", ["e", "shape2"], ["m"], name="m"),
        helper.make_node("MatMul", ["m", "k"], ["y"], name="fwd"),
        helper.make_node("MatMul", ["m", "k"], ["gy"], name="bwd"),
    ]
    model = _graph(
        nodes,
        [_vi("w", [8, 16]), _vi("x", [4, 2, 16]), _vi("shape2", [2], TensorProto.INT64)],
        [_vi("y", [4, 8]), _vi("gy", [4, 8])],
        {"bwd": "fwd"},
    )
    assert recompute_cheap_values(model, RecomputePolicy.CHEAP_VIEWS) == 1
    ops = collections.Counter(n.op_type for n in model.graph if RECOMPUTE_OF in n.metadata_props)
    assert ops == {"Transpose": 1, "Reshape": 1}
    bwd = next(n for n in model.graph if n.name == "bwd")
    assert bwd.inputs[0].name == "m" and bwd.inputs[1].name == "k/recompute"
    assert bwd.inputs[1].producer().inputs[0].name == "wt/recompute"


def test_cheap_ops_recompute_layer_norm_output_but_not_its_statistics():
    nodes = [
        # Abs: outside every policy (an Add of graph inputs would be recomputed too).
        helper.make_node("Abs", ["x"], ["res"], name="res"),
        helper.make_node("LayerNormalization", ["res", "g", "b"], ["y", "mean", "rstd"], name="ln"),
        helper.make_node("Relu", ["y"], ["out"], name="fwd"),
        helper.make_node("Mul", ["res", "mean"], ["d0"], name="g_ln"),
        helper.make_node("Mul", ["d0", "rstd"], ["d1"], name="g_ln2"),
        helper.make_node("Mul", ["d1", "y"], ["d2"], name="g_w"),
    ]
    model = _graph(
        nodes,
        [_vi("x", [4, 8]), _vi("g", [8]), _vi("b", [8])],
        [_vi("out", [4, 8]), _vi("d2", [4, 8])],
        {"g_ln": "ln", "g_ln2": "ln", "g_w": "ln"},
    )
    assert recompute_cheap_values(model, RecomputePolicy.CHEAP_VIEWS) == 0
    assert recompute_cheap_values(model, RecomputePolicy.CHEAP_OPS) == 1
    names = [n.name for n in model.graph]
    # The copy sits right before the reader of y, after the readers of mean and 1/std.
    assert names == ["res", "ln", "fwd", "g_ln", "g_ln2", "ln/recompute", "g_w"]
    readers = {n.name: [v.name for v in n.inputs] for n in model.graph}
    assert readers["g_ln"] == ["res", "mean"] and readers["g_w"] == ["d1", "y/recompute"]


# ----------------------------------------------------------------------- GPT-2 tiny
def _session(model: ir.Model) -> ort.InferenceSession:
    so = ort.SessionOptions()
    # One thread: both graphs then sum in the same order.
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    data = ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(
        data,
        so,
        providers=["CPUExecutionProvider"],
        # CSE would merge each recomputed copy back into its forward value.
        disabled_optimizers=["EliminateDropout", "CommonSubexpressionElimination"],
    )


def test_recompute_on_gpt2_training_graph_is_exact_and_keeps_fewer_bytes():
    module = gpt2(layers=2, hidden=64, vocab=128)
    batch = lm_batches(1, batch=2, seq=16, vocab=128)[0]
    ex = export_forward(module, batch, train=True)
    params = dict(module.named_parameters())
    inputs = {v.name for v in ex.model.graph.inputs}

    def build(policy: RecomputePolicy) -> tuple[ir.Model, dict[str, float]]:
        model = ir.serde.deserialize_model(ir.serde.serialize_model(ex.model))
        b = BuildInputs(ex.output_names[0], tuple(n for n in params if n in inputs))
        config = BuildConfig(recompute=policy.name)
        records = run_pipeline(model, build_pipeline(config, b, BuildProducts()))
        return model, {r.name: r.nodes_after - r.nodes_before for r in records}

    off, off_log = build(RecomputePolicy.NOTHING)
    on, on_log = build(RecomputePolicy.CHEAP_OPS)
    assert "recompute" not in off_log and on_log["recompute"] > 0
    before, after = memory_report(off), memory_report(on)
    # Copies: the 5 LayerNorm outputs (2 per layer + ln_f) and 2 GELU outputs, their 2-D
    # views and the first reshape of input_ids (the tied LM head's weight Transpose is
    # folded into its FusedMatMul by the fusions, so there is none left to copy); then
    # (recompute_attention.py) each layer's attention probabilities: product, mask, Softmax.
    copies = collections.Counter(n.op_type for n in on.graph if RECOMPUTE_OF in n.metadata_props)
    assert copies == {"Reshape": 8, "LayerNormalization": 5, "Gelu": 2, "FusedMatMul": 2,
                      "Add": 2, "Softmax": 2}  # fmt: skip
    assert on_log["recompute"] == 15 and on_log["recompute_attention"] == 6
    assert after.recomputed_nodes == 21
    assert (before.kept_count, before.kept_bytes) == (39, 378_624)
    # (29, 206_336 with the probabilities kept: 2 x [2, 4, 16, 16] floats)
    assert (after.kept_count, after.kept_bytes) == (27, 189_952)
    # (562_948 before the embedding gradients scattered straight into the gradient sum;
    # 586_500 before the loss was lowered to Softmax, which frees the log-probabilities)
    # (561_668 with the probabilities kept)
    assert (before.planned_peak_bytes, after.planned_peak_bytes) == (578_308, 553_476)
    assert (planned_peak_bytes(off), planned_peak_bytes(on)) == (578_308, 553_476)

    feeds = {n: p.detach().numpy() for n, p in params.items()}
    feeds.update({k: v.numpy() for k, v in batch.items()})
    feeds = {v.name: feeds[v.name] for v in off.graph.inputs}
    ref = _session(off).run(None, feeds)
    got = _session(on).run(None, feeds)
    assert [o.name for o in off.graph.outputs] == [o.name for o in on.graph.outputs]
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)
    assert torch.isfinite(torch.from_numpy(ref[0]))


# ----------------------------------------------------------------------- the arena
@pytest.mark.slow
@pytest.mark.parametrize(
    ("vocab", "batch", "seq", "sized"), [(4096, 4, 64, True), (128, 2, 16, False)]
)
def test_arena_first_region_is_the_planned_peak(monkeypatch, vocab, batch, seq, sized):
    """The shared CPU arena is created once, its first region half the gradient graph's
    planned peak rounded up to MiB (ONNX Runtime's 1 MiB default below that)."""
    from ortrain import ORTTrainer, TrainerOptions
    from ortrain.runtime import session as session_mod

    made = []
    monkeypatch.setattr(session_mod, "_arena_registered", False)
    monkeypatch.setattr(
        session_mod.ort, "create_and_register_allocator", lambda info, cfg: made.append(cfg)
    )
    module = gpt2(layers=1, hidden=64, vocab=vocab)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    trainer = ORTTrainer(module, opt, TrainerOptions(update_engine="graph"))
    for b in lm_batches(2, batch=batch, seq=seq, vocab=vocab):
        assert torch.isfinite(trainer.train_step(**b))
    trainer.eval_step(**b)  # a later session: no second arena
    planned = trainer.memory_report().graph.planned_peak_bytes
    (compiled,) = trainer._graphs.train.values()
    assert compiled.graph.planned_peak_bytes == planned
    assert len(made) == 1
    mib = 1 << 20
    assert (planned > 2 * mib) == sized
    if sized:
        assert planned > 4 * mib  # the [tokens x vocab] logits alone are 4 MiB
        assert made[0].initial_chunk_size_bytes == -(-planned // (2 * mib)) * mib
    else:
        assert made[0].initial_chunk_size_bytes == -1  # ONNX Runtime's default


@pytest.mark.slow
def test_recompute_on_llama_redoes_the_gated_mlp_and_rms_norms():
    """Llama's SiLU-gated MLP (Sigmoid, x*sigmoid(x), *up) is element-wise products of
    values the backward keeps anyway (the projections), and its RMSNorms read the residual
    stream it keeps anyway: CHEAP_OPS redoes them instead of keeping their outputs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    layers = 2
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=160, max_position_embeddings=32,
    )  # fmt: skip
    module = LlamaForCausalLM(cfg)
    batch = lm_batches(1, batch=2, seq=16, vocab=128)[0]
    ex = export_forward(module, batch, train=True)
    params = dict(module.named_parameters())
    inputs = {v.name for v in ex.model.graph.inputs}

    def build(policy: RecomputePolicy) -> ir.Model:
        model = ir.serde.deserialize_model(ir.serde.serialize_model(ex.model))
        b = BuildInputs(ex.output_names[0], tuple(n for n in params if n in inputs))
        config = BuildConfig(recompute=policy.name)
        run_pipeline(model, build_pipeline(config, b, BuildProducts()))
        return model

    off, on = build(RecomputePolicy.NOTHING), build(RecomputePolicy.CHEAP_OPS)
    copies = collections.Counter(n.op_type for n in on.graph if RECOMPUTE_OF in n.metadata_props)
    assert copies["Sigmoid"] == layers  # the SiLU gate of each MLP
    assert copies["Mul"] == 2 * layers  # silu = x * sigmoid(x), silu * up
    # The fused RMSNorms (fuse_rms_norm) whose outputs feed the projections' weight grads.
    assert copies["SimplifiedLayerNormalization"] == 2 * layers + 1
    before, after = memory_report(off), memory_report(on)
    assert after.kept_bytes < 0.75 * before.kept_bytes
    assert after.planned_peak_bytes < before.planned_peak_bytes

    feeds = {n: p.detach().numpy() for n, p in params.items()}
    feeds.update({n: b.numpy() for n, b in module.named_buffers()})  # rotary inv_freq
    feeds.update({k: v.numpy() for k, v in batch.items()})
    feeds = {v.name: feeds[v.name] for v in off.graph.inputs}
    for a, b in zip(_session(off).run(None, feeds), _session(on).run(None, feeds)):
        np.testing.assert_array_equal(a, b)
