"""ORTTrainer behaviour beyond parity: dropout seeding, eval, shapes, errors, state."""

from __future__ import annotations

import copy
import dataclasses

import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F

from ortrain import (
    BatchError,
    CheckpointError,
    ExportError,
    GradientError,
    NonFiniteLossError,
    ORTTrainer,
    TrainerOptions,
    UnsupportedOptimizerError,
)
from tests.conftest import bert_batches, bert_mlm, gpt2, lm_batches


def tiny(dropout: float = 0.0):
    return gpt2(layers=2, hidden=64, vocab=128, dropout=dropout)


def _losses(seed: int, steps: int = 4) -> list[float]:
    model = tiny(dropout=0.1)
    trainer = ORTTrainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), TrainerOptions(seed=seed)
    )
    return [trainer.train_step(**b).item() for b in lm_batches(steps, vocab=128)]


@pytest.mark.slow
def test_dropout_same_seed_identical_other_seed_differs():
    a, b, c = _losses(1), _losses(1), _losses(2)
    assert a == b
    assert a != c
    # Masks change every step: a fixed batch gives different losses on consecutive steps
    # even with lr=0.
    model = tiny(dropout=0.1)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0))
    batch = lm_batches(1, vocab=128)[0]
    first, second = trainer.train_step(**batch).item(), trainer.train_step(**batch).item()
    assert first != second


@pytest.mark.slow
def test_dropout_training_lowers_loss_like_eager():
    """100 steps on a small fixed corpus with dropout 0.1: both backends learn it."""
    corpus = lm_batches(4, batch=4, seq=32, vocab=128, seed=7)
    ref = tiny(dropout=0.1)
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    eager, ours = [], []
    for step in range(100):
        batch = corpus[step % len(corpus)]
        opt_ref.zero_grad()
        loss = ref(**batch).loss
        loss.backward()
        opt_ref.step()
        eager.append(loss.item())
        ours.append(trainer.train_step(**batch).item())
    first = sum(ours[:4]) / 4
    last_ours, last_eager = sum(ours[-4:]) / 4, sum(eager[-4:]) / 4
    assert last_ours < 0.6 * first  # a concrete drop
    assert abs(last_ours - last_eager) < 0.15 * last_eager  # and like eager's


def test_eval_step_matches_eager_eval():
    model = bert_mlm(dropout=0.1)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = bert_batches(1)[0]
    trainer.train_step(**batch)
    out = trainer.eval_step(**batch)
    model.eval()
    with torch.no_grad():
        ref = model(**batch)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["logits"], ref.logits, rtol=1e-4, atol=1e-5)
    step = trainer.step
    trainer.eval_step(**batch)
    assert trainer.step == step  # no update


def test_eval_step_returns_the_tensors_nested_in_the_outputs():
    """A model's per-layer states (``output_hidden_states``: a tuple inside its output)
    and a hand-written forward's nested dict come out of ``eval_step`` keyed by their
    path, as eager computes them; before, only top-level tensors did."""
    model = gpt2(layers=2, hidden=32, vocab=64)
    model.config.output_hidden_states = True
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = lm_batches(1, batch=2, seq=8, vocab=64)[0]
    trainer.train_step(**batch)
    out = trainer.eval_step(**batch)
    trainer.sync_to_module()
    model.eval()
    with torch.no_grad():
        ref = model(**batch)
    assert len(ref.hidden_states) == 3
    for i, h in enumerate(ref.hidden_states):
        torch.testing.assert_close(out[f"hidden_states.{i}"], h, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["logits"], ref.logits, rtol=1e-4, atol=1e-5)

    class Nested(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            h = self.lin(x)
            return {
                "loss": F.cross_entropy(h, y),
                "aux": (h, [x.sum(), None], {"p": h.softmax(-1)}),
            }

    net = Nested()
    trainer = ORTTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    trainer.train_step(x, y)
    got = trainer.eval_step(x, y)
    trainer.sync_to_module()
    with torch.no_grad():
        want = net(x, y)
    assert sorted(got) == ["aux.0", "aux.1.0", "aux.2.p", "loss"]
    torch.testing.assert_close(got["aux.0"], want["aux"][0])
    torch.testing.assert_close(got["aux.1.0"], want["aux"][1][0])
    torch.testing.assert_close(got["aux.2.p"], want["aux"][2]["p"])

    # a hand-written output class (a dataclass, not a mapping): its fields by name
    net.forward = lambda x, y: _Out(F.cross_entropy(net.lin(x), y), net.lin(x), (x.sum(),))
    trainer = ORTTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1))
    trainer.train_step(x, y)
    got = trainer.eval_step(x, y)
    trainer.sync_to_module()
    with torch.no_grad():
        want = net(x, y)
    assert sorted(got) == ["extra.0", "logits", "loss"]
    torch.testing.assert_close(got["logits"], want.logits)
    torch.testing.assert_close(got["extra.0"], want.extra[0])


@dataclasses.dataclass
class _Out:
    loss: torch.Tensor
    logits: torch.Tensor
    extra: tuple


@pytest.mark.slow
def test_new_batch_shape_compiles_a_second_graph_and_keeps_parity():
    ref = tiny()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    options = TrainerOptions(eager_if_faster=False)  # (each shape built at once)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), options)
    shapes = [(4, 32), (2, 16), (4, 32), (3, 24)]
    g = torch.Generator().manual_seed(0)
    for b, s in shapes:
        ids = torch.randint(0, 128, (b, s), generator=g)
        opt_ref.zero_grad()
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        opt_ref.step()
        assert trainer.train_step(input_ids=ids, labels=ids).item() == pytest.approx(
            loss.item(), rel=1e-4
        )
    assert len(trainer.train_graphs) == 3


def test_positional_batch_and_loss_fn():
    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )

        def forward(self, x):
            return self.net(x)

    torch.manual_seed(0)
    ref = Regressor()
    model = copy.deepcopy(ref)

    def loss_fn(out, batch):
        return torch.nn.functional.mse_loss(out.squeeze(-1), batch["y"])

    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    trainer = ORTTrainer(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        loss_fn=lambda out, batch: loss_fn(out, batch),
    )
    x, y = torch.randn(32, 8), torch.randn(32)
    for _ in range(5):
        opt_ref.zero_grad()
        loss = loss_fn(ref(x), {"y": y})
        loss.backward()
        opt_ref.step()
        ours = trainer.train_step(x, y=y)
        assert ours.item() == pytest.approx(loss.item(), rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_op_without_rule_names_op_node_and_scope():
    class RunningScore(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.linalg.det(self.proj(x).reshape(-1, 2, 2)).pow(2).mean()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scorer = RunningScore()

        def forward(self, x):
            return self.scorer(x)

    model = Model()
    opts = TrainerOptions(fallback="off")  # the refusal (with "auto": tests/test_fallback.py)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), opts)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(GradientError) as err:
        trainer.train_step(torch.randn(3, 4))
    msg = str(err.value)
    assert "Det" in msg and "node" in msg and "scorer" in msg
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_unsupported_optimizer_and_options():
    model = tiny()
    # an update ortrain does not compile runs as the optimizer's own step, said once
    # (tests/test_eager_optimizer.py trains them)
    with pytest.warns(UserWarning, match=r"RMSprop's update runs as its own step\(\)"):
        assert ORTTrainer(model, torch.optim.RMSprop(model.parameters())).spec.kind == "eager"
    with pytest.warns(UserWarning, match="amsgrad=True"):
        ORTTrainer(model, torch.optim.AdamW(model.parameters(), amsgrad=True))
    other = torch.nn.Linear(2, 2)
    with pytest.raises(UnsupportedOptimizerError, match="not a parameter"):
        ORTTrainer(model, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="grad_accumulation_steps"):
        TrainerOptions(grad_accumulation_steps=0)


def test_nonfinite_loss_raises_and_keeps_state():
    model = tiny()
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = lm_batches(1, vocab=128)[0]
    trainer.train_step(**batch)
    snapshot = {k: v.clone() for k, v in trainer.state_dict()["model"].items()}
    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(float("inf"))
    trainer.params["transformer.ln_f.weight"].copy_(model.transformer.ln_f.weight)
    with pytest.raises(NonFiniteLossError, match="not applied"):
        trainer.train_step(**batch)
    state = trainer.state_dict()["model"]
    for k, v in snapshot.items():
        if k != "transformer.ln_f.weight":
            assert torch.equal(state[k], v), k
    assert trainer.step == 1


@pytest.mark.parametrize("what", ["parameters", "a buffer"])
def test_a_model_on_the_meta_device_is_refused_at_construction(what):
    """Meta tensors have shapes and no data: a step would hand ONNX Runtime null pointers
    (a segmentation fault). One line naming the tensors and what to do instead."""
    from ortrain.core.errors import DeviceError

    if what == "parameters":
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
        names = "0.weight, 0.bias, 1.weight, 1.bias"
    else:
        model = torch.nn.BatchNorm1d(3)
        model.running_mean = torch.empty(3, device="meta")
        names = "running_mean"
    with pytest.raises(DeviceError, match="meta device") as err:
        ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    text = str(err.value)
    assert names in text and "to_empty" in text and "\n" not in text


def test_bad_batch_dtype_is_named():
    """Token ids made float64: eager's embedding refuses them, and so does ortrain, saying
    that eager fails too and naming the input and its dtype."""
    model = tiny()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ExportError, match=r"eager PyTorch too.*'input_ids' is torch.float64"):
        trainer.train_step(input_ids=torch.zeros(2, 8, dtype=torch.float64), labels=None)


def test_state_dict_roundtrip_and_eager_optimizer_compat():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = ORTTrainer(model, opt)
    batches = lm_batches(4, vocab=128)
    for b in batches[:3]:
        trainer.train_step(**b)
    sd = trainer.state_dict()
    # The optimizer part is torch's own format: an eager AdamW loads it.
    eager = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    eager.load_state_dict(sd["model"])
    eager_opt.load_state_dict(sd["optimizer"])
    first = next(iter(eager_opt.state.values()))
    assert float(first["step"]) == 3.0
    # And it loads back into a fresh trainer, which then continues identically.
    expected = trainer.train_step(**batches[3]).item()
    model2 = tiny()
    trainer2 = ORTTrainer(model2, torch.optim.AdamW(model2.parameters(), lr=1e-3))
    trainer2.load_state_dict(sd)
    assert trainer2.train_step(**batches[3]).item() == expected
    # A state dict of another model is refused with the mismatch named, nothing changed.
    other = gpt2(layers=1, hidden=64, vocab=128)
    trainer3 = ORTTrainer(other, torch.optim.AdamW(other.parameters(), lr=1e-3))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"transformer\.h\.1"):
        trainer3.load_state_dict(sd)
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.slow
def test_explain_lists_build_stages_with_node_counts():
    from ortrain import explain

    model = tiny()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "nothing built yet" in explain(trainer)
    trainer.train_step(**lm_batches(1, vocab=128)[0])
    text = explain(trainer)
    for stage in ("export", "fuse_gelu", "autodiff", "lower_cross_entropy"):
        assert stage in text
    # the program (one graph, checked against eager) and the first step's time by stage
    assert trainer.program.whole and trainer.program.segments[0].checked == 1
    assert "graph     (the model) (1 graph(s), 1 checked)" in text
    assert "build time: export" in text and "checks against eager" in text
    autodiff = next(r for r in trainer.build_log if r.stage == "autodiff")
    assert autodiff.nodes_after > 2 * autodiff.nodes_before  # the backward was added
    gelu = next(r for r in trainer.build_log if r.stage == "fuse_gelu")
    assert gelu.nodes_after < gelu.nodes_before  # 8-op chains became one Gelu each
    layers = trainer.module.config.n_layer
    assert gelu.op_delta["Gelu"] == layers and gelu.op_delta["Tanh"] == -layers
    assert f"Gelu +{layers}" in text


@pytest.mark.slow
def test_save_graphs_dir_writes_one_file_per_pass_in_order(tmp_path):
    model = tiny()
    options = TrainerOptions(save_graphs_dir=tmp_path)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    trainer.train_step(**lm_batches(1, vocab=128)[0])
    files = sorted(p.name for p in tmp_path.glob("train.*.onnx"))
    passes = [r.stage for r in trainer.build_log if r.graph == "train" and r.stage != "export"]
    assert [f.split(".")[2] for f in files] == passes  # numbered in pass order
    last = ir.load(tmp_path / files[-1])
    assert len(last.graph) == len(trainer.train_graphs[0].graph)
    assert (tmp_path / "update.onnx").exists()


@pytest.mark.slow
def test_one_tensor_passed_as_two_inputs_stays_two_graph_inputs():
    """``input_ids=ids, labels=ids`` on the first step, other labels later: the exporter
    made one graph input of the one tensor, and later steps fed the labels to the
    embedding too (loss 4.621 instead of 4.570 on this model before the fix)."""
    ref = tiny()
    model = copy.deepcopy(ref)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    other = torch.randint(0, 128, (2, 16), generator=g)
    for labels in (ids, other, ids):
        expected = ref(input_ids=ids, labels=labels).loss.item()
        got = trainer.train_step(input_ids=ids, labels=labels).item()
        assert got == pytest.approx(expected, rel=1e-5)
    graph_inputs = {v.name for v in trainer.train_graphs[0].graph.inputs}
    assert {"input_ids", "labels"} <= graph_inputs
    assert len(trainer.train_graphs) == 1


def test_sdpa_attention_dropout_is_trained_through_eager_attention():
    """HF's default: sdpa attention with attention dropout 0.1. The exporter drops SDPA's
    dropout, so the training export runs through HF's eager attention (same math) and
    keeps it: one Dropout per layer more than the hidden-state dropouts. Eval keeps sdpa."""
    import warnings

    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    layers = 2
    cfg = BertConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64,
    )  # fmt: skip
    model = BertForMaskedLM(cfg)
    assert model.config._attn_implementation == "sdpa"
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = bert_batches(1, batch=2, seq=16)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "attention dropout is lost" warning
        trainer.train_step(**batch)
    dropouts = [n for n in trainer.train_graphs[0].graph if n.op_type == "Dropout"]
    # embeddings + per layer: attention probabilities, attention output, FFN output
    assert len(dropouts) == 1 + 3 * layers
    assert model.config._attn_implementation == "sdpa"
    out = trainer.eval_step(**batch)
    trainer.sync_to_module().eval()
    with torch.no_grad():
        ref = model(**batch)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_export_errors_name_their_cause_in_one_line():
    """No labels: the HF model returns loss=None; float ids: the model's own error, not
    the exporter's pages of advice around it."""
    from ortrain.core.errors import ExportError

    model = tiny()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(ExportError, match=r"loss=None.*labels=") as no_loss:
        trainer.train_step(input_ids=ids)
    with pytest.raises(ExportError, match=r"RuntimeError: .*'indices'.*float32") as float_ids:
        trainer.train_step(input_ids=ids.float(), labels=ids)
    for err in (no_loss, float_ids):
        assert "\n" not in str(err.value)
    # the float ids fail the model's own forward in eager too: said, with eager's error
    assert "GPT2LMHeadModel's forward fails on this batch in eager PyTorch too" in str(
        float_ids.value
    )
    assert "in eager PyTorch too" not in str(no_loss.value)  # eager runs; ortrain finds no loss


@pytest.mark.slow
def test_failing_run_applies_nothing_and_the_next_window_starts_clean(monkeypatch):
    """An out-of-range token id fails inside ONNX Runtime in the second micro-step of an
    accumulation window: a BatchError names the batch, parameters stay, and the partial
    gradient sums are dropped (the next window equals eager's)."""
    # the up-front index check (ortrain/index_check.py) would stop this batch before the run
    monkeypatch.setattr("ortrain.whole_graph.check_batch", lambda checks, batch: None)
    ref = tiny()
    model = copy.deepcopy(ref)
    opts = TrainerOptions(grad_accumulation_steps=2, bucketing="off")  # the batch as given
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), opts)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    good = lm_batches(3, batch=2, seq=8, vocab=128)
    bad = {"input_ids": good[1]["input_ids"] + 128, "labels": good[1]["labels"]}
    trainer.train_step(**good[0])
    with pytest.raises(BatchError, match=r"input_ids: \[2, 8\] int64.*no update.*Gather"):
        trainer.train_step(**bad)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    with pytest.raises(BatchError, match=r"the eval graph failed.*Gather"):
        trainer.eval_step(**bad)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for batch in good[1:]:
        (ref(**batch).loss / 2).backward()
        trainer.train_step(**batch)
    opt_ref.step()
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_many_batch_shapes_warn_once_per_doubling():
    import warnings

    model = tiny()  # unmasked causal batches would be bucketed: one graph per shape here
    options = TrainerOptions(bucketing="off", eager_if_faster=False)  # (each shape built)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    g = torch.Generator().manual_seed(0)
    warned = []
    for seq in (8, 9, 10, 11, 12, 8, 11):  # 5 shapes, two seen again
        ids = torch.randint(0, 128, (2, seq), generator=g)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            trainer.train_step(input_ids=ids, labels=ids)
        warned.append([str(x.message) for x in w if "batch signatures" in str(x.message)])
    assert [len(w) for w in warned] == [0, 0, 0, 1, 0, 0, 0]
    assert "4 batch signatures" in warned[3][0] and "input_ids: [2, 11]" in warned[3][0]
    assert "pad_to_multiple_of" in warned[3][0] and "Python values" not in warned[3][0]
    assert "not one it pads" not in warned[3][0]  # (bucketing="off" here: it could)


class _Tempered(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, tau: float) -> torch.Tensor:
        return F.cross_entropy(self.lin(x) / tau, y)


def test_a_python_number_argument_that_changes_is_named_in_the_warning():
    """Its shapes are all equal: the warning names the value and says to pass a tensor."""
    import warnings

    model = _Tempered()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions())
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for tau in (1.0, 1.5, 2.0, 2.5):
            trainer.train_step(x, y, tau)
    said = [str(m.message) for m in w if "batch signatures" in str(m.message)]
    assert (
        len(said) == 1
        and "tau=2.5" in said[0]
        and "Python values passed to the forward (tau)" in said[0]
    )
    # and why bucketing does not pad such batches: it goes by the inputs' names
    assert "not one it pads (no attention_mask and no 2-D integer tensor of token ids)" in said[0]


@pytest.mark.parametrize("change", ["unfreeze", "freeze"])
def test_changing_requires_grad_after_the_trainer_is_made_trains_the_new_set(change: str) -> None:
    """Gradients and optimizer state are laid out for the parameters that required grad
    when the trainer was made: a layer unfrozen later would stay as it is, one frozen
    later would keep training. The next step lays them out anew, naming the parameters,
    and trains the new set like eager (tests/test_freeze_mid_training.py: the optimizer
    state across it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if change == "unfreeze":
        model[0].requires_grad_(False)

    def loss_of(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).square().mean()

    trainer = ORTTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=lambda out, b: out.square().mean(),
    )
    x = torch.randn(4, 8)
    trainer.train_step(x)
    trainer.sync_to_module()
    ref = copy.deepcopy(model)
    model[0].requires_grad_(change == "unfreeze")
    ref[0].requires_grad_(change == "unfreeze")
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"0\.weight, 0\.bias.*laid out anew"):
        trainer.train_step(x)
    trainer.train_step(x)
    for _ in range(2):
        opt.zero_grad()
        loss_of(ref, x).backward()
        opt.step()
    trainer.sync_to_module()
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=k)
    if change == "freeze":
        assert not any(p.requires_grad for p in model[0].parameters())
