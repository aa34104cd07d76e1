"""The Adam / AdamW update inside the backward (``graph_passes/targets/cpu/update_in_backward.py``,
``ortrain/runtime/update_kernels.c``).

- ``ortrain.cpu.AdamStep`` against torch's fused Adam / AdamW kernels on the same arrays,
  updated in place through ONNX Runtime; nothing changes where the loss is not finite;
  bit-identical on any thread count; errors name the op and the shapes;
- the pass on hand-built graphs: which readers of a parameter order its update (views
  included, shape reads and the loss's / gradient's ancestors not), the gradients stop
  being outputs, all-or-nothing errors;
- trainers: GPT-2 (tied embeddings), BERT-MLM (label-sparse head), Llama (untied head),
  a frozen part and two param groups with an LR schedule, against ``update_engine=
  "torch"`` (the same graph, torch's kernels after it) and eager; when "auto" picks it
  and when not; a step whose loss is not finite changes nothing.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ortrain import NonFiniteLossError, ORTTrainer, TrainerOptions
from ortrain.core.names import CPU_DOMAIN, HYPER_NAMES, hyper_name, state_key
from ortrain.graph_passes.targets.cpu.update_in_backward import (
    LOSS_LEAF_PREFIX,
    MAX_AFTER,
    UpdateInBackwardError,
    done_name,
    update_in_backward,
)
from tests.conftest import bert_batches, bert_mlm, gpt2, lm_batches
from tests.test_forward_kernels import train_against_eager
from tests.test_grad_kernels import _library

pytestmark = pytest.mark.shared_graphs  # many trainers of the same few models

F32 = TensorProto.FLOAT
NAMES = ["P", "G", "M", "V", "H", "L"]


def _adam_session(shape: tuple[int, ...], threads: int) -> ort.InferenceSession:
    vis = [helper.make_tensor_value_info(n, F32, list(shape)) for n in NAMES[:4]]
    vis += [
        helper.make_tensor_value_info("H", F32, [len(HYPER_NAMES)]),
        helper.make_tensor_value_info("L", F32, []),
    ]
    node = helper.make_node("AdamStep", NAMES, ["done"], domain=CPU_DOMAIN)
    out = [helper.make_tensor_value_info("done", F32, [])]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]
    proto = helper.make_model(helper.make_graph([node], "g", vis, out), opset_imports=opsets)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(_library())
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _adam_step(arrays: dict[str, np.ndarray], threads: int = 2) -> float:
    """One AdamStep over ``arrays`` (P, G, M, V, H, L), P / M / V updated in place."""
    sess = _adam_session(arrays["P"].shape, threads)
    binding = sess.io_binding()
    for name in NAMES:
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arrays[name]))
    binding.bind_output("done")
    sess.run_with_iobinding(binding)
    return float(binding.copy_outputs_to_cpu()[0])


def _hyper(lr: float, wd: float, step: int, decoupled: bool) -> np.ndarray:
    values = {"lr": lr, "beta1": 0.9, "beta2": 0.98, "eps": 1e-6, "weight_decay": wd}
    return np.array([*values.values(), step, float(decoupled)], dtype=np.float32)


def _random(shape: tuple[int, ...], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    p, g, m = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    v = rng.random(shape).astype(np.float32) * 0.1
    g[..., 0] = 0.0  # a zero gradient: only the moments' decay and the weight decay act
    return {"P": p, "G": g, "M": m, "V": v}


SHAPES = [(1,), (300,), (70, 33), (4, 5, 768)]  # one element .. several blocks, ragged


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("wd", [0.0, 0.05])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_adam_step_matches_torch_fused_in_place(
    shape: tuple[int, ...], wd: float, decoupled: bool
) -> None:
    arrays = _random(shape, seed=len(shape) + int(wd * 100))
    want = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    step = 7
    arrays |= {"H": _hyper(1e-2, wd, step, decoupled), "L": np.array(2.5, dtype=np.float32)}
    p_buffer = arrays["P"]
    assert _adam_step(arrays) == 1.0
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(
        [want["P"]], [want["G"]], [want["M"]], [want["V"]], [],
        [torch.tensor(float(step))], lr=1e-2, beta1=0.9, beta2=0.98, weight_decay=wd,
        eps=1e-6, amsgrad=False, maximize=False,
    )  # fmt: skip
    assert arrays["P"] is p_buffer  # the bound buffers themselves were updated
    for k in ("P", "M", "V"):
        torch.testing.assert_close(torch.from_numpy(arrays[k]), want[k], rtol=2e-6, atol=1e-7)
    assert not np.array_equal(arrays["P"], _random(shape, len(shape) + int(wd * 100))["P"])


def test_adam_step_is_the_same_on_any_thread_count() -> None:
    results = []
    for threads in (1, 2, 4):
        arrays = _random((5, 40000), seed=3)  # several blocks
        arrays |= {"H": _hyper(1e-3, 0.01, 3, True), "L": np.array(1.0, dtype=np.float32)}
        _adam_step(arrays, threads)
        results.append(arrays)
    for other in results[1:]:
        for k in ("P", "M", "V"):
            np.testing.assert_array_equal(other[k], results[0][k])


@pytest.mark.parametrize("loss", [np.inf, -np.inf, np.nan])
def test_adam_step_changes_nothing_when_the_loss_is_not_finite(loss: float) -> None:
    arrays = _random((70, 33), seed=5)
    before = {k: v.copy() for k, v in arrays.items()}
    arrays |= {"H": _hyper(1e-2, 0.01, 1, True), "L": np.array(loss, dtype=np.float32)}
    assert _adam_step(arrays) == 0.0
    for k in ("P", "G", "M", "V"):
        np.testing.assert_array_equal(arrays[k], before[k])


def test_adam_step_errors_name_the_op_and_shapes() -> None:
    arrays = _random((4, 3), seed=0)
    arrays["M"] = np.zeros((3, 4), dtype=np.float32)
    arrays |= {"H": _hyper(1e-2, 0.0, 1, True), "L": np.array(1.0, dtype=np.float32)}
    sess = _adam_session((4, 3), 1)
    feeds = dict(arrays)
    with pytest.raises(Exception, match=r"AdamStep: exp_avg M is \[3, 4\] but parameter P is"):
        _run_free(sess, feeds)
    feeds["M"] = np.zeros((4, 3), dtype=np.float32)
    feeds["H"] = np.zeros(3, dtype=np.float32)
    with pytest.raises(Exception, match="AdamStep: hyperparameters H hold 3 values; expected 7"):
        _run_free(sess, feeds)


def _run_free(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> None:
    """Run without the declared shapes' checks (a graph of free dimensions)."""
    del sess
    vis = [helper.make_tensor_value_info(n, F32, None) for n in NAMES]
    node = helper.make_node("AdamStep", NAMES, ["done"], domain=CPU_DOMAIN)
    out = [helper.make_tensor_value_info("done", F32, None)]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]
    proto = helper.make_model(helper.make_graph([node], "g", vis, out), opset_imports=opsets)
    so = ort.SessionOptions()
    so.register_custom_ops_library(_library())
    s = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    s.run(None, feeds)


# ------------------------------------------------------------------------------ the pass
def _value(name: str, dims: list[int], dtype: ir.DataType = ir.DataType.FLOAT) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(dims), type=ir.TensorType(dtype))


def _linear_graph(extra_readers: int = 0) -> tuple[ir.Model, dict[str, ir.Node]]:
    """loss = sum(X @ W); the "backward": dY, dW = X^T dY, dX = dY W^T (reads W through a
    Transpose ONNX Runtime may fold into the product: must run before W changes), a
    Reshape view of W read by ``extra_readers`` Neg nodes, 2 W read by an Abs (ONNX
    Runtime folds such scalings into products too), a Shape of W (reads no data)."""
    x, w = _value("X", [4, 3]), _value("W", [3, 2])
    nodes: dict[str, ir.Node] = {}

    def add(name: str, op: str, inputs: list[ir.Value], dims: list[int], **attrs: object):
        out = _value(name, dims, ir.DataType.INT64 if op == "Shape" else ir.DataType.FLOAT)
        attributes = [ir.AttrInt64(k, v) for k, v in attrs.items()]  # type: ignore[arg-type]
        nodes[name] = ir.Node("", op, inputs, attributes, outputs=[out], name=name)
        return out

    y = add("Y", "MatMul", [x, w], [4, 2])
    loss = add("loss", "ReduceSum", [y], [], keepdims=0)
    dy = add("dY", "Identity", [y], [4, 2])  # stands in for the seed broadcast
    xt = add("XT", "Transpose", [x], [3, 4])
    dw = add("grad:W", "MatMul", [xt, dy], [3, 2])
    wt = add("WT", "Transpose", [w], [2, 3])
    dx = add("grad_X", "MatMul", [dy, wt], [4, 3])
    shape = add("W_shape", "Shape", [w], [2])
    view = add("W_view", "Reshape", [w, shape], [3, 2])
    others = [add(f"neg{i}", "Neg", [view], [3, 2]) for i in range(extra_readers)]
    two = _value("two", [])
    two.const_value = ir.tensor(np.array(2.0, dtype=np.float32), name="two")
    scaled = add("W_scaled", "Mul", [w, two], [3, 2])
    scaled_use = add("scaled_use", "Abs", [scaled], [3, 2])
    graph = ir.Graph(
        [x, w], [loss, dw, dx, scaled_use, *others], nodes=list(nodes.values()),
        initializers=[two], opset_imports={"": 17},
    )  # fmt: skip
    return ir.Model(graph, ir_version=9), nodes


def test_pass_orders_the_update_after_the_readers_of_the_parameter() -> None:
    model, nodes = _linear_graph(extra_readers=2)
    done = update_in_backward(model, {"W": "grad:W"}, {"W": 0}, "loss")
    assert done == {"W": done_name("W")}
    graph = model.graph
    (step,) = [n for n in graph if n.op_type == "AdamStep"]
    assert step.domain == CPU_DOMAIN
    names = [v.name for v in step.inputs]
    assert names[:6] == ["W", "grad:W", state_key("exp_avg", "W"), state_key("exp_avg_sq", "W"),
                         hyper_name(0), "loss"]  # fmt: skip
    # the products through the Transpose, the view and the scaling: yes; Y (the loss's
    # ancestor), the Shape and the gradient's own producers: no
    assert sorted(names[6:]) == ["grad_X", "neg0", "neg1", "scaled_use"]
    outputs = [v.name for v in graph.outputs]
    assert "grad:W" not in outputs and outputs[-2:] == [done_name("W"), LOSS_LEAF_PREFIX + "loss"]
    inputs = [v.name for v in graph.inputs]
    assert inputs[2:] == [hyper_name(0), state_key("exp_avg", "W"), state_key("exp_avg_sq", "W")]
    order = list(graph)
    before = ("grad_X", "neg0", "neg1", "scaled_use", "grad:W")
    assert all(order.index(nodes[n]) < order.index(step) for n in before)


def test_pass_refuses_what_it_cannot_order_and_changes_nothing() -> None:
    model, _ = _linear_graph(extra_readers=MAX_AFTER - 1)  # + grad_X, scaled_use: one too many
    before = len(model.graph)
    with pytest.raises(UpdateInBackwardError, match=f"read by {MAX_AFTER + 1} nodes"):
        update_in_backward(model, {"W": "grad:W"}, {"W": 0}, "loss")
    assert len(model.graph) == before and "grad:W" in [v.name for v in model.graph.outputs]
    model, _ = _linear_graph()
    with pytest.raises(UpdateInBackwardError, match="'W' is in no param group"):
        update_in_backward(model, {"W": "grad:W"}, {}, "loss")
    with pytest.raises(UpdateInBackwardError, match="gradient 'nope' is not made by a node"):
        update_in_backward(model, {"W": "nope"}, {"W": 0}, "loss")


# ------------------------------------------------------------------------------ trainers
def _ops(trainer: ORTTrainer) -> list[str]:
    return [n.op_type for n in trainer.train_graphs[0].graph]


def _pair(model: torch.nn.Module, make_opt, **options: object) -> tuple[ORTTrainer, ORTTrainer]:
    """The same model and optimizer twice: the update in the backward, torch's after."""
    other = copy.deepcopy(model)
    a = ORTTrainer(model, make_opt(model), TrainerOptions(update_engine="backward", **options))
    b = ORTTrainer(other, make_opt(other), TrainerOptions(update_engine="torch", **options))
    return a, b


def _train_pair(a: ORTTrainer, b: ORTTrainer, batches: list[dict], schedulers=()) -> None:
    """First step: moments and parameters as torch's kernels make them from the same
    gradients, up to the products' rounding (MKL's results depend on where in the arena an
    operand lies: ~1e-5 relative, more on gradients that are sums cancelling to ~0). The
    moments are linear in the gradient: compared everywhere, against a noise floor of
    their largest element. Adam's step is ``lr * sign(g)`` for any gradient well above
    ``eps``, so where a gradient is that rounding noise two runs may step opposite ways:
    parameters are compared where their gradient is above 1e-3 of the largest. Later
    steps: the losses."""
    for i, batch in enumerate(batches):
        la, lb = a.train_step(**batch), b.train_step(**batch)
        for s in schedulers:
            s.step()
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
        if i == 0:
            for key, s in a.opt_state.items():
                floor = 1e-5 * float(b.opt_state[key].abs().max())
                torch.testing.assert_close(
                    s, b.opt_state[key], rtol=1e-4, atol=floor, msg=lambda m, k=key: f"{k}: {m}"
                )
            for name, p in a.params.items():
                m = b.opt_state.get(state_key("exp_avg", name))
                sure = m.abs() > 1e-3 * m.abs().max() if m is not None else torch.ones_like(p) > 0
                torch.testing.assert_close(
                    p[sure], b.params[name][sure], rtol=1e-5, atol=5e-6,
                    msg=lambda msg, n=name: f"{n}: {msg}",
                )  # fmt: skip
    assert int(a.step_tensor) == int(b.step_tensor) == len(batches)


def _adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)


@pytest.mark.slow
def test_gpt2_updates_in_the_backward_like_torch_kernels() -> None:
    _library()
    model = gpt2(layers=2, hidden=64, vocab=128)
    held = {n: p.data for n, p in model.named_parameters()}  # a user's references
    ptrs = {n: t.data_ptr() for n, t in held.items()}
    a, b = _pair(model, _adamw)
    _train_pair(a, b, lm_batches(3, vocab=128))
    assert a._in_backward and not b._in_backward and a.grads == {}
    # updated where the module keeps them: no second copy, references see the trained values
    assert all(p.data_ptr() == ptrs[n] for n, p in model.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(held[n], p.data) and torch.equal(a.params[n], p.data), n
    ops = _ops(a)
    assert ops.count("AdamStep") == len(a.params)  # every parameter, the tied table once
    outputs = [v.name for v in a.train_graphs[0].graph.outputs]
    assert not any(o.startswith("grad:") for o in outputs)
    assert ops.count("ScatterAddRows") == 2  # the word and position tables' rows


def test_bert_with_a_frozen_part_and_two_groups_on_a_schedule() -> None:
    """Adam (weight decay in the gradient), two groups of their own lr and decay, a
    LambdaLR schedule, the embeddings frozen: none of them gets an update."""
    _library()
    model = bert_mlm(hidden=64, layers=2, vocab=128)
    for p in model.bert.embeddings.parameters():
        p.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    def make(m: torch.nn.Module) -> torch.optim.Optimizer:
        trained = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
        decay = [p for n, p in trained if p.ndim == 2]
        rest = [p for n, p in trained if p.ndim != 2]
        return torch.optim.Adam(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "lr": 3e-3}], lr=1e-3
        )

    a, b = _pair(model, make)
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(t.optimizer, lambda s: 1.0 / (1 + s)) for t in (a, b)
    ]
    _train_pair(a, b, bert_batches(3, vocab=128), schedules)
    assert a._in_backward
    assert _ops(a).count("AdamStep") == sum(p.requires_grad for p in model.parameters())
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


def untied_llama(vocab: int) -> torch.nn.Module:
    """A 2-layer Llama (grouped-query attention) whose LM head is its own weight."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


@pytest.mark.slow
def test_llama_untied_head_trains_like_eager() -> None:
    """ "auto" picks the update in the backward; losses and parameters follow eager
    AdamW (``train_against_eager``)."""
    _library()
    model = untied_llama(vocab=128)
    trainer = train_against_eager(model, lm_batches(3, vocab=128), torch.optim.AdamW, lr=1e-3)
    assert trainer._in_backward
    assert _ops(trainer).count("AdamStep") == len(trainer.params)


# Every family of tests/test_model_families.py: layers sharing weights (ALBERT: one W^T
# that every layer reads), encoder-decoders with a shared table (T5, BART), disentangled
# attention (DeBERTa-v2), multi-query attention (GPT-BigCode), conv stems (ViT, Whisper).
def _families() -> list[str]:
    from tests import test_model_families as fam

    return [*fam.FAMILIES, *fam.CONV_FAMILIES]


@pytest.mark.slow
@pytest.mark.parametrize("family", _families())
def test_model_families_update_in_the_backward_like_torch_kernels(family: str) -> None:
    import transformers

    from tests import test_model_families as fam

    _library()
    g = torch.Generator().manual_seed(1)
    if family in fam.FAMILIES:
        model = fam.FAMILIES[family].build()
        batches = [fam._batch(fam.FAMILIES[family].batch, g) for _ in range(2)]
    else:
        model_cls, config_cls, kwargs, make_batch, _ = fam.CONV_FAMILIES[family]
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
        batches = [make_batch(g) for _ in range(2)]
    a, b = _pair(model, _adamw)
    _train_pair(a, b, batches)
    assert _ops(a).count("AdamStep") == len(b.grad_params or [])


def test_updates_are_leaves_onnx_runtime_runs_right_after_their_gradients() -> None:
    """Serialized for ONNX Runtime (``ort_order.py``), the updates close the file in
    reverse graph order, so its reverse-DFS order runs each right after the gradient
    it reads: the last block's updates come before the first block's backward. The loss's
    own leaf closes the file: ONNX Runtime finishes the forward first, the loss's read of
    the probabilities included, so the cross-entropy gradient can take their buffer (its
    ScatterAddLast runs in place: tens of microseconds, not a copy)."""
    import onnx

    _library()
    model = gpt2(layers=2, hidden=64, vocab=128)
    trainer = ORTTrainer(model, _adamw(model))
    trainer.train_step(**lm_batches(1, vocab=128)[0])
    proto = onnx.ModelProto.FromString(next(iter(trainer._graphs.train.values())).graph.ort_data)
    nodes = list(proto.graph.node)
    updates = [n.name for n in nodes if n.op_type == "AdamStep"]
    read = {i for n in nodes for i in n.input}
    leaves = [n.name for n in nodes if not read & set(n.output)]
    assert set(updates) <= set(leaves) and leaves == [n.name for n in nodes[-len(leaves) :]]
    assert nodes[-1].op_type == "Identity" and nodes[-1].output[0].startswith(LOSS_LEAF_PREFIX)
    assert "ScatterAddLast" in [n.op_type for n in nodes]
    in_graph = [n.name for n in trainer.train_graphs[0].graph if n.op_type == "AdamStep"]
    assert updates == in_graph[::-1]
    assert in_graph.index("update/transformer.h.1.mlp.c_proj.weight") < in_graph.index(
        "update/transformer.h.0.mlp.c_proj.weight"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("opt", "options"),
    [
        ("sgd", {}),
        ("adamw", {"grad_accumulation_steps": 2}),
        ("adamw", {"max_grad_norm": 1.0}),
        ("adamw", {"cpu_kernels": "onnxruntime"}),
    ],
    ids=["sgd", "accumulation", "clipping", "no-kernels"],
)
def test_auto_keeps_the_update_after_the_session_where_it_must(opt: str, options: dict) -> None:
    model = _Scaled()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if opt == "sgd" else _adamw(model)
    trainer = ORTTrainer(model, optimizer, TrainerOptions(**options))
    assert not trainer._in_backward
    trainer.train_step(torch.randn(3, 8), torch.randn(3, 2), torch.tensor(1.0))
    assert trainer.grads  # the gradient buffers the update after the session reads


def test_auto_falls_back_where_the_graph_cannot_order_an_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A parameter whose update the pass refuses (here: no ordering input allowed, and the
    last Linear's input-gradient product is one: with ReLU nothing its gradient reads
    depends on it; with GELU the recomputed GELU value, its weight gradient's input, is
    the GELU backward's second output and does): "auto" warns and builds the graph again
    with the update after the session; "backward" raises."""
    from ortrain.graph_passes.targets.cpu import update_in_backward as pass_module

    _library()
    monkeypatch.setattr(pass_module, "MAX_AFTER", 0)  # the build runs in a forked child
    model = _Scaled(torch.nn.ReLU)
    trainer = ORTTrainer(model, _adamw(model))
    assert trainer._in_backward
    x, y, one = torch.randn(5, 8), torch.randn(5, 2), torch.tensor(1.0)
    with pytest.warns(UserWarning, match="update runs after the session: .* read by 1 nodes"):
        trainer.train_step(x, y, one)
    assert not trainer._in_backward and trainer.grads
    assert "AdamStep" not in _ops(trainer)
    trainer.train_step(x, y, one)
    assert int(trainer.step_tensor) == 2
    other = _Scaled(torch.nn.ReLU)
    strict = ORTTrainer(other, _adamw(other), TrainerOptions(update_engine="backward"))
    with pytest.raises(UpdateInBackwardError, match="read by 1 nodes"):
        strict.train_step(x, y, one)


def test_backward_engine_says_what_it_needs() -> None:
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"'backward' needs no clipping \(max_grad_norm=None\)"):
        ORTTrainer(
            model, _adamw(model), TrainerOptions(update_engine="backward", max_grad_norm=1.0)
        )
    with pytest.raises(ValueError, match="Adam or AdamW"):
        ORTTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            TrainerOptions(update_engine="backward"),
        )


class _Scaled(torch.nn.Module):
    """A regression whose loss a batch input scales (inf: a loss that is not finite)."""

    def __init__(self, act: type[torch.nn.Module] = torch.nn.GELU) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), act(), torch.nn.Linear(16, 2))

    def forward(self, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x), y) * scale


def test_a_step_whose_loss_is_not_finite_changes_nothing() -> None:
    _library()
    torch.manual_seed(0)
    model = _Scaled()
    trainer = ORTTrainer(model, _adamw(model), TrainerOptions(update_engine="backward"))
    x, y = torch.randn(5, 8), torch.randn(5, 2)
    trainer.train_step(x, y, torch.tensor(1.0))
    params = {n: p.clone() for n, p in trainer.params.items()}
    states = {n: s.clone() for n, s in trainer.opt_state.items()}
    with pytest.raises(NonFiniteLossError, match="parameters/optimizer state are unchanged"):
        trainer.train_step(x, y, torch.tensor(float("inf")))
    for n, p in trainer.params.items():
        assert torch.equal(p, params[n]), n
    for n, s in trainer.opt_state.items():
        assert torch.equal(s, states[n]), n
    assert int(trainer.step_tensor) == 1
    trainer.train_step(x, y, torch.tensor(1.0))  # and training goes on
    assert int(trainer.step_tensor) == 2
    assert any(not torch.equal(p, params[n]) for n, p in trainer.params.items())
