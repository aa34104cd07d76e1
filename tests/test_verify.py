"""The first step of every compiled graph checked against eager (ortrain/verify.py) and the
pass that lets the graph run it without dropout (prepare/dropout_switch.py)."""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import VerificationError
from ortrain.core.names import DROPOUT_SWITCH_INPUT
from ortrain.first_step import EagerSide
from ortrain.graph_passes.prepare.dropout_switch import switch_dropouts
from ortrain.verify import Tolerance, compare, confirm, no_dropout, restoring, snapshot


# ----------------------------------------------------------------------------- compare
def test_compare_passes_float_noise_and_names_a_one_percent_error():
    torch.manual_seed(0)
    want = {"a.weight": torch.randn(64, 64), "b.bias": torch.randn(64)}
    noisy = {k: v * (1 + 1e-6 * torch.randn_like(v)) for k, v in want.items()}
    assert compare(noisy, want, Tolerance.of(None).grad) == []
    wrong = dict(noisy)
    wrong["b.bias"] = want["b.bias"].clone()
    wrong["b.bias"][3] *= 1.01 + 1 / float(want["b.bias"].abs().max())  # 1% of the scale
    bad = compare(wrong, want, Tolerance.of(None).grad)
    assert [m.name for m in bad] == ["b.bias"] and bad[0].error > 1


def test_compare_measures_a_zero_gradient_at_the_others_noise_level():
    # an attention key bias's gradient is 0 in exact arithmetic, float noise in practice:
    # its noise relative to itself is large, relative to the other gradients it is not
    want = {"w": torch.randn(32, 32), "key_bias": torch.full((32,), 1e-9)}
    got = {"w": want["w"].clone(), "key_bias": -want["key_bias"]}
    assert compare(got, want, 1e-3) == []
    got["key_bias"] = torch.full((32,), 0.01)  # a real gradient where eager has none
    assert [m.name for m in compare(got, want, 1e-3)] == ["key_bias"]


def test_compare_flags_one_sided_shapes_and_non_finite():
    want = {"x": torch.ones(3), "y": None, "z": torch.ones(2)}
    got = {"x": None, "y": torch.zeros(3), "z": torch.tensor([1.0, float("nan")])}
    names = sorted(m.name for m in compare(got, want, 1e-3))
    # a gradient only eager has fails, an all-zero one only the graph has agrees
    assert names == ["x (only eager has it)", "z (non-finite values differ)"]
    assert compare({"x": torch.ones(2, 2)}, {"x": torch.ones(4)}, 1e-3)[0].name.startswith(
        "x (shape"
    )


def test_compare_of_float32_measures_as_of_float64():
    """Float32 tensors are measured without float64 copies (norms summed in float64, a
    finite norm standing for finite values): the same mismatches and figures as their
    float64 copies get, non-finite values and differences that overflow float32 too."""
    torch.manual_seed(1)
    want = {f"p{k}": torch.randn(s) for k, s in enumerate([(300, 40), (40,), (7, 3, 5)])}
    got = {k: v + 1e-5 * torch.randn_like(v) for k, v in want.items()}
    got["p1"] = got["p1"] * 1.02
    want["p3"] = torch.tensor([1.0, float("nan"), 2.0])
    got["p3"] = torch.tensor([1.5, float("nan"), 2.0])
    huge_w = {"h": torch.tensor([3e38, -3e38, 1.0]), "i": torch.tensor([3e38, 1.0])}
    huge_g = {"h": torch.tensor([-3e38, 3e38, 1.0]), "i": torch.tensor([3e38, 1.0])}
    for g, w, names in ((got, want, {"p1", "p3"}), (huge_g, huge_w, {"h"})):
        as64 = [{k: v.double() for k, v in d.items()} for d in (g, w)]
        for rtol in (1e-3, 1e-6):
            fast, slow = compare(g, w, rtol), compare(*as64, rtol)
            assert [m.name for m in fast] == [m.name for m in slow]
            for a, b in zip(fast, slow, strict=True):
                assert a.difference == pytest.approx(b.difference, rel=1e-6)
                assert a.scale == pytest.approx(b.scale, rel=1e-9)
        assert {m.name for m in compare(g, w, 1e-3)} == names


def test_compare_takes_the_same_non_finite_values_as_agreeing():
    """NaN where eager has NaN, and the same infinities, agree (an output that is NaN by
    design, e.g. a masked angle); NaN against a number or an infinity of the other sign
    does not."""
    nan, inf = float("nan"), float("inf")
    want = {"a": torch.tensor([1.0, nan, inf, -inf])}
    assert compare({"a": torch.tensor([1.0, nan, inf, -inf])}, want, 1e-3) == []
    for bad in ([1.0, 0.0, inf, -inf], [1.0, nan, -inf, -inf], [1.0, nan, inf, nan]):
        found = compare({"a": torch.tensor(bad)}, want, 1e-3)
        assert [m.name for m in found] == ["a (non-finite values differ)"], bad


def test_confirm_keeps_what_float64_confirms():
    """Both float32 results wander from the exact one alike (kinks, deep normalization):
    not a mismatch. Only the graph wandering far further than eager stands."""
    torch.manual_seed(0)
    exact = {"w": torch.randn(1000, dtype=torch.float64)}
    eager = {"w": exact["w"] + 0.01 * torch.randn(1000, dtype=torch.float64)}
    close = {"w": exact["w"] + 0.01 * torch.randn(1000, dtype=torch.float64)}
    far = {"w": exact["w"] * 1.2}
    for got, kept in ((close, 0), (far, 1)):
        bad = compare(got, eager, 1e-3)
        assert len(bad) == 1  # float32 against float32 flags both
        assert len(confirm(bad, got, eager, exact, 1e-3)) == kept


# ----------------------------------------------------------------------------- eager side
def test_no_dropout_makes_every_dropout_the_identity_and_counts_the_sites():
    x = torch.randn(4, 8)
    q = k = v = torch.randn(1, 2, 5, 4)
    with no_dropout() as mode:
        assert torch.equal(F.dropout(x, 0.5, training=True), x)
        assert torch.equal(torch.nn.Dropout(0.3)(x), x)
        assert torch.equal(F.dropout(x, 0.5, training=False), x)  # not a site: eval
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    assert mode.sites == 3
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_restoring_puts_values_back():
    t = torch.ones(3)
    with restoring([t, t]):
        t.mul_(5)
    assert torch.equal(t, torch.ones(3))


def test_restoring_copies_no_tensor_of_zeros():
    """Zeros (a fresh optimizer's moments) are put back by zeroing, not from a copy (a
    negative zero comes back as zero); a tensor with any other value, NaN included, from
    a copy."""
    zeros, nan, ints, empty = (
        torch.zeros(4),
        torch.tensor([0.0, float("nan")]),
        torch.zeros(3, dtype=torch.int64),
        torch.empty(0),
    )
    assert snapshot(zeros) is None and snapshot(ints) is None and snapshot(empty) is None
    kept = snapshot(nan)
    assert kept is not None and kept.data_ptr() != nan.data_ptr()
    with restoring([zeros, nan, ints]):
        zeros.fill_(3.0)
        nan.fill_(1.0)
        ints.add_(7)
    assert torch.equal(zeros, torch.zeros(4)) and torch.equal(
        ints, torch.zeros(3, dtype=torch.int64)
    )
    assert nan[0] == 0 and nan[1].isnan()


# ----------------------------------------------------------------------------- the switch
def _dropout_model(training_mode: bool | None, ratio: float = 0.5) -> ir.Model:
    x = ir.Value(name="x", shape=ir.Shape([64]), type=ir.TensorType(ir.DataType.FLOAT))
    inputs = [x, ir.Value(name="r", const_value=ir.tensor(np.array(ratio, np.float32)))]
    if training_mode is not None:
        inputs.append(ir.Value(name="t", const_value=ir.tensor(np.array(training_mode))))
    node = ir.node("Dropout", inputs, attributes={"seed": 3}, num_outputs=1, name="drop")
    node.outputs[0].name = "y"
    node.outputs[0].dtype, node.outputs[0].shape = ir.DataType.FLOAT, ir.Shape([64])
    graph = ir.Graph([x], [node.outputs[0]], nodes=[node], opset_imports={"": 17})
    for v in inputs[1:]:
        graph.register_initializer(v)
    return ir.Model(graph, ir_version=8)


def test_the_switch_is_one_input_and_turns_dropout_off():
    model = _dropout_model(True)
    assert switch_dropouts(model) == 1
    assert [v.name for v in model.graph.inputs] == ["x", DROPOUT_SWITCH_INPUT]
    data = ir.serde.serialize_model(model).SerializeToString()
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    x = np.arange(1, 65, dtype=np.float32)
    (off,) = sess.run(None, {"x": x, DROPOUT_SWITCH_INPUT: np.array(False)})
    (on,) = sess.run(None, {"x": x, DROPOUT_SWITCH_INPUT: np.array(True)})
    np.testing.assert_array_equal(off, x)
    kept = on != 0
    assert 0 < kept.sum() < 64
    np.testing.assert_allclose(on[kept], 2 * x[kept])


@pytest.mark.parametrize(("mode", "ratio"), [(None, 0.5), (False, 0.5), (True, 0.0)])
def test_dropouts_that_draw_nothing_are_left_alone(mode, ratio):
    model = _dropout_model(mode, ratio)
    assert switch_dropouts(model) == 0
    assert [v.name for v in model.graph.inputs] == ["x"]


# ----------------------------------------------------------------------------- trainers
class _Net(torch.nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 32),
            torch.nn.Tanh(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(32, 4),
        )

    def forward(self, x, y):
        return F.cross_entropy(self.body(x), y)


def _batches(n: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)
    ]


def _run(model, opt, options, batches):
    trainer = ORTTrainer(model, opt, options)
    losses = [trainer.train_step(x, y).item() for x, y in batches]
    return trainer, losses


@pytest.mark.parametrize(
    ("opt", "extra"),
    [
        ("adamw", {}),  # the update in the backward (CPU default)
        ("adamw", {"update_engine": "torch"}),
        ("sgd", {"grad_accumulation_steps": 2, "max_grad_norm": 1.0}),
    ],
)
def test_the_check_leaves_no_trace(opt, extra):
    """A verified run trains bit for bit like an unverified one: the check's graph run (its
    update with lr 0, its gradients into zeroed buffers) is put back."""
    make = {
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    }[opt]
    results = []
    for verify in (False, True):
        model = _Net()
        trainer, losses = _run(
            model, make(model.parameters()), TrainerOptions(verify=verify, **extra), _batches()
        )
        results.append((losses, {k: v.detach().clone() for k, v in model.named_parameters()}))
        if verify:
            assert trainer.segments is None and trainer.verify_seconds > 0
            assert all(c.verified for c in trainer._graphs.train.values())
    (l0, p0), (l1, p1) = results
    assert l0 == l1
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k


def test_a_model_with_dropout_is_checked_without_it_and_trains_with_it():
    model = _Net(dropout=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no lost-dropout warning
        trainer, _ = _run(
            model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions(), _batches(2)
        )
    assert trainer.segments is None
    # the graph still draws: one batch twice, two different losses
    x, y = _batches(1)[0]
    a, b = trainer.train_step(x, y).item(), trainer.train_step(x, y).item()
    assert a != b


class _Smoothed(torch.nn.Module):
    """A loss with an option that changes the math (label smoothing)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)
        )
        self.loss = torch.nn.CrossEntropyLoss(label_smoothing=0.2)

    def forward(self, x, y):
        return self.loss(self.body(x), y)


def _drop_label_smoothing(monkeypatch) -> None:
    """A test-only exporter that drops an option: cross entropy translated as one
    SoftmaxCrossEntropyLoss whatever its ``label_smoothing`` (as the exporter's own table
    does), in place of ortrain's translation that keeps it (``ortrain/export_losses.py``).
    Builds run in a forked child, which inherits the patch."""
    import ortrain.export as export_mod

    def dropping(self, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
        from onnxscript import opset18 as op

        mode = {0: "none", 1: "mean", 2: "sum"}[reduction]
        loss, _ = op.SoftmaxCrossEntropyLoss(
            self, target, weight, reduction=mode, ignore_index=ignore_index
        )
        return loss

    table = {torch.ops.aten.cross_entropy_loss.default: dropping}
    monkeypatch.setattr(export_mod, "loss_translations", lambda: table)


def _exported_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The loss the exported forward computes (ONNX Runtime, no ortrain passes)."""
    from ortrain.export import export_forward

    ex = export_forward(model, {"x": x, "y": y}, train=True)
    sess = ort.InferenceSession(
        ir.serde.serialize_model(ex.model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    feed = {n: p.detach().numpy() for n, p in model.named_parameters()} | {
        "x": x.numpy(),
        "y": y.numpy(),
    }
    wanted = {i.name for i in sess.get_inputs()}
    (loss, *_) = sess.run(None, {k: v for k, v in feed.items() if k in wanted})
    return float(loss)


def test_label_smoothing_is_exported_with_its_meaning(monkeypatch):
    """ortrain's translation keeps the option; the injected one below drops it (so the
    tests that use it test a real drop)."""
    model = _Smoothed()
    x, y = _batches(1)[0]
    want = model(x, y).item()
    assert abs(_exported_loss(model, x, y) - want) <= 1e-6 * abs(want)
    _drop_label_smoothing(monkeypatch)
    assert abs(_exported_loss(model, x, y) - want) > 1e-4 * abs(want)


def test_an_exporter_that_drops_an_option_is_caught_when_off(monkeypatch):
    _drop_label_smoothing(monkeypatch)
    model = _Smoothed()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = TrainerOptions(fallback="off", graph_cache=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    with pytest.raises(VerificationError, match=r"loss .*differs by"):
        trainer.train_step(*_batches(1)[0])
    for k, v in model.state_dict().items():  # nothing trained
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("drops", [True, False], ids=["dropping-exporter", "exporter"])
def test_an_exporter_that_drops_an_option_trains_like_eager_when_auto(monkeypatch, drops):
    if drops:
        _drop_label_smoothing(monkeypatch)
    model, ref = _Smoothed(), _Smoothed()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    options = TrainerOptions(graph_cache=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in _batches(4):
            opt_ref.zero_grad()
            want = ref(x, y)
            want.backward()
            opt_ref.step()
            got = trainer.train_step(x, y)
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0)
    fallbacks = [w for w in caught if "does not compile as one graph" in str(w.message)]
    if drops:
        assert trainer.segments is not None
        assert len(fallbacks) == 1 and "first step disagrees with eager" in str(
            fallbacks[0].message
        )
    else:  # the option kept: one graph, checked, no fallback
        assert trainer.segments is None and not fallbacks
        assert trainer.program.segments[0].checked == 1
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)


def _wrong_tanh_rule(monkeypatch):
    """A test-only registry override: Tanh's gradient as dy (1 - y) instead of dy (1 - y^2)."""
    from ortrain.graph_passes.autodiff import registry

    (right,) = registry._TABLE[("", "Tanh")]

    def wrong(ctx):
        one = ctx.scalar_like(1.0, ctx.O(0))
        return {0: ctx.op("Mul", ctx.GO(0), ctx.op("Sub", one, ctx.O(0)))}

    monkeypatch.setitem(registry._TABLE, ("", "Tanh"), [dataclasses.replace(right, fn=wrong)])


def test_a_wrong_gradient_rule_is_caught_at_the_first_step_when_off(monkeypatch):
    _wrong_tanh_rule(monkeypatch)
    model = _Net()
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions(fallback="off")
    )
    with pytest.raises(VerificationError) as err:
        trainer.train_step(*_batches(1)[0])
    # the parameters behind the Tanh, with their module
    assert "body.0.weight (module 'body.0')" in str(err.value)


@pytest.mark.slow
def test_a_wrong_gradient_rule_trains_like_eager_when_auto(monkeypatch):
    _wrong_tanh_rule(monkeypatch)
    model, ref = _Net(), _Net()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="does not compile as one graph"):
        trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in _batches(3):
            opt_ref.zero_grad()
            want = ref(x, y)
            want.backward()
            opt_ref.step()
            torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=0)
    # the Linears compile on their own; the Tanh between them runs in eager
    assert sorted(trainer.segments.model.compiled) == ["body.0", "body.3"]
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)


class _ReadsEnv(torch.nn.Module):
    """A forward that reads what no cache key sees (an environment variable)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        scale = float(os.environ.get("ORTRAIN_TEST_SCALE", "1"))
        return F.cross_entropy(self.lin(x) * scale, y)


@pytest.mark.slow
def test_a_stale_cache_entry_is_caught_and_built_again(tmp_path, monkeypatch):
    batches = _batches(2)
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", "1")  # conftest turns it off
    options = TrainerOptions(graph_cache=str(tmp_path))

    def trainer_of(model):
        return ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)

    monkeypatch.setenv("ORTRAIN_TEST_SCALE", "1")
    trainer_of(_ReadsEnv()).train_step(*batches[0])
    monkeypatch.setenv("ORTRAIN_TEST_SCALE", "3")
    model, ref = _ReadsEnv(), _ReadsEnv()
    trainer = trainer_of(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="graph cache disagrees with eager"):
        for x, y in batches:
            opt_ref.zero_grad()
            want = ref(x, y)
            want.backward()
            opt_ref.step()
            torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=0)
    assert trainer.segments is None  # built again: one graph, not segments
    assert trainer.cache_hits == 1 and trainer.build_count == 2
    third = trainer_of(_ReadsEnv())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the entry was replaced: a hit that checks out
        third.train_step(*batches[0])
    assert third.cache_hits == 1


def test_an_evaluation_graph_that_disagrees_runs_in_eager(monkeypatch):
    _drop_label_smoothing(monkeypatch)
    model = _Smoothed()
    options = TrainerOptions(graph_cache=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    x, y = _batches(1)[0]
    with pytest.warns(UserWarning, match="evaluation runs in eager"):
        out = trainer.eval_step(x, y)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(out["loss"], copy.deepcopy(model)(x, y), rtol=1e-6, atol=0)
    options = TrainerOptions(fallback="off", graph_cache=False)
    off = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    with pytest.raises(VerificationError, match="evaluation graph"):
        off.eval_step(x, y)


def _exports(trainer: ORTTrainer) -> int:
    return sum(r.stage == "export" for r in trainer.build_log)


def test_evaluation_reuses_the_training_export():
    """One export per model and signature: the evaluation graph is built from the training
    export (dropout in inference mode), and its first run is checked against eager."""
    model = _Net(dropout=0.3)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batches(1)[0]
    trainer.train_step(x, y)
    out = trainer.eval_step(x, y)
    assert _exports(trainer) == 1 and trainer.build_count == 2
    assert next(iter(trainer._graphs.eval.values())).graph.from_training_export
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(out["loss"], model(x, y), rtol=1e-5, atol=0)


class _Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x, y):
        return F.cross_entropy(self.norm(self.lin(x))[:, :4], y)


def test_a_model_that_evaluates_otherwise_gets_its_own_evaluation_export():
    """BatchNorm normalizes with its running statistics in evaluation: the graph from the
    training export disagrees on its first run, and the model is exported again."""
    model = _Normed()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batches(1)[0]
    trainer.train_step(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not eager: an export of its own
        out = trainer.eval_step(x, y)
    assert _exports(trainer) == 2
    assert not next(iter(trainer._graphs.eval.values())).graph.from_training_export
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(out["loss"], model(x, y), rtol=1e-5, atol=0)


class _Drawing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 512)
        # slopes drawn close to their mean: averaged over the batch, a training-mode
        # forward lands within the loss's tolerance of evaluation's value
        self.act = torch.nn.RReLU(0.199, 0.201)

    def forward(self, x, y):
        return F.cross_entropy(self.act(self.lin(x))[:, :4], y)


def test_a_model_that_draws_in_training_gets_its_own_evaluation_export():
    """A draw other than Dropout (RReLU's slopes) computes otherwise in evaluation, and
    a first run cannot tell it by its loss: the model is exported in evaluation mode."""
    model = _Drawing()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batches(1)[0]
    with pytest.warns(UserWarning, match="draws random numbers"):
        trainer.train_step(x, y)
    out = trainer.eval_step(x, y)
    assert _exports(trainer) == 2
    (compiled,) = trainer._graphs.eval.values()
    assert not compiled.graph.from_training_export
    assert not compiled.graph.random_ops
    trainer.sync_to_module()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(out["loss"], model(x, y), rtol=1e-5, atol=0)


class _Noisy(torch.nn.Module):
    """Noise injected in training: a graph that draws what eager draws otherwise."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        h = self.lin(x)
        return F.cross_entropy(h + 0.1 * torch.randn_like(h), y)


def test_a_graph_that_draws_noise_is_checked_with_its_draws_fixed():
    """Its draws take fixed values on both sides of the check (tests/test_random_switch.py
    has the rest); it was trusted unchecked, with a warning, before."""
    model = _Noisy()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.train_step(*_batches(1)[0])
    assert trainer.segments is None
    assert trainer.program.whole and trainer.program.segments[0].checked == 1


def test_recurrent_inter_layer_dropout_is_off_in_the_check():
    """nn.LSTM draws its inter-layer dropout inside one call, not through F.dropout."""
    for cls in (torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN):
        m = cls(4, 5, num_layers=3, dropout=0.5, batch_first=True)
        x = torch.randn(2, 3, 4)
        with no_dropout() as mode:
            a = m(x)[0]
        m.dropout = 0.0
        assert mode.sites == 2 and torch.equal(a, m(x)[0]), cls.__name__


def test_eager_runs_get_the_batch_on_the_modules_device():
    """The graphs' binding copies a host batch to the device; the eager runs (the check,
    segments, eager evaluation) must too: on an H200 every first-step check of a host
    batch stopped with 'index is on cpu' before this."""
    model = torch.nn.Linear(3, 2)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert trainer._ctx.eager.device == trainer.device
    eager = EagerSide(model, None, torch.device("meta"), Tolerance.of(None), exact=True)
    batch = {"input": torch.ones(2, 3), "ids": torch.tensor([1, 2]), "flag": True}
    moved = eager.on_device(batch)
    assert {k: v.device.type for k, v in moved.items() if torch.is_tensor(v)} == {
        "input": "meta",
        "ids": "meta",
    }
    assert moved["flag"] is True and batch["input"].device.type == "cpu"


@pytest.mark.parametrize("threads", [1, 2])
def test_the_eager_step_of_the_check_runs_in_a_child_beside_the_build(monkeypatch, threads):
    """An eager step's activations would set the training process's peak memory (the
    graph's is lower): the check takes eager's step in a forked child, once per new
    signature, started before the graph's build; where torch may use a second core (its
    thread count, on a machine that has one) the build runs while that child does and
    the child's result is taken after it."""
    import os

    import ortrain.first_step as first_step_mod
    import ortrain.program_context as context_mod

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    held = torch.get_num_threads()
    torch.set_num_threads(threads)
    events: list[str] = []
    real_call, real_job = context_mod.call_forked, first_step_mod.ForkedJob

    def recording(job, what):
        events.append("build")
        return real_call(job, what=what)

    class Recording(real_job):
        def __init__(self, job, *, what, **kwargs):
            events.append("check started")
            super().__init__(job, what=what, **kwargs)

        def result(self):
            events.append("check taken")
            return super().result()

    monkeypatch.setattr(context_mod, "call_forked", recording)  # the builds
    monkeypatch.setattr(first_step_mod, "ForkedJob", Recording)  # the eager steps
    monkeypatch.delenv("ORTRAIN_BUILD_IN_PROCESS", raising=False)
    monkeypatch.delenv("ORTRAIN_EXPORT_IN_PROCESS", raising=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    options = TrainerOptions(
        fallback="off", graph_cache=False, build_progress=False, eager_if_faster=False
    )  # (the second shape built at once)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options,
                         loss_fn=lambda out, batch: out.square().mean())  # fmt: skip
    try:
        for n in (3, 3, 5):
            trainer.train_step(torch.randn(n, 4))
    finally:
        torch.set_num_threads(held)
    beside = ["check started", "build", "check taken"]
    waited = ["check started", "check taken", "build"]
    # one per signature (3 rows, 5 rows); none for the repeat
    assert events == (beside if threads > 1 else waited) * 2
    assert all(g.verified for g in trainer._graphs.train.values())


def test_a_build_beside_the_check_that_fails_raises_where_the_build_would(monkeypatch):
    """What the build beside the eager check raises reaches the step as the build's
    error (the check's child taken first), fallback 'off' and 'auto' alike."""
    import ortrain.whole_program as whole_mod
    from ortrain.core.errors import ExportError

    monkeypatch.setattr(whole_mod, "_cores", lambda: 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    for fallback in ("off", "auto"):
        options = TrainerOptions(fallback=fallback, graph_cache=False, build_progress=False)
        trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options,
                             loss_fn=lambda out, batch: out.square().mean())  # fmt: skip

        def refused(*args, **kwargs):
            raise ExportError("an export that fails")

        monkeypatch.setattr(trainer._ctx.graphs, "build_train", refused)
        if fallback == "off":
            with pytest.raises(ExportError, match="an export that fails"):
                trainer.train_step(torch.randn(3, 4))
        else:
            with pytest.warns(UserWarning, match="an export that fails"):
                trainer.train_step(torch.randn(3, 4))
