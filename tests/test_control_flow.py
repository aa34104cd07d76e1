"""Control flow never trains silently wrong (graph_passes/prepare/inline_control_flow.py and the
builder's subgraph reachability): constant Loops unrolled and constant Ifs inlined before
autodiff, what stays on a gradient path is a GradientError naming the node, and
``nn.EmbeddingBag`` (exported as a Loop reading the looked-up rows from the outer scope)
trains like eager."""

from __future__ import annotations

import copy
import uuid

import numpy as np
import onnx_ir as ir
import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import ExportError
from ortrain.graph_passes.autodiff import GradientError, build_gradient_graph, registry
from ortrain.graph_passes.prepare.inline_control_flow import inline_control_flow
from tests.gradcheck import TinyGraph, run_model

LOSS_RTOL = 1e-4
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5

I64, F32, BOOL = ir.DataType.INT64, ir.DataType.FLOAT, ir.DataType.BOOL


# --- hand-built graphs ------------------------------------------------------------------


def _node(op: str, inputs: list, outputs: list[ir.Value], name: str, **attrs) -> ir.Node:
    return ir.Node(
        "",
        op,
        inputs,
        attributes=ir.convenience.convert_attributes(attrs),
        outputs=outputs,
        name=name,
    )


def _v(name: str, dtype: ir.DataType | None = None, shape=None) -> ir.Value:
    v = ir.Value(name=name)
    if dtype is not None:
        v.dtype = dtype
    if shape is not None:
        v.shape = ir.Shape(list(shape))
    return v


def _body(w: ir.Value, scale: ir.Value) -> ir.Graph:
    """Loop body: acc' = acc * tanh(w[i] * scale), scan output w[i] * acc'.
    ``w`` and ``scale`` are read from the outer scope."""
    i, cond, acc = _v("i", I64, ()), _v("cond_in", BOOL, ()), _v("acc")
    row, scaled, t = _v("row"), _v("scaled"), _v("t")
    acc2, scan, cond2 = _v("acc2"), _v("scan"), _v("cond_out")
    nodes = [
        _node("Gather", [w, i], [row], "body_gather", axis=0),
        _node("Mul", [row, scale], [scaled], "body_scale"),
        _node("Tanh", [scaled], [t], "body_tanh"),
        _node("Mul", [acc, t], [acc2], "body_acc"),
        _node("Mul", [row, acc2], [scan], "body_scan"),
        _node("Identity", [cond], [cond2], "body_cond"),
    ]
    return ir.Graph([i, cond, acc], [cond2, acc2, scan], nodes=nodes, name="body")


def _loop_model(trip: ir.Value, extra_inputs: list[ir.Value] = ()) -> tuple[ir.Model, str]:
    """loss = sum(final acc) + sum(scan outputs * R), over a Loop of ``trip`` iterations."""
    g = TinyGraph()
    w = g.input("w", (3, 4))
    scale = g.input("scale", (4,))
    g.inputs.extend(extra_inputs)
    acc0 = g.const("acc0", np.ones(4, np.float32))
    cond = g.const("cond", np.array(True))
    final, scans = _v("final", F32, (4,)), _v("scans", F32, (3, 4))
    g.nodes.append(
        _node("Loop", [trip, cond, acc0], [final, scans], "the_loop", body=_body(w, scale))
    )
    r = g.const("R", np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32))
    weighted = g.op("Mul", scans, r, name="weighted", shape=(3, 4))
    s1 = g.op("ReduceSum", weighted, name="s1", shape=(), keepdims=0)
    s2 = g.op("ReduceSum", final, name="s2", shape=(), keepdims=0)
    loss = g.op("Add", s1, s2, name="loss", shape=())
    return g.model(loss), loss.name


def _loop_reference(w: torch.Tensor, scale: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    acc, scans = torch.ones(4, dtype=w.dtype), []
    for i in range(3):
        acc = acc * torch.tanh(w[i] * scale)
        scans.append(w[i] * acc)
    return (torch.stack(scans) * r).sum() + acc.sum()


def test_loop_with_constant_trip_count_is_unrolled_and_differentiated() -> None:
    g_trip = np.array(3, np.int64)
    trip = _v("trip", I64, ())
    trip.const_value = ir.tensor(g_trip)
    model, loss = _loop_model(trip)
    model.graph.register_initializer(trip)
    assert inline_control_flow(model) >= 1
    ops = [n.op_type for n in model.graph]
    assert "Loop" not in ops and ops.count("Tanh") == 3 and ops.count("Concat") == 1
    res = build_gradient_graph(model, loss, ["w", "scale"])
    assert set(res.grad_outputs) == {"w", "scale"} and res.unreachable == []

    rng = np.random.default_rng(1)
    w, scale = rng.standard_normal((3, 4)), rng.standard_normal(4)
    got = run_model(model, {"w": w.astype(np.float32), "scale": scale.astype(np.float32)})
    wt = torch.tensor(w, requires_grad=True)
    st = torch.tensor(scale, requires_grad=True)
    r = torch.tensor(model.graph.initializers["R"].const_value.numpy(), dtype=torch.float64)
    ref = _loop_reference(wt, st, r)
    ref.backward()
    np.testing.assert_allclose(got[loss], ref.item(), rtol=1e-5)
    for name, t in (("w", wt), ("scale", st)):
        want = t.grad.numpy()
        np.testing.assert_allclose(
            got[res.grad_outputs[name]], want, rtol=1e-5, atol=1e-5 * np.abs(want).max()
        )


def test_loop_with_run_time_trip_count_on_the_path_raises_naming_the_node() -> None:
    trip = _v("trip", I64, ())
    model, loss = _loop_model(trip, [trip])
    assert inline_control_flow(model) == 0
    assert [n.op_type for n in model.graph].count("Loop") == 1
    with pytest.raises(GradientError, match="the_loop") as err:
        build_gradient_graph(model, loss, ["w", "scale"])
    msg = str(err.value)
    assert "Loop" in msg and "'scale'" in msg and "'w'" in msg and "outer scope" in msg


def _if_model(
    cond_value: bool | None, then: str = "Mul", other: str = "Add"
) -> tuple[ir.Model, str]:
    """y = If(c, then: w (then) x, else: w (other) x); loss = sum(y * y)."""
    g = TinyGraph()
    x, w = g.input("x", (3, 4)), g.input("w", (3, 4))
    if cond_value is None:
        c = g.input("c", (), BOOL)
    else:
        c = g.const("c", np.array(cond_value))
    t_out, e_out = _v("t_out"), _v("e_out")
    then_g = ir.Graph([], [t_out], nodes=[_node(then, [w, x], [t_out], "then_op")], name="then")
    else_g = ir.Graph([], [e_out], nodes=[_node(other, [w, x], [e_out], "else_op")], name="else")
    y = _v("y", F32, (3, 4))
    g.nodes.append(_node("If", [c], [y], "the_if", then_branch=then_g, else_branch=else_g))
    sq = g.op("Mul", y, y, name="sq", shape=(3, 4))
    loss = g.op("ReduceSum", sq, name="loss", shape=(), keepdims=0)
    return g.model(loss), loss.name


@pytest.mark.parametrize("cond", [True, False])
def test_if_with_constant_condition_is_inlined(cond: bool) -> None:
    model, loss = _if_model(cond)
    assert inline_control_flow(model) == 1
    ops = [n.op_type for n in model.graph]
    assert "If" not in ops and ops.count("Mul" if cond else "Add") == (2 if cond else 1)
    res = build_gradient_graph(model, loss, ["w"])
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    got = run_model(model, {"x": x.astype(np.float32), "w": w.astype(np.float32)})
    y = x * w if cond else x + w
    dy = 2 * y
    want = dy * x if cond else dy
    np.testing.assert_allclose(got[loss], (y * y).sum(), rtol=1e-5)
    np.testing.assert_allclose(
        got[res.grad_outputs["w"]], want, rtol=1e-5, atol=1e-5 * np.abs(want).max()
    )


def test_if_with_run_time_condition_and_unsafe_branch_on_the_path_raises() -> None:
    # Pow is not on the list of ops a selected If may compute either way
    model, loss = _if_model(None, then="Pow")
    assert inline_control_flow(model) == 0
    with pytest.raises(GradientError, match="the_if") as err:
        build_gradient_graph(model, loss, ["w"])
    assert "'w'" in str(err.value) and "op If" in str(err.value)


def test_if_with_run_time_condition_and_branches_of_other_shapes_is_refused() -> None:
    # then [3, 4], else [1, 4]: Where would broadcast instead of picking
    g = TinyGraph()
    w, c = g.input("w", (3, 4)), g.input("c", (), BOOL)
    axes = g.const("axes", np.array([0], np.int64))
    t_out, e_out = _v("t_out"), _v("e_out")
    then_g = ir.Graph([], [t_out], nodes=[_node("Add", [w, w], [t_out], "then_op")], name="t")
    else_nodes = [_node("ReduceSum", [w, axes], [e_out], "else_op")]
    else_g = ir.Graph([], [e_out], nodes=else_nodes, name="e")
    y = _v("y", F32)
    g.nodes.append(_node("If", [c], [y], "the_if", then_branch=then_g, else_branch=else_g))
    loss = g.op("ReduceSum", y, name="loss", shape=(), keepdims=0)
    with pytest.raises(NotImplementedError, match="the_if"):
        inline_control_flow(g.model(loss))


@pytest.mark.parametrize("cond", [True, False])
def test_if_with_run_time_condition_is_selected_and_untaken_division_stays_finite(
    cond: bool,
) -> None:
    # then: w / x with zeros in x. Not taken, its gradient is 0 and must not become 0 / 0.
    model, loss = _if_model(None, then="Div", other="Add")
    assert inline_control_flow(model) == 1
    ops = [n.op_type for n in model.graph]
    assert "If" not in ops and "Where" in ops
    res = build_gradient_graph(model, loss, ["w"])
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 4))
    x = rng.standard_normal((3, 4)) if cond else np.where(rng.random((3, 4)) < 0.5, 0.0, 1.0)
    feeds = {"x": x.astype(np.float32), "w": w.astype(np.float32), "c": np.array(cond)}
    got = run_model(model, feeds)
    y = w / x if cond else w + x
    want = 2 * y / x if cond else 2 * y
    np.testing.assert_allclose(got[loss], (y * y).sum(), rtol=1e-5)
    grad = got[res.grad_outputs["w"]]
    assert np.isfinite(grad).all()
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("bounds", [(1, 3), (2, 2), (-2, 9)], ids=["rows", "empty", "clamped"])
@pytest.mark.parametrize("reduce", ["ReduceSum", "ReduceMean", "ReduceMax"])
def test_slice_on_run_time_bounds_becomes_a_masked_reduction(bounds, reduce: str) -> None:
    # y = If(s == e, zeros, reduce(w[s:e], axis 0)); loss = sum(y * R)
    g = TinyGraph()
    w = g.input("w", (4, 3))
    s, e = g.input("s", (1,), I64), g.input("e", (1,), I64)
    c = g.op("Equal", s, e, name="empty", shape=(1,), dtype=BOOL)
    zeros = _v("zeros", F32, (1, 3))
    zeros.const_value = ir.tensor(np.zeros((1, 3), np.float32))
    then_g = ir.Graph([], [zeros], nodes=[], initializers=[zeros], name="then")
    rows, red = _v("rows"), _v("red")
    axes = g.const("axes", np.array([0], np.int64))
    else_nodes = [
        _node("Slice", [w, s, e], [rows], "rows"),
        _node(reduce, [rows, axes], [red], "red"),
    ]
    else_g = ir.Graph([], [red], nodes=else_nodes, name="else")
    y = _v("y", F32, (1, 3))
    g.nodes.append(_node("If", [c], [y], "bag", then_branch=then_g, else_branch=else_g))
    r = g.const("R", np.random.default_rng(6).standard_normal((1, 3)).astype(np.float32))
    m = g.op("Mul", y, r, name="m", shape=(1, 3))
    loss = g.op("ReduceSum", m, name="loss", shape=(), keepdims=0)
    model = g.model(loss)
    assert inline_control_flow(model) >= 1
    assert not {"If", "Slice"} & {n.op_type for n in model.graph}
    res = build_gradient_graph(model, loss.name, ["w"])

    wv = np.random.default_rng(7).standard_normal((4, 3))
    feeds = {"w": wv.astype(np.float32), "s": np.array(bounds[:1]), "e": np.array(bounds[1:])}
    got = run_model(model, feeds)
    wt = torch.tensor(wv, requires_grad=True)
    part = wt[bounds[0] : bounds[1]]
    fn = {"ReduceSum": torch.sum, "ReduceMean": torch.mean, "ReduceMax": torch.amax}[reduce]
    empty = (wt * 0).sum(0, keepdim=True)  # the If's zeros: no gradient to w
    ref_y = empty if len(part) == 0 else fn(part, 0, keepdim=True)
    ref = (ref_y * torch.tensor(r.const_value.numpy(), dtype=wt.dtype)).sum()
    ref.backward()
    np.testing.assert_allclose(got[loss.name], ref.item(), rtol=1e-5, atol=1e-6)
    want = wt.grad.numpy()
    np.testing.assert_allclose(
        got[res.grad_outputs["w"]], want, rtol=1e-5, atol=1e-5 * max(np.abs(want).max(), 1e-3)
    )


def _scan_model() -> tuple[ir.Model, str]:
    """Scan over the rows of x: h' = tanh(h * w + x_t), output h' per step."""
    g = TinyGraph()
    x, w = g.input("x", (3, 4)), g.input("w", (4,))
    h0 = g.const("h0", np.full(4, 0.5, np.float32))
    h, xt = _v("h"), _v("xt")
    hw, pre, h2, out = _v("hw"), _v("pre"), _v("h2"), _v("out")
    nodes = [
        _node("Mul", [h, w], [hw], "scan_mul"),
        _node("Add", [hw, xt], [pre], "scan_add"),
        _node("Tanh", [pre], [h2], "scan_tanh"),
        _node("Identity", [h2], [out], "scan_out"),
    ]
    body = ir.Graph([h, xt], [h2, out], nodes=nodes, name="scan_body")
    final, outs = _v("final", F32, (4,)), _v("outs", F32, (3, 4))
    g.nodes.append(_node("Scan", [h0, x], [final, outs], "the_scan", body=body, num_scan_inputs=1))
    r = g.const("R", np.random.default_rng(8).standard_normal((3, 4)).astype(np.float32))
    m = g.op("Mul", outs, r, name="m", shape=(3, 4))
    s1 = g.op("ReduceSum", m, name="s1", shape=(), keepdims=0)
    s2 = g.op("ReduceSum", final, name="s2", shape=(), keepdims=0)
    loss = g.op("Add", s1, s2, name="loss", shape=())
    return g.model(loss), loss.name


def test_scan_with_static_length_is_unrolled() -> None:
    model, loss = _scan_model()
    assert inline_control_flow(model) == 1
    ops = [n.op_type for n in model.graph]
    assert "Scan" not in ops and ops.count("Tanh") == 3
    res = build_gradient_graph(model, loss, ["x", "w"])
    rng = np.random.default_rng(9)
    x, w = rng.standard_normal((3, 4)), rng.standard_normal(4)
    got = run_model(model, {"x": x.astype(np.float32), "w": w.astype(np.float32)})
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    h, outs = torch.full((4,), 0.5, dtype=torch.float64), []
    for t in range(3):
        h = torch.tanh(h * wt + xt[t])
        outs.append(h)
    r = torch.tensor(model.graph.initializers["R"].const_value.numpy(), dtype=torch.float64)
    ref = (torch.stack(outs) * r).sum() + h.sum()
    ref.backward()
    np.testing.assert_allclose(got[loss], ref.item(), rtol=1e-5)
    for name, t in (("x", xt), ("w", wt)):
        want = t.grad.numpy()
        np.testing.assert_allclose(
            got[res.grad_outputs[name]], want, rtol=1e-5, atol=1e-5 * np.abs(want).max()
        )


def test_if_condition_folded_from_constants() -> None:
    # the condition is Less(2, 3), computed in the graph: the pass folds it itself
    model, loss = _if_model(None)
    g = model.graph
    c = g.inputs.pop()
    two, three = ir.tensor(np.array(2, np.int64)), ir.tensor(np.array(3, np.int64))
    a, b = _v("two", I64, ()), _v("three", I64, ())
    a.const_value, b.const_value = two, three
    g.register_initializer(a)
    g.register_initializer(b)
    less = _node("Less", [a, b], [_v("less", BOOL, ())], "less")
    g.insert_before(g.node(0), less)
    c.replace_all_uses_with(less.outputs[0])
    assert inline_control_flow(model) == 1
    assert [n.op_type for n in g].count("If") == 0 and "less" not in [n.name for n in g]
    res = build_gradient_graph(model, loss, ["w"])
    assert res.grad_outputs == {"w": "grad:w"}


@pytest.fixture
def forgetful_op():
    """A made-up op whose rule returns no gradient for the input it is asked about."""
    domain = f"test.forgetful.{uuid.uuid4().hex}"
    registry.gradient("Forgetful", domain=domain)(lambda ctx: {})
    yield domain
    del registry._TABLE[(domain, "Forgetful")]


def test_parameter_reaching_the_loss_without_a_gradient_raises(forgetful_op: str) -> None:
    # the build's final check: w reaches the loss, so it must not come out "unreachable"
    g = TinyGraph()
    w, v = g.input("w", (3, 4)), g.input("v", (3, 4))
    y = g.op("Forgetful", w, name="forgetful", shape=(3, 4), domain=forgetful_op)
    m = g.op("Mul", y, v, name="m", shape=(3, 4))
    loss = g.op("ReduceSum", m, name="loss", shape=(), keepdims=0)
    model = g.model(loss, opsets={"": 20, forgetful_op: 1})
    with pytest.raises(GradientError, match="differ from those that got a gradient") as err:
        build_gradient_graph(model, loss.name, ["w", "v"])
    assert "'w'" in str(err.value)


# --- EmbeddingBag through ORTTrainer ------------------------------------------------------

VOCAB, DIM, CLASSES = 12, 6, 3


class BagModel(torch.nn.Module):
    def __init__(self, **bag) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = torch.nn.EmbeddingBag(VOCAB, DIM, **bag)
        self.head = torch.nn.Linear(DIM, CLASSES)

    def forward(self, ids, y, offsets=None, weights=None):
        pooled = self.bag(ids, offsets, per_sample_weights=weights)
        return torch.nn.functional.cross_entropy(self.head(pooled), y)


def _batches(form: str, n: int, padding_idx: int | None, weights: bool, last: bool) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        if form == "2d":
            ids = torch.randint(0, VOCAB, (4, 5), generator=g)
            y = torch.randint(0, CLASSES, (4,), generator=g)
            batch = {"ids": ids, "y": y}
        else:
            ids = torch.randint(0, VOCAB, (11,), generator=g)
            # empty bags: the second, and the last one without include_last_offset
            offsets = torch.tensor([0, 3, 3, 7, 11] if last else [0, 3, 3, 11])
            batch = {"ids": ids, "y": torch.randint(0, CLASSES, (4,), generator=g)}
            batch["offsets"] = offsets
        if padding_idx is not None:
            batch["ids"] = batch["ids"].clone()
            batch["ids"].view(-1)[::3] = padding_idx
        if weights:
            batch["weights"] = torch.rand(batch["ids"].shape, generator=g)
        out.append(batch)
    return out


def _train_against_eager(bag: dict, batches: list[dict]) -> ORTTrainer:
    ref = BagModel(**bag)
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    trainer = ORTTrainer(model, opt, TrainerOptions(update_engine="torch"))
    for step, batch in enumerate(batches):
        opt_ref.zero_grad()
        loss_ref = ref(**batch)
        loss_ref.backward()
        loss = trainer.train_step(**batch)
        torch.testing.assert_close(loss, loss_ref.detach(), rtol=LOSS_RTOL, atol=0)
        if step == 0:  # the bag's weight got its gradient, element by element
            want = ref.bag.weight.grad
            torch.testing.assert_close(
                trainer.grads["bag.weight"],
                want,
                rtol=GRAD_RTOL,
                atol=GRAD_ATOL * want.abs().max().item(),
            )
        opt_ref.step()
    trainer.sync_to_module()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(
            p, q, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    start = BagModel(**bag).bag.weight
    assert (model.bag.weight - start).abs().max() > 1e-3  # the bag really trained
    return trainer


BAG_CASES = {
    "sum": ({"mode": "sum"}, "2d", False),
    "mean": ({"mode": "mean"}, "2d", False),
    "max": ({"mode": "max"}, "2d", False),
    "sum-weights": ({"mode": "sum"}, "2d", True),
    # 1-D ids + offsets (batch values; one bag empty): the bags' Ifs become Wheres and
    # their row Slices masked reductions
    "offsets-sum": ({"mode": "sum"}, "1d", False),
    "offsets-mean": ({"mode": "mean"}, "1d", False),
    "offsets-max": ({"mode": "max"}, "1d", False),
    "offsets-sum-weights": ({"mode": "sum"}, "1d", True),
    "offsets-last-sum": ({"mode": "sum", "include_last_offset": True}, "1d", False),
    "offsets-last-mean": ({"mode": "mean", "include_last_offset": True}, "1d", False),
    "offsets-last-max": ({"mode": "max", "include_last_offset": True}, "1d", False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAG_CASES))
def test_embedding_bag_trains_like_eager(case: str) -> None:
    bag, form, weights = BAG_CASES[case]
    last = bag.get("include_last_offset", False)
    batches = _batches(form, 8, bag.get("padding_idx"), weights, last)
    _train_against_eager(bag, batches)


# padding_idx: the exporter drops padding entries by building each bag's index list
# element by element on the ids' values, then gathers it (a run-time length): the Loops
# unroll, but an If on those values stays between the weight and the loss. Exported
# instead by reducing every bag at once, padding masked (ortrain/export_functional.py):
# one graph, trained like eager.
PADDED = {
    "sum-padding": ({"mode": "sum", "padding_idx": 2}, "2d", False),
    "max-padding": ({"mode": "max", "padding_idx": 2}, "2d", False),
    "offsets-mean-padding": ({"mode": "mean", "padding_idx": 2}, "1d", False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PADDED))
def test_embedding_bag_with_padding_trains_as_one_graph(case: str) -> None:
    bag, form, last = PADDED[case]
    batches = _batches(form, 3, bag.get("padding_idx"), False, last)
    trainer = _train_against_eager(bag, batches)
    assert trainer.segments is None
    (graph,) = trainer.train_graphs
    assert not {"If", "Loop"} & {n.op_type for n in graph.graph}


def test_embedding_max_norm_is_an_export_error() -> None:
    # max_norm renormalizes the weight in place during the forward: torch's exporter
    # rejects it, so ortrain stops before building anything
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, DIM, max_norm=1.0))
    trainer = ORTTrainer(  # "off": the refusal (with "auto" it trains in eager)
        model,
        torch.optim.AdamW(model.parameters()),
        TrainerOptions(fallback="off"),
        loss_fn=lambda out, batch: out.sum(),
    )
    with pytest.raises(ExportError):
        trainer.train_step(input=torch.randint(0, VOCAB, (4, 5)))


class CondModel(torch.nn.Module):
    """torch.cond on a batch value: exported as an If whose branches read the Linears'
    parameters from the outer scope."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        h = torch.cond(x.sum() > 0, lambda t: self.a(t), lambda t: self.b(t).tanh(), (x,))
        return (h * h).mean()


@pytest.mark.slow
def test_torch_cond_on_a_batch_value_trains_like_eager() -> None:
    ref = CondModel()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    g = torch.Generator().manual_seed(1)
    taken = set()
    for _ in range(8):
        x = torch.randn(3, 4, generator=g)
        taken.add(bool(x.sum() > 0))
        opt_ref.zero_grad()
        loss_ref = ref(x)
        loss_ref.backward()
        opt_ref.step()
        torch.testing.assert_close(trainer.train_step(x), loss_ref.detach(), rtol=LOSS_RTOL, atol=0)
    assert taken == {True, False}  # both branches ran
    assert "If" not in {n.op_type for n in trainer.train_graphs[0].graph}
    trainer.sync_to_module()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(
            p, q, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )
