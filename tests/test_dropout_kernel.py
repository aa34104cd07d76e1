"""ortrain's CPU Dropout (``ortrain/runtime/dropout_kernels.c``) and the pass that moves
training Dropouts onto it (``graph_passes/targets/cpu/dropout.py``).

- the kernel's contract, element by element: ``Y`` is ``X / (1 - ratio)`` where the boolean
  mask keeps and 0 elsewhere; identity with an all-true mask when ``training_mode`` is
  false or the ratio 0; ratio 0.5 when absent; the mask output optional; a ratio out of
  [0, 1) refused naming the op;
- the draws: the kept share within binomial bounds at several ratios, neighbours and
  consecutive runs uncorrelated, a new mask every run, the same run by run in a second
  session of the same seed, another seed another stream, the same masks on one thread,
  on ONNX Runtime's two and on torch's OpenMP team;
- the backward kernel: bit for bit the gradient rule's standard spelling, the gradient
  passed through where nothing was drawn, a mask of another shape refused;
- the pass: what moves (fp32 training Dropouts, their seed kept) and what stays (no
  ``training_mode``, a constant false one, ratio 0, float16, a double ratio);
- a transformer with dropout trained through ``ORTTrainer``: its training graph draws on
  the kernel, its first step checks out against eager, and one seed gives one run.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.targets.cpu.dropout import lower_dropout
from ortrain.runtime import cpu_ops
from ortrain.runtime.session import random_nodes
from tests.test_grad_kernels import _library

F32, F16, F64, BOOL = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BOOL


def _model(
    ratio: float | None = 0.25,
    training: bool | None = True,
    seed: int | None = 5,
    mask: bool = True,
    domain: str = CPU_DOMAIN,
    dtype: int = F32,
    ratio_dtype: int = F32,
) -> onnx.ModelProto:
    """One Dropout of ``x`` [.., ..]; ratio / training_mode as constants (None: left out)."""
    nodes, ins = [], ["x", "", ""]
    if ratio is not None:
        t = helper.make_tensor("rv", ratio_dtype, [], [ratio])
        nodes.append(helper.make_node("Constant", [], ["ratio"], value=t))
        ins[1] = "ratio"
    if training is not None:
        t = helper.make_tensor("tv", BOOL, [], [training])
        nodes.append(helper.make_node("Constant", [], ["training"], value=t))
        ins[2] = "training"
    while ins and ins[-1] == "":
        ins.pop()
    attrs = {"seed": seed} if seed is not None else {}
    outs = ["y", "mask"] if mask else ["y"]
    nodes.append(helper.make_node("Dropout", ins, outs, domain=domain, **attrs))
    vis = [helper.make_tensor_value_info("x", dtype, None)]
    out_vis = [helper.make_tensor_value_info("y", dtype, None)]
    if mask:
        out_vis.append(helper.make_tensor_value_info("mask", BOOL, None))
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]
    return helper.make_model(helper.make_graph(nodes, "g", vis, out_vis), opset_imports=opsets)


def _session(proto: onnx.ModelProto, threads: int = 2) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(_library())
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _x(shape: tuple[int, ...] = (64, 1000), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------- contract
@pytest.mark.parametrize("shape", [(1,), (3, 7), (64, 1000), (5, 4, 3333)])
def test_kept_elements_are_scaled_and_the_rest_zero(shape):
    x = _x(shape)
    y, mask = _session(_model(ratio=0.25)).run(None, {"x": x})
    assert mask.dtype == np.bool_ and mask.shape == x.shape and y.shape == x.shape
    scale = np.float32(1.0) / (np.float32(1.0) - np.float32(0.25))
    np.testing.assert_array_equal(y, np.where(mask, x * scale, np.float32(0.0)))


@pytest.mark.parametrize(
    "ratio, training", [(0.25, False), (0.25, None), (0.0, True)], ids=["off", "absent", "ratio0"]
)
def test_no_draw_is_identity_with_an_all_true_mask(ratio, training):
    x = _x()
    y, mask = _session(_model(ratio=ratio, training=training)).run(None, {"x": x})
    np.testing.assert_array_equal(y, x)
    assert mask.all()


def test_an_absent_ratio_is_one_half_and_the_mask_may_be_left_out():
    x = _x((256, 1024))
    y, mask = _session(_model(ratio=None)).run(None, {"x": x})
    np.testing.assert_array_equal(y, np.where(mask, x * np.float32(2.0), np.float32(0.0)))
    assert abs(mask.mean() - 0.5) < 5 * np.sqrt(0.25 / mask.size)
    (alone,) = _session(_model(ratio=None, mask=False)).run(None, {"x": x})
    np.testing.assert_array_equal(alone, y)  # the same draws without the mask output


@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5])
def test_a_ratio_outside_0_1_is_refused_naming_the_op(ratio):
    with pytest.raises(Exception, match=r"ortrain\.cpu\.Dropout: ratio must be in \[0, 1\)"):
        _session(_model(ratio=ratio)).run(None, {"x": _x((4, 4))})


# ---------------------------------------------------------------------------- the draws
@pytest.mark.parametrize("ratio", [0.05, 0.1, 0.5, 0.9])
def test_the_kept_share_is_one_minus_the_ratio(ratio):
    session = _session(_model(ratio=ratio))
    x = _x((512, 1024))
    for _ in range(3):
        _, mask = session.run(None, {"x": x})
        keep = 1.0 - ratio
        bound = 5 * np.sqrt(keep * (1 - keep) / mask.size)  # five binomial deviations
        assert abs(mask.mean() - keep) < bound, (ratio, mask.mean())


def test_neighbours_and_consecutive_runs_are_uncorrelated():
    session = _session(_model(ratio=0.5))
    x = _x((512, 1024))
    (_, a), (_, b) = session.run(None, {"x": x}), session.run(None, {"x": x})
    a, b = a.reshape(-1), b.reshape(-1)
    bound = 5 * np.sqrt(0.25 * 0.75 / a.size)  # both kept: p = 1/4
    assert abs((a[:-1] & a[1:]).mean() - 0.25) < bound  # neighbours
    assert abs((a[:-2] & a[2:]).mean() - 0.25) < bound
    assert abs((a & b).mean() - 0.25) < bound  # the same element, next run
    assert (a != b).any()


def test_a_seed_gives_one_stream_run_by_run_and_another_seed_another():
    x = _x()
    first, second = _session(_model(seed=11)), _session(_model(seed=11))
    other = _session(_model(seed=12))
    for _ in range(3):
        (_, m1), (_, m2), (_, m3) = (s.run(None, {"x": x}) for s in (first, second, other))
        np.testing.assert_array_equal(m1, m2)
        assert (m1 != m3).mean() > 0.2  # ratio 0.25: a different stream differs in ~37%


def test_the_masks_do_not_depend_on_the_threads():
    x = _x((300, 777))  # blocks of 16384 elements: 15 of them, the last partial
    masks = []
    for threads in (1, 2):
        _, m = _session(_model(), threads=threads).run(None, {"x": x})
        masks.append(m)
    lib = cpu_ops._library()[1]
    was = int(cpu_ops.omp_team())
    try:
        lib.ortrain_use_omp_team(1 - was)  # the other of torch's team and ONNX Runtime's
        _, m = _session(_model()).run(None, {"x": x})
        masks.append(m)
    finally:
        lib.ortrain_use_omp_team(was)
    for m in masks[1:]:
        np.testing.assert_array_equal(m, masks[0])


# ---------------------------------------------------------------------------- backward
def _grad_model(ratio: float | None, training: bool, standard: bool) -> onnx.ModelProto:
    """dX from (dY, mask): ``DropoutGrad`` or the gradient rule's standard spelling."""
    nodes = [
        helper.make_node("Constant", [], ["ratio"], value=helper.make_tensor(
            "rv", F32, [], [0.5 if ratio is None else ratio])),
        helper.make_node("Constant", [], ["training"], value=helper.make_tensor(
            "tv", BOOL, [], [training])),
        helper.make_node("Constant", [], ["one"], value=helper.make_tensor("o", F32, [], [1.0])),
    ]  # fmt: skip
    if standard:  # rules/nn.py without the kernel
        nodes += [
            helper.make_node("Cast", ["mask"], ["maskf"], to=F32),
            helper.make_node("Sub", ["one", "ratio"], ["keep"]),
            helper.make_node("Div", ["one", "keep"], ["s0"]),
            helper.make_node("Where", ["training", "s0", "one"], ["scale"]),
            helper.make_node("Mul", ["dy", "maskf"], ["m"]),
            helper.make_node("Mul", ["m", "scale"], ["dx"]),
        ]
    else:
        ins = ["dy", "mask", "ratio", "training"]
        nodes.append(helper.make_node("DropoutGrad", ins, ["dx"], domain=CPU_DOMAIN))
    vis = [helper.make_tensor_value_info("dy", F32, None),
           helper.make_tensor_value_info("mask", BOOL, None)]  # fmt: skip
    outs = [helper.make_tensor_value_info("dx", F32, None)]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]
    return helper.make_model(helper.make_graph(nodes, "g", vis, outs), opset_imports=opsets)


@pytest.mark.parametrize("shape", [(1,), (3, 7), (5, 4, 3333)])
@pytest.mark.parametrize("ratio", [0.1, 0.5])
def test_the_backward_kernel_is_the_rules_standard_spelling(shape, ratio):
    dy = _x(shape, seed=1)
    mask = np.random.default_rng(2).random(shape) >= ratio
    mask.reshape(-1)[0] = True  # one kept element at least (shape (1,))
    feeds = {"dy": dy, "mask": mask}
    (want,) = _session(_grad_model(ratio, True, standard=True)).run(None, feeds)
    (got,) = _session(_grad_model(ratio, True, standard=False)).run(None, feeds)
    np.testing.assert_array_equal(got, want)
    assert (got[~mask] == 0).all() and (got[mask] != 0).all()


def test_the_backward_kernel_passes_the_gradient_through_where_nothing_was_drawn():
    dy = _x((40, 50))
    mask = np.ones(dy.shape, dtype=bool)  # the forward's mask then
    for ratio, training in ((0.3, False), (0.0, True)):
        (got,) = _session(_grad_model(ratio, training, standard=False)).run(
            None, {"dy": dy, "mask": mask}
        )
        np.testing.assert_array_equal(got, dy)


def test_the_backward_kernel_refuses_a_mask_of_another_shape():
    bad = {"dy": _x((4, 6)), "mask": np.ones((4, 5), dtype=bool)}
    with pytest.raises(Exception, match=r"ortrain\.cpu\.DropoutGrad: dY is \[4, 6\] but mask"):
        _session(_grad_model(0.5, True, standard=False)).run(None, bad)


# ---------------------------------------------------------------------------- the pass
def _lowered(proto: onnx.ModelProto) -> tuple[int, ir.Model]:
    model = ir.serde.deserialize_model(proto)
    return lower_dropout(model), model


def test_the_pass_moves_fp32_training_dropouts_and_keeps_their_seed():
    count, model = _lowered(_model(domain="", seed=77))
    assert count == 1
    (node,) = [n for n in model.graph if n.op_type == "Dropout"]
    assert node.domain == CPU_DOMAIN and node.attributes["seed"].value == 77
    assert model.opset_imports[CPU_DOMAIN] == 1
    # and the rewritten graph runs on the kernel with the contract above
    x = _x((8, 100))
    y, mask = _session(ir.serde.serialize_model(model)).run(None, {"x": x})
    scale = np.float32(1.0) / np.float32(0.75)
    np.testing.assert_array_equal(y, np.where(mask, x * scale, np.float32(0.0)))
    assert 0 < mask.mean() < 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"training": None},  # inference: nothing drawn
        {"training": False},
        {"ratio": 0.0},
        {"dtype": F16},
        {"ratio_dtype": F64},
    ],
    ids=["no-training-mode", "training-false", "ratio-0", "float16", "double-ratio"],
)
def test_the_pass_leaves_dropouts_it_cannot_or_need_not_draw(kwargs):
    count, model = _lowered(_model(domain="", **kwargs))
    assert count == 0
    assert [n.domain for n in model.graph if n.op_type == "Dropout"] == [""]


# ---------------------------------------------------------------------------- training
def _encoder(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.2, batch_first=True)
    return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2), torch.nn.Linear(32, 1))


def _train(seed: int, steps: int = 4) -> tuple[list[float], ORTTrainer]:
    model = _encoder(0)
    trainer = ORTTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        TrainerOptions(seed=seed, graph_cache=False),  # the dropout seeds' root
        loss_fn=lambda out, batch: out.square().mean(),
    )
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 10, 32, generator=g)
    return [trainer.train_step(x).item() for _ in range(steps)], trainer


@pytest.mark.slow
def test_a_model_with_dropout_trains_on_the_kernel_one_seed_one_run():
    _library()  # skips where the kernel library cannot be had
    a, trainer = _train(1)
    b, _ = _train(1)
    c, _ = _train(2)
    assert a == b and a != c
    assert len(set(a)) == len(a)  # new masks every step
    (model,) = trainer.train_graphs
    drawn = [op for op, _ in random_nodes(model)]
    # 4 per encoder layer, as eager draws them: the attention's probabilities (its
    # scaled_dot_product_attention, whose dropout the export once lost), after the
    # attention, inside and after the feed-forward
    assert len(drawn) == 8 and set(drawn) == {"Dropout"}
    on_kernel = [n for n in model.graph if n.op_type == "Dropout" and n.domain == CPU_DOMAIN]
    assert len(on_kernel) == len(drawn)
    grads = [n for n in model.graph if n.op_type == "DropoutGrad" and n.domain == CPU_DOMAIN]
    assert len(grads) == len(drawn)  # each backward one kernel: no Cast of its mask left
    masks = {n.outputs[1].name for n in on_kernel}
    assert not [n for n in model.graph if n.op_type == "Cast" and n.inputs[0].name in masks]
