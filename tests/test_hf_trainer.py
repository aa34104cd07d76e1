"""ORTHFTrainer against transformers.Trainer on the same model, data and arguments (fp32,
dropout 0): per-step losses, learning rates, gradient norms, eval metrics, final weights;
checkpoints in Trainer's layout that resume (its own and Trainer's) on the same losses; two
torchrun processes (data parallel and ZeRO-1) against one process on the combined batch;
the Trainer features it refuses, at construction.

Run as a script, this file is one torchrun rank of the two-process test.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import BertForSequenceClassification, Trainer, TrainingArguments

from ortrain import CheckpointError, TrainerOptions
from ortrain.core.errors import ExportError
from ortrain.hf_trainer import ORTHFTrainer, trainer_options
from tests.conftest import bert_config, gpt2
from tests.test_parity import drop_key_bias

pytestmark = pytest.mark.shared_graphs  # many trainers of the same few models

ROOT = Path(__file__).resolve().parent.parent
LOSS_RTOL = 1e-4
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-5
VOCAB, SEQ = 128, 16
STEPS, SAVE_AT = 6, 3  # optimizer steps; the checkpoint the resume tests start from


class TokenData(torch.utils.data.Dataset):
    """Causal LM rows (``labels`` = ``input_ids``), or with ``classes`` right-padded rows
    with an attention mask and a class label."""

    def __init__(self, n: int, seed: int, classes: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        self.mask = torch.ones(n, SEQ, dtype=torch.long)
        self.classes = classes
        if classes:
            for i in range(n):
                pad = int(torch.randint(0, SEQ // 2, (1,), generator=g))
                if pad:
                    self.mask[i, SEQ - pad :] = 0
                    self.ids[i, SEQ - pad :] = 0
            self.labels = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not self.classes:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def arguments(out: Path, **kw: Any) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        use_cpu=True,
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
        logging_steps=1,
        save_strategy="no",
        seed=7,
        learning_rate=3e-3,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
    )
    return TrainingArguments(**{**base, **kw})


def gpt2_arguments(out: Path, **kw: Any) -> TrainingArguments:
    """Warmup + cosine, accumulation 2, clipping below the gradient norms; 11 batches per
    epoch: the sixth update's window is one micro-batch (an epoch's short last window)."""
    return arguments(
        out,
        max_steps=STEPS,
        gradient_accumulation_steps=2,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        max_grad_norm=0.5,
        weight_decay=0.01,
        save_strategy="steps",
        save_steps=SAVE_AT,
        **kw,
    )


def steps(trainer: Trainer) -> list[dict[str, float]]:
    return [h for h in trainer.state.log_history if "loss" in h and "step" in h]


def assert_close(actual: list[float], expected: list[float], rtol: float = LOSS_RTOL) -> None:
    assert len(actual) == len(expected) > 0
    torch.testing.assert_close(
        torch.tensor(actual, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        rtol=rtol,
        atol=0,
    )


def assert_logs(actual: list[dict], expected: list[dict]) -> None:
    """Same steps; losses and gradient norms within LOSS_RTOL; the same learning rates."""
    assert [h["step"] for h in actual] == [h["step"] for h in expected]
    assert_close([h["loss"] for h in actual], [h["loss"] for h in expected])
    assert_close([h["grad_norm"] for h in actual], [h["grad_norm"] for h in expected])
    assert [h["learning_rate"] for h in actual] == [h["learning_rate"] for h in expected]


def assert_params(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(
            p.detach(), q.detach(), rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=lambda m, n=name: n + m
        )


def lm_trainer(cls: type[Trainer], out: Path, **kw: Any) -> Trainer:
    return cls(
        model=gpt2(layers=2, hidden=32, vocab=VOCAB, seed=0),
        args=gpt2_arguments(out),
        train_dataset=TokenData(44, seed=3),
        eval_dataset=TokenData(8, seed=4),
        **kw,
    )


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Trainer and ORTHFTrainer trained for STEPS (checkpoints every SAVE_AT), then evaluated."""
    runs: dict[str, Any] = {}
    for name, cls in (("torch", Trainer), ("ortrain", ORTHFTrainer)):
        out = tmp_path_factory.mktemp(name)
        trainer = lm_trainer(cls, out)
        trainer.train()
        runs[name] = {"trainer": trainer, "out": out, "eval": trainer.evaluate()}
    return runs


@pytest.mark.slow
def test_gpt2_losses_learning_rates_and_grad_norms_match_trainer(gpt2_runs):
    ours, ref = gpt2_runs["ortrain"]["trainer"], gpt2_runs["torch"]["trainer"]
    assert len(steps(ref)) == STEPS
    assert_logs(steps(ours), steps(ref))
    assert ours.ortrainer.step == STEPS  # every Trainer step was one ortrain update
    # the module is what ortrain trains, not a copy (accelerate's wrapping must not re-home it)
    params = ours.ortrainer.params
    assert all(p.data_ptr() == params[n].data_ptr() for n, p in ours.model.named_parameters())
    assert_params(ours.model, ref.model)


@pytest.mark.slow
def test_gpt2_eval_loss_matches_trainer(gpt2_runs):
    ours, ref = gpt2_runs["ortrain"]["eval"], gpt2_runs["torch"]["eval"]
    assert_close([ours["eval_loss"]], [ref["eval_loss"]])


@pytest.mark.slow
def test_checkpoint_has_trainer_layout_and_torch_optimizer_state(gpt2_runs):
    ours = gpt2_runs["ortrain"]["out"] / f"checkpoint-{SAVE_AT}"
    ref = gpt2_runs["torch"]["out"] / f"checkpoint-{SAVE_AT}"
    assert {p.name for p in ref.iterdir()} | {"ortrain_state.pt"} == {
        p.name for p in ours.iterdir()
    }
    extra = torch.load(ours / "ortrain_state.pt", weights_only=True)
    assert extra["step"] == SAVE_AT and extra["micro_step"] == 0
    # optimizer.pt is torch's format: it loads into the optimizer Trainer creates, and its
    # moments are Trainer's after the same steps
    state = torch.load(ours / "optimizer.pt", weights_only=True)
    ref_state = torch.load(ref / "optimizer.pt", weights_only=True)
    fresh = Trainer(model=gpt2(layers=2, hidden=32, vocab=VOCAB), args=arguments(ours))
    fresh.create_optimizer().load_state_dict(state)
    assert state["state"].keys() == ref_state["state"].keys()
    for i, entry in ref_state["state"].items():
        for key, expected in entry.items():
            torch.testing.assert_close(
                state["state"][i][key].float(),
                expected.float(),
                rtol=PARAM_RTOL,
                atol=PARAM_RTOL * expected.abs().max().item(),
                msg=lambda m, i=i, key=key: f"state {i} {key}: {m}",
            )


@pytest.mark.slow
@pytest.mark.parametrize("source", ["ortrain", "torch"])
def test_resume_from_mid_run_checkpoint_continues_the_losses(gpt2_runs, tmp_path, source):
    """From ORTHFTrainer's own checkpoint, and from a Trainer run's (no ortrain_state.pt)."""
    run = gpt2_runs[source]
    trainer = lm_trainer(ORTHFTrainer, tmp_path)
    trainer.train(resume_from_checkpoint=str(run["out"] / f"checkpoint-{SAVE_AT}"))
    expected, resumed = (
        [h for h in steps(t) if h["step"] > SAVE_AT] for t in (run["trainer"], trainer)
    )
    assert_logs(resumed, expected)
    assert trainer.ortrainer.step == STEPS
    assert_params(trainer.model, run["trainer"].model)


def test_resume_from_another_optimizers_checkpoint_is_refused(tmp_path):
    """A Trainer run's checkpoint of optim="sgd" resumed with AdamW: one error naming the
    file and what differs (torch itself raises KeyError: 'step'); nothing trained changes."""
    sgd = Trainer(
        model=gpt2(layers=1, hidden=32, vocab=VOCAB, seed=0),
        args=arguments(tmp_path / "sgd", optim="sgd", max_steps=1, save_strategy="steps",
                       save_steps=1),
        train_dataset=TokenData(4, seed=3),
    )  # fmt: skip
    sgd.train()
    folder = tmp_path / "sgd" / "checkpoint-1"
    trainer = ORTHFTrainer(
        model=gpt2(layers=1, hidden=32, vocab=VOCAB, seed=0),
        args=arguments(tmp_path / "adamw", max_steps=2),
        train_dataset=TokenData(8, seed=3),
    )
    with pytest.raises(CheckpointError) as info:
        trainer.train(resume_from_checkpoint=str(folder))
    message = str(info.value)
    assert str(folder / "optimizer.pt") in message and "\n" not in message
    assert "expected AdamW's betas, eps" in message and "SGD's" in message
    assert trainer.ortrainer is not None and trainer.ortrainer.step == 0
    assert not trainer.ortrainer.opt_state or not any(
        t.any() for t in trainer.ortrainer.opt_state.values()
    )


class Unlabelled(TokenData):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


def test_predict_and_evaluate_without_labels_give_outputs_without_a_loss(tmp_path):
    """As Trainer: an unlabelled dataset predicts the model's outputs (no loss), and
    evaluate reports its metrics without eval_loss; not an export error asking for labels.
    Training without labels still says what to pass."""
    kw = dict(args=arguments(tmp_path), train_dataset=TokenData(8, seed=3))
    ref = Trainer(model=gpt2(layers=1, hidden=32, vocab=VOCAB, seed=0), **kw)
    ours = ORTHFTrainer(model=gpt2(layers=1, hidden=32, vocab=VOCAB, seed=0), **kw)
    data = Unlabelled(6, seed=4)
    expected, got = ref.predict(data), ours.predict(data)
    assert got.label_ids is None and "test_loss" not in got.metrics
    assert set(got.metrics) - {
        "test_runtime",
        "test_samples_per_second",
        "test_steps_per_second",
    } == (
        set(expected.metrics) - {"test_runtime", "test_samples_per_second", "test_steps_per_second"}
    )
    torch.testing.assert_close(
        torch.as_tensor(got.predictions), torch.as_tensor(expected.predictions), rtol=1e-4,
        atol=1e-5,
    )  # fmt: skip
    metrics = ours.evaluate(data)
    assert "eval_loss" not in metrics and metrics.keys() == ref.evaluate(data).keys()
    labelled = ours.evaluate(TokenData(4, seed=4))  # the loss again where there are labels
    assert labelled["eval_loss"] == pytest.approx(
        ref.evaluate(TokenData(4, seed=4))["eval_loss"], rel=1e-4
    )
    ours.model.train()  # as Trainer.training_step does: evaluate left it in evaluation mode
    with pytest.raises(ExportError, match=r"loss=None.*labels="):
        ours._ort().train_step(input_ids=data.ids[:2])


@pytest.mark.slow
def test_predict_gives_nested_outputs_as_trainer_does(tmp_path):
    """A model that returns its hidden states (a tuple inside its output) predicts them
    as Trainer does: the same nesting and values; ``ignore_keys`` drops them whole."""
    kw = dict(args=arguments(tmp_path), train_dataset=TokenData(8, seed=3))
    models = [gpt2(layers=2, hidden=32, vocab=VOCAB, seed=0) for _ in range(2)]
    for m in models:
        m.config.output_hidden_states = True
    ref, ours = Trainer(model=models[0], **kw), ORTHFTrainer(model=models[1], **kw)
    data = TokenData(4, seed=4)
    expected, got = ref.predict(data), ours.predict(data)
    logits, hidden = got.predictions
    want_logits, want_hidden = expected.predictions
    assert isinstance(hidden, tuple) and len(hidden) == len(want_hidden) == 3
    torch.testing.assert_close(torch.as_tensor(logits), torch.as_tensor(want_logits),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    for h, w in zip(hidden, want_hidden, strict=True):
        torch.testing.assert_close(torch.as_tensor(h), torch.as_tensor(w), rtol=1e-4, atol=1e-5)
    assert got.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-4)
    dropped = ours.predict(data, ignore_keys=["hidden_states"]).predictions
    torch.testing.assert_close(torch.as_tensor(dropped), torch.as_tensor(want_logits),
                               rtol=1e-4, atol=1e-5)  # fmt: skip


def accuracy(pred) -> dict[str, float]:
    logits, labels = pred.predictions, pred.label_ids
    return {
        "accuracy": float((logits.argmax(-1) == labels).mean()),
        "mean_logit": float(logits.astype("float64").mean()),
    }


@pytest.mark.slow
def test_bert_classification_with_compute_metrics_matches_trainer(tmp_path):
    """Padded batches, accumulation 2, evaluation every 2 steps. The model takes
    num_items_in_batch but its loss is a mean: Trainer sums the window's gradients."""
    runs = {}
    for name, cls in (("torch", Trainer), ("ortrain", ORTHFTrainer)):
        torch.manual_seed(0)
        config = bert_config(vocab=VOCAB, hidden=32, layers=2)
        config.num_labels = 3
        model = BertForSequenceClassification(config)
        args = arguments(
            tmp_path / name,
            max_steps=4,
            gradient_accumulation_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            max_grad_norm=1.0,
        )
        trainer = cls(
            model=model,
            args=args,
            train_dataset=TokenData(32, seed=5, classes=3),
            eval_dataset=TokenData(12, seed=6, classes=3),
            compute_metrics=accuracy,
        )
        trainer.train()
        runs[name] = trainer
    ours, ref = runs["ortrain"], runs["torch"]
    assert_logs(steps(ours), steps(ref))
    evals, ref_evals = ([h for h in t.state.log_history if "eval_loss" in h] for t in (ours, ref))
    assert [h["step"] for h in evals] == [h["step"] for h in ref_evals] == [2, 4]
    for h, r in zip(evals, ref_evals):
        assert h["eval_accuracy"] == r["eval_accuracy"]
        assert_close([h["eval_loss"], h["eval_mean_logit"]], [r["eval_loss"], r["eval_mean_logit"]])


@pytest.mark.slow
@pytest.mark.parametrize("which", ["adafactor", "adagrad"])
def test_optimizers_ortrain_does_not_compile_train_as_with_trainer(tmp_path, which):
    """Trainer's Adafactor (optim="adafactor") and an Adagrad passed in: their own step()
    runs in eager PyTorch over ortrain's gradients; losses, learning rates, gradient norms
    and parameters as Trainer's own run (a BERT classifier on padded batches, accumulation
    2, clipping, warmup + cosine)."""
    runs = {}
    for name, cls in (("torch", Trainer), ("ortrain", ORTHFTrainer)):
        torch.manual_seed(0)
        config = bert_config(vocab=VOCAB, hidden=32, layers=2)
        config.num_labels = 3
        model = BertForSequenceClassification(config)
        kw: dict[str, Any] = _adagrad(model) if which == "adagrad" else {}
        args = arguments(
            tmp_path / name,
            max_steps=5,
            gradient_accumulation_steps=2,
            warmup_steps=2,
            lr_scheduler_type="cosine",
            max_grad_norm=0.5,
            **({"optim": "adafactor"} if which == "adafactor" else {}),
        )
        trainer = cls(model=model, args=args, train_dataset=TokenData(32, seed=5, classes=3), **kw)
        trainer.train()
        runs[name] = trainer
    ours, ref = runs["ortrain"], runs["torch"]
    assert ours.ortrainer.spec.kind == "eager"
    assert_logs(steps(ours), steps(ref))
    # (attention key biases left out: their gradient is float noise, which both
    # optimizers normalise into steps of about the learning rate)
    for (name, p), q in zip(ours.model.named_parameters(), ref.model.parameters(), strict=True):
        torch.testing.assert_close(
            drop_key_bias(name, p.detach(), ours.model),
            drop_key_bias(name, q.detach(), ref.model),
            rtol=PARAM_RTOL,
            atol=PARAM_ATOL,
            msg=lambda m, n=name: n + m,
        )


def _weighted_loss(outputs, labels, num_items_in_batch=None):
    """A user's compute_loss_func: cross-entropy weighting the later half of the vocabulary
    twice, summed over the shifted tokens and divided by Trainer's count of them."""
    logits = outputs["logits"][:, :-1].float()
    target = labels[:, 1:]
    weight = torch.ones(logits.shape[-1])
    weight[logits.shape[-1] // 2 :] = 2.0
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), target.flatten(), weight=weight, reduction="sum"
    )
    return loss / num_items_in_batch


def _classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    config = bert_config(vocab=VOCAB, hidden=32, layers=2)
    config.num_labels = 3
    return BertForSequenceClassification(config)


OWN_LOSSES = {
    # (model, data, Trainer's keywords): label smoothing shifts a causal LM's labels
    "label_smoothing_causal_lm": (
        lambda: gpt2(layers=2, hidden=32, vocab=VOCAB, seed=0),
        lambda seed, n: TokenData(n, seed),
        {"args": {"label_smoothing_factor": 0.5}},
    ),
    "label_smoothing_classifier": (
        _classifier,
        lambda seed, n: TokenData(n, seed, classes=3),
        {"args": {"label_smoothing_factor": 0.2}},
    ),
    "compute_loss_func": (
        lambda: gpt2(layers=2, hidden=32, vocab=VOCAB, seed=0),
        lambda seed, n: TokenData(n, seed),
        {"compute_loss_func": _weighted_loss},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(OWN_LOSSES))
def test_a_loss_trainer_computes_itself_trains_as_with_trainer(tmp_path, case):
    """label_smoothing_factor and compute_loss_func: Trainer pops the labels and computes
    the loss from the outputs of a forward without them; ortrain compiles that loss with
    the model (the labels reach only the loss). Accumulation 2, clipping, evaluation;
    parameters compared after SGD."""
    make, data, setup = OWN_LOSSES[case]
    runs = {}
    for name, cls in (("torch", Trainer), ("ortrain", ORTHFTrainer)):
        args = arguments(  # SGD: float noise in a gradient stays noise-sized in the weights
            tmp_path / name,
            max_steps=4,
            gradient_accumulation_steps=2,
            max_grad_norm=1.0,
            optim="sgd",
            learning_rate=0.1,
            **setup.get("args", {}),
        )
        kw = {k: v for k, v in setup.items() if k != "args"}
        trainer = cls(
            model=make(), args=args, train_dataset=data(3, 24), eval_dataset=data(4, 8), **kw
        )
        trainer.train()
        runs[name] = (trainer, trainer.evaluate())
    (ours, ours_eval), (ref, ref_eval) = runs["ortrain"], runs["torch"]
    assert_logs(steps(ours), steps(ref))
    assert_close([ours_eval["eval_loss"]], [ref_eval["eval_loss"]])
    assert_params(ours.model, ref.model)
    assert ours.ortrainer.segments is None  # one graph: the loss compiled with the model
    # the model's own loss would differ: the loss trained is Trainer's
    plain = Trainer(model=make(), args=arguments(tmp_path / "plain", max_steps=4,
                    gradient_accumulation_steps=2, max_grad_norm=1.0),
                    train_dataset=data(3, 24))  # fmt: skip
    plain.train()
    apart = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(steps(plain), steps(ref)))
    assert apart > 10 * LOSS_RTOL, apart


@pytest.mark.slow
def test_neftune_noise_is_drawn_in_the_graph(tmp_path):
    """Trainer's NEFTune hook (uniform noise on the input embeddings, in training) is
    traced into the one graph and checked at its first step with the draw fixed."""
    args = arguments(tmp_path, max_steps=3, neftune_noise_alpha=5.0)
    trainer = ORTHFTrainer(model=gpt2(layers=2, hidden=32, vocab=VOCAB, seed=0), args=args,
                           train_dataset=TokenData(12, seed=3))  # fmt: skip
    trainer.train()
    ort = trainer.ortrainer
    assert ort.program.whole and ort.program.segments[0].checked == 1
    assert "RandomUniformLike" in {n.op_type for n in ort.train_graphs[0].graph}
    assert all(math.isfinite(h["loss"]) for h in steps(trainer)) and len(steps(trainer)) == 3


@pytest.mark.slow
def test_activation_checkpointing_trains_as_with_trainer(tmp_path):
    """``activation_checkpointing`` (``gradient_checkpointing``): Trainer turns on the
    model's checkpointed layers, whose math is the same; the export traces through them
    and what the backward keeps is ortrain's memory plan. One graph, Trainer's losses."""
    runs = {}
    for name, cls in (("torch", Trainer), ("ortrain", ORTHFTrainer)):
        args = arguments(tmp_path / name, max_steps=3, optim="sgd", learning_rate=0.1,
                         activation_checkpointing=True)  # fmt: skip
        trainer = cls(model=gpt2(layers=2, hidden=32, vocab=VOCAB, seed=0), args=args,
                      train_dataset=TokenData(24, seed=3))  # fmt: skip
        trainer.train()
        runs[name] = trainer
    ours, ref = runs["ortrain"], runs["torch"]
    assert ref.model.is_activation_checkpointing and ours.model.is_activation_checkpointing
    assert ours.ortrainer.program.whole
    assert_logs(steps(ours), steps(ref))
    assert_params(ours.model, ref.model)


# --------------------------------------------------------------------- what it refuses
class _OwnLoss(ORTHFTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _adagrad(model: torch.nn.Module) -> dict[str, Any]:
    return {"optimizers": (torch.optim.Adagrad(model.parameters()), None)}


REFUSED = [
    ("subclass's compute_loss (pass compute_loss_func", {"cls": _OwnLoss}),
    ("bf16=True: TrainerOptions.mixed_precision='bf16' needs a CUDA", {"args": {"bf16": True}}),
    (
        "ortrain_options.grad_accumulation_steps=4 disagrees",
        {"ortrain_options": TrainerOptions(grad_accumulation_steps=4)},
    ),
]


@pytest.mark.parametrize("expected, setup", REFUSED, ids=[r[0].split(":")[0] for r in REFUSED])
def test_unsupported_trainer_features_raise_one_line_at_construction(tmp_path, expected, setup):
    model = gpt2(layers=1, hidden=32, vocab=VOCAB)
    kw = {k: v for k, v in setup.items() if k not in ("args", "cls")}
    if callable(kw.get("optimizers")):
        kw.update(kw.pop("optimizers")(model))
    cls = setup.get("cls", ORTHFTrainer)
    with pytest.raises(ValueError) as info:
        cls(model=model, args=arguments(tmp_path, **setup.get("args", {})), **kw)
    message = str(info.value)
    assert expected in message and "\n" not in message


def test_training_arguments_set_the_trainer_options(tmp_path):
    args = arguments(tmp_path, fp16=True, gradient_accumulation_steps=3, max_grad_norm=0.0)
    options = trainer_options(args, TrainerOptions(zero_stage=1, cpu_kernels="onnxruntime"))
    assert options.mixed_precision == "fp16" and options.resolved_loss_scale == "dynamic"
    assert options.grad_accumulation_steps == 3 and options.seed == 7
    assert options.max_grad_norm == float("inf")  # unclipped, the norm is still reported
    assert options.zero_stage == 1 and options.cpu_kernels == "onnxruntime"
    assert options.device == "cpu"
    assert trainer_options(arguments(tmp_path, max_grad_norm=0.25)).max_grad_norm == 0.25
    assert options.broadcast_buffers  # ddp_broadcast_buffers unset: DDP's default
    own = arguments(tmp_path, ddp_broadcast_buffers=False)
    assert not trainer_options(own).broadcast_buffers
    both = arguments(tmp_path, ddp_broadcast_buffers=True)
    with pytest.raises(ValueError, match="ddp_broadcast_buffers"):
        trainer_options(both, TrainerOptions(broadcast_buffers=False))


# --------------------------------------------------------------------- torchrun
WORLD = 2
DIST_STEPS = 4


def distributed_trainer(out: Path, batch: int, zero_stage: int) -> ORTHFTrainer:
    args = arguments(
        out,
        per_device_train_batch_size=batch,
        max_steps=DIST_STEPS,
        gradient_accumulation_steps=2,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        max_grad_norm=0.5,
        train_sampling_strategy="sequential",  # rank r's batch i: rows of combined batch i
        save_strategy="steps",
        save_steps=DIST_STEPS // 2,
    )
    return ORTHFTrainer(
        model=gpt2(layers=2, hidden=32, vocab=VOCAB, seed=0),
        args=args,
        train_dataset=TokenData(8 * DIST_STEPS, seed=3),
        ortrain_options=TrainerOptions(zero_stage=zero_stage, intra_op_threads=1),
    )


def _rank_main(out: Path) -> None:
    """One torchrun rank: data parallel, ZeRO-1, -2 and -3, ZeRO-1 and ZeRO-3 resumed from
    their checkpoints half-way (``resume``, ``resume3``); rank 0 writes the logs and the
    trained parameters."""
    torch.set_num_threads(1)
    logs = {}
    for stage in (0, 1, 2, 3, "resume", "resume3"):
        zero = {"resume": 1, "resume3": 3}.get(str(stage), stage)
        trainer = distributed_trainer(out / f"stage{stage}", 4 // WORLD, int(zero))
        if stage in ("resume", "resume3"):
            ckpt = out / f"stage{zero}/checkpoint-{DIST_STEPS // 2}"
            trainer.train(resume_from_checkpoint=str(ckpt))
        else:
            trainer.train()
        logs[stage] = [
            h for h in steps(trainer) if isinstance(stage, int) or h["step"] > DIST_STEPS // 2
        ]
        assert trainer.ortrainer is not None
        with trainer.ortrainer.whole_parameters() as model:  # ZeRO-3: gathered (every rank)
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        if trainer.args.process_index == 0:
            torch.save(params, out / f"params{stage}.pt")
    if int(os.environ["RANK"]) == 0:
        (out / "logs.json").write_text(json.dumps(logs))
    # every group torn down before the interpreter: left to exit, one rank in about ten
    # aborted there ("terminate called without an active exception") after all had trained
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_torchrun_two_processes_match_one_on_the_combined_batch(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={WORLD}", str(Path(__file__)), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["ORTRAIN_GRAPH_CACHE"] = str(tmp_path / "graph-cache")  # each graph built by one rank
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logs = json.loads((tmp_path / "logs.json").read_text())
    one = distributed_trainer(tmp_path / "one", 4, 0)
    one.train()
    assert len(steps(one)) == DIST_STEPS
    for stage in ("0", "1", "2", "3", "resume", "resume3"):
        resumed = stage.startswith("resume")
        expected = steps(one)[DIST_STEPS // 2 :] if resumed else steps(one)
        assert_logs(logs[stage], expected)
        params = torch.load(tmp_path / f"params{stage}.pt", weights_only=True)
        for name, p in one.model.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=PARAM_RTOL, atol=PARAM_ATOL)


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
