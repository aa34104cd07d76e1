"""Mixed precision (fp16/bf16 graph rewrite) and loss scaling (in-graph skip on overflow)."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnx_ir as ir
import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions, loss_scaler
from ortrain.export import export_forward
from ortrain.graph_passes.fusions.lower_cross_entropy import LOWERED_FROM
from ortrain.graph_passes.infra.pipeline import run_pipeline
from ortrain.graph_passes.precision.mixed_precision import FP32_OPS, LOW_OPS
from ortrain.graph_passes.training_pipeline import (
    BuildConfig,
    BuildInputs,
    BuildProducts,
    build_pipeline,
)
from ortrain.loss_scaler import DynamicLossScale, LossScaler
from tests.conftest import bert_batches, bert_mlm, decay_groups, gpt2, lm_batches
from tests.unexportable import smoothed_cross_entropy

pytestmark = pytest.mark.shared_graphs  # many trainers of the same few models

LOW = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}
F32 = ir.DataType.FLOAT


def _is_backward(node: ir.Node) -> bool:
    return "ortrain.grad_of" in node.metadata_props


def _pipeline_graph(model: torch.nn.Module, batch: dict, precision: str) -> tuple[ir.Model, int]:
    """The training graph as the trainer builds it (no ONNX Runtime session needed)."""
    ex = export_forward(model, batch, train=True)
    n_params = sum(1 for r in ex.io if r.role.value == "parameter")
    inputs = BuildInputs(
        ex.output_names[0], tuple(r.name for r in ex.io if r.role.value == "parameter")
    )
    config = BuildConfig(mixed_precision=precision, loss_scaling=precision == "fp16")
    run_pipeline(ex.model, build_pipeline(config, inputs, BuildProducts()))
    return ex.model, n_params


def _assert_precision_lists(model: ir.Model, low: ir.DataType) -> dict[str, int]:
    """Forward nodes follow the documented lists; returns counts per class."""
    counts = {"low": 0, "fp32": 0}
    for node in model.graph:
        if _is_backward(node) or node.op_type == "Cast":
            continue
        floats_in = [v for v in node.inputs if v is not None and v.dtype in (F32, low)]
        floats_out = [v for v in node.outputs if v.dtype in (F32, low)]
        # Nodes a lowering emitted for an fp32 op (the loss) belong to that op's class.
        if node.op_type in FP32_OPS or node.metadata_props.get(LOWERED_FROM) in FP32_OPS:
            assert all(v.dtype == F32 for v in floats_in + floats_out), (
                f"{node.op_type} {node.name} must compute in fp32"
            )
            counts["fp32"] += 1
        elif node.op_type in LOW_OPS and node.op_type not in ("Dropout",):
            data_out = floats_out[:1] if node.op_type == "LayerNormalization" else floats_out
            assert all(v.dtype == low for v in data_out), (
                f"{node.op_type} {node.name} must compute in {low}: "
                f"{[(v.name, v.dtype) for v in data_out]}"
            )
            if node.op_type == "LayerNormalization":  # statistics stay fp32
                assert node.attributes["stash_type"].value == F32.value
            counts["low"] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("which", ["gpt2", "bert"])
def test_structure_follows_documented_op_lists(precision, which):
    if which == "gpt2":
        model, batch = gpt2(layers=2, hidden=64, vocab=128), lm_batches(1, vocab=128)[0]
    else:
        model, batch = bert_mlm(vocab=128, hidden=64), bert_batches(1, vocab=128)[0]
    graph, n_params = _pipeline_graph(model, batch, precision)
    low = LOW[precision]
    counts = _assert_precision_lists(graph, low)
    assert counts["low"] > 3 * counts["fp32"], counts  # most of the forward runs in half
    ops = {(n.op_type, n.outputs[0].dtype) for n in graph.graph if not _is_backward(n)}
    assert ("MatMul", low) in ops or ("Gemm", low) in ops
    assert ("Softmax", F32) in ops  # attention probabilities computed in fp32
    # Master weights: parameters are fp32 inputs and their gradients fp32 outputs.
    for v in graph.graph.inputs:
        if v.name in dict(model.named_parameters()):
            assert v.dtype == F32, v.name
    grads = [v for v in graph.graph.outputs if v.name.startswith("grad:")]
    assert len(grads) == n_params and all(v.dtype == F32 for v in grads)
    loss = graph.graph.outputs[0]
    assert loss.dtype == F32
    # Few casts: about one half copy per parameter plus two per softmax in the forward.
    forward_casts = sum(1 for n in graph.graph if n.op_type == "Cast" and not _is_backward(n))
    softmaxes = sum(1 for n in graph.graph if n.op_type == "Softmax")
    assert forward_casts <= n_params + 2 * softmaxes + 4, (forward_casts, n_params, softmaxes)
    # No Cast of a Cast that round-trips a low value through fp32.
    for n in graph.graph:
        if n.op_type == "Cast" and n.inputs[0].producer() is not None:
            p = n.inputs[0].producer()
            if p.op_type == "Cast":
                assert not (p.inputs[0].dtype == low and n.outputs[0].dtype == low)


def _train(model, batches, options, steps_opt=None):
    opt = torch.optim.AdamW(decay_groups(model), lr=2e-3, weight_decay=0.01)
    trainer = ORTTrainer(model, opt, options)
    losses = [trainer.train_step(**b).item() for b in batches]
    return trainer, losses


@pytest.mark.slow
@pytest.mark.parametrize("which", ["gpt2", "bert"])
def test_fp16_trains_like_fp32_for_200_steps(which):
    if which == "gpt2":
        make, data = lambda: gpt2(layers=2, hidden=128, vocab=256), lm_batches(8, vocab=256)
    else:
        make, data = lambda: bert_mlm(vocab=256, hidden=128), bert_batches(8, vocab=256)
    batches = [data[i % len(data)] for i in range(200)]  # a small fixed corpus, repeated
    base = make()
    _, fp32 = _train(copy.deepcopy(base), batches, TrainerOptions())
    trainer, fp16 = _train(copy.deepcopy(base), batches, TrainerOptions(mixed_precision="fp16"))
    assert trainer.loss_scale is not None and trainer.skipped_steps < 10
    end32, end16 = np.mean(fp32[-10:]), np.mean(fp16[-10:])
    assert end32 < 0.7 * fp32[0]  # it learned something
    assert abs(end16 - end32) <= 0.02 * end32, (end16, end32)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("which", "shape"), [("gpt2", dict(layers=2, hidden=128)), ("bert", dict(hidden=96))]
)
def test_fp16_keeps_about_half_the_activation_bytes(which, shape):
    """The memory report of the fp16 graph against the fp32 one: what the backward keeps
    from the forward is mostly fp16, about half the bytes; what stays fp32 is on the
    documented list (Softmax output, LayerNorm statistics)."""
    if which == "gpt2":
        base, batch = gpt2(vocab=256, **shape), lm_batches(1, vocab=256)[0]
    else:
        base, batch = bert_mlm(vocab=256, **shape), bert_batches(1, vocab=256)[0]
    reports = {}
    for precision in (None, "fp16"):
        model = copy.deepcopy(base)
        # both with the standard-op backwards: the fused CPU kernels are fp32 only and
        # would leave the fp32 graph far fewer temporaries than the fp16 one
        options = TrainerOptions(mixed_precision=precision, cpu_kernels="onnxruntime")
        trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters()), options)
        trainer.train_step(**batch)
        reports[precision] = trainer.memory_report(top=1000).graph
    r32, r16 = reports[None], reports["fp16"]
    assert not r32.unknown_size and not r16.unknown_size
    assert 0.45 <= r16.kept_bytes / r32.kept_bytes <= 0.65, (r16.kept_bytes, r32.kept_bytes)
    by_dtype = dict(r16.kept_bytes_by_dtype)
    assert by_dtype["FLOAT16"] > 2 * by_dtype.get("FLOAT", 0), by_dtype
    fp32_kept = {k.op_type for k in r16.largest_kept if k.dtype == "FLOAT"}
    assert fp32_kept <= set(FP32_OPS) | {"LayerNormalization"}, fp32_kept  # + its statistics
    assert r16.planned_peak_bytes < 0.8 * r32.planned_peak_bytes


def _snapshot(trainer: ORTTrainer) -> dict[str, torch.Tensor]:
    out = {f"param:{k}": v.clone() for k, v in trainer.params.items()}
    out.update({f"state:{k}": v.clone() for k, v in trainer.opt_state.items()})
    out["step"] = trainer.step_tensor.clone()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("precision", [None, "fp16"])
def test_overflow_skips_the_update_bit_identically_and_halves_the_scale(precision):
    model = gpt2(layers=1, hidden=64, vocab=128)
    batches = lm_batches(6, vocab=128)
    # A scale that overflows even fp32 gradients: every step is skipped and halves it.
    huge = 2.0**100 if precision is None else 2.0**40
    options = TrainerOptions(
        mixed_precision=precision,
        loss_scale=DynamicLossScale(initial=huge, window=2),
        max_grad_norm=1.0,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = ORTTrainer(model, opt, options)
    trainer.train_step(**batches[0])
    scale = trainer.loss_scale
    before = _snapshot(trainer)
    assert trainer.skipped_steps == 1 and scale == huge / 2
    trainer.train_step(**batches[1])
    assert trainer.skipped_steps == 2 and trainer.loss_scale == scale / 2
    after = _snapshot(trainer)
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed on a skipped step"
    assert trainer.step == 0
    # Let the scale come down until steps succeed, then it doubles after `window` of them.
    for b in batches[2:] * 30:
        trainer.train_step(**b)
        if trainer.step >= 1:
            break
    assert trainer.step == 1
    settled = trainer.loss_scale
    trainer.train_step(**batches[0])
    assert trainer.step == 2 and trainer.loss_scale == 2 * settled
    assert not torch.equal(after["step"], trainer.step_tensor)


@pytest.mark.slow
def test_static_loss_scale_in_fp32_matches_eager():
    """fp32 with a power-of-two loss scale: scaled and unscaled exactly, so the run is the
    eager one (with clipping and accumulation, which see the unscaled gradients)."""
    from tests.test_parity import _check

    batches = lm_batches(6, batch=4, vocab=512)
    options = TrainerOptions(loss_scale=1024.0, max_grad_norm=0.5, grad_accumulation_steps=2)

    def make_opt(m):
        return torch.optim.AdamW(decay_groups(m), lr=1e-3)

    trainer = _check(lambda: gpt2(layers=2), make_opt, batches, options)
    assert trainer.loss_scale == 1024.0 and trainer.skipped_steps == 0


@pytest.mark.slow
def test_fp16_with_accumulation_and_clipping_tracks_fp32():
    base = gpt2(layers=2, hidden=64, vocab=128)
    batches = lm_batches(10, batch=4, vocab=128)
    opts = {"grad_accumulation_steps": 2, "max_grad_norm": 0.5}
    t32, l32 = _train(copy.deepcopy(base), batches, TrainerOptions(**opts))
    t16, l16 = _train(copy.deepcopy(base), batches, TrainerOptions(mixed_precision="fp16", **opts))
    np.testing.assert_allclose(l16, l32, rtol=5e-3)
    assert t16.step == t32.step == 5
    assert abs(t16.last_grad_norm - t32.last_grad_norm) <= 2e-2 * t32.last_grad_norm
    for k, p in t32.params.items():  # weights moved alike (fp16 rounding of the gradients)
        torch.testing.assert_close(t16.params[k], p, rtol=0, atol=5e-3)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["model's", "unexportable"])
def test_fp16_segments_track_fp32_segments(loss):
    """A model trained as segments (cut at its blocks; or falling back because its loss
    cannot be exported) computes its compiled segments in fp16 like a whole graph: their
    forwards keep fp16 activations for their backwards and return fp32; with dynamic loss
    scaling, accumulation and clipping, losses and weights track the fp32 segments'."""
    base = gpt2(layers=2, hidden=64, vocab=128)
    batches = lm_batches(10, batch=4, vocab=128)
    opts: dict = {"grad_accumulation_steps": 2, "max_grad_norm": 0.5}
    kw: dict = {}
    if loss == "unexportable":  # the exporter cannot translate it: the loss runs in eager

        def smoothed(out, batch):
            logits, labels = out.logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()
            return smoothed_cross_entropy(logits, labels, 0.1)

        kw["loss_fn"] = smoothed
    else:
        opts["segments"] = "blocks"

    def train(options):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(decay_groups(model), lr=2e-3, weight_decay=0.01)
        trainer = ORTTrainer(model, opt, options, **kw)
        return trainer, [trainer.train_step(**b).item() for b in batches]

    t32, l32 = train(TrainerOptions(**opts))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t16, l16 = train(TrainerOptions(mixed_precision="fp16", **opts))
    assert not [w for w in caught if "mixed_precision" in str(w.message)]  # it applies
    assert t16.segments is not None and t32.segments is not None
    assert t16.loss_scale is not None and t16.skipped_steps <= 1
    assert sorted(t16.segments.model.compiled) == sorted(t32.segments.model.compiled)
    want = "transformer.h.0" if loss == "model's" else "transformer"  # cut, or all but the loss
    assert want in t16.segments.model.compiled
    for precision, trainer in (("fp16", t16), ("fp32", t32)):
        saved, outputs = set(), set()
        for table in trainer.segments.model.runners.values():
            for runner in table.values():
                types = runner.graphs.forward.output_types
                saved |= {types[n][1] for n in runner.graphs.saved}
                outputs |= {types[o][1] for o in runner.graphs.forward.output_types
                            if o not in runner.graphs.saved}  # fmt: skip
        assert ("FLOAT16" in saved) == (precision == "fp16"), (precision, saved)
        assert "FLOAT16" not in outputs  # what eager code receives is fp32
    np.testing.assert_allclose(l16, l32, rtol=5e-3)
    assert t16.step == t32.step == 5
    assert abs(t16.last_grad_norm - t32.last_grad_norm) <= 2e-2 * t32.last_grad_norm
    for k, p in t32.params.items():  # weights moved alike (fp16 rounding of the gradients)
        torch.testing.assert_close(t16.params[k], p, rtol=0, atol=5e-3)


@pytest.mark.slow
def test_fp16_eval_returns_fp32_outputs_close_to_fp32():
    model = bert_mlm(vocab=128, hidden=64)
    batch = bert_batches(1, vocab=128)[0]
    m32, m16 = copy.deepcopy(model), copy.deepcopy(model)
    t32 = ORTTrainer(m32, torch.optim.SGD(m32.parameters(), lr=0.1))
    options = TrainerOptions(mixed_precision="fp16")
    t16 = ORTTrainer(m16, torch.optim.SGD(m16.parameters(), lr=0.1), options)
    o32, o16 = t32.eval_step(**batch), t16.eval_step(**batch)
    assert o16.logits.dtype == torch.float32
    torch.testing.assert_close(o16.logits, o32.logits, rtol=0, atol=3e-2)
    torch.testing.assert_close(o16.loss, o32.loss, rtol=5e-3, atol=0)


@pytest.mark.slow
def test_loss_scaler_state_survives_a_checkpoint(tmp_path):
    model = gpt2(layers=1, hidden=64, vocab=128)
    batches = lm_batches(4, vocab=128)
    opts = TrainerOptions(mixed_precision="fp16", loss_scale=DynamicLossScale(window=3))
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), opts)
    for b in batches:
        trainer.train_step(**b)
    assert trainer.loss_scale == 2.0**17  # grew once after 3 finite steps
    trainer.save_checkpoint(tmp_path / "ck.pt")
    other = gpt2(layers=1, hidden=64, vocab=128, seed=5)
    restored = ORTTrainer(other, torch.optim.AdamW(other.parameters(), lr=1e-3), opts)
    restored.load_checkpoint(tmp_path / "ck.pt")
    assert restored.loss_scale == trainer.loss_scale
    assert restored.scaler.state_dict() == trainer.scaler.state_dict()
    assert restored.train_step(**batches[0]).item() == trainer.train_step(**batches[0]).item()


# ----------------------------------------------------------------------- the scaler rule
def test_dynamic_rule_grows_after_window_and_halves_on_overflow():
    s = LossScaler.from_option("dynamic")
    assert s.scale == 2.0**16 and s.config.window == 2000
    for _ in range(1999):
        s.update(True)
    assert s.scale == 2.0**16
    s.update(True)
    assert s.scale == 2.0**17
    s.update(False)
    assert s.scale == 2.0**16 and s.skipped_steps == 1
    for _ in range(1999):  # an overflow restarts the count
        s.update(True)
    assert s.scale == 2.0**16


def test_dynamic_rule_minimum_and_hysteresis():
    s = LossScaler.from_option(DynamicLossScale(initial=4.0, min_scale=1.0, hysteresis=2))
    s.update(False)
    assert s.scale == 4.0  # the first overflow is tolerated
    s.update(False)
    assert s.scale == 2.0
    for _ in range(10):
        s.update(False)
    assert s.scale == 1.0 and s.skipped_steps == 12
    static = LossScaler.from_option(128.0)
    static.update(False)
    static.update(True)
    assert static.scale == 128.0 and static.skipped_steps == 1


# updates skipped in a row before the scaler says so (10: the rule's constant)
SKIPPED_WARNING_AFTER = getattr(loss_scaler, "SKIPPED_WARNING_AFTER", 10)


def test_a_static_scale_that_always_overflows_says_so_once():
    """Every update skipped, the scale never moving: after SKIPPED_WARNING_AFTER in a row
    one warning naming the scale (before: silence while nothing trained)."""
    static = LossScaler.from_option(128.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(SKIPPED_WARNING_AFTER - 1):
            static.update(False)
        static.update(True)  # a finite update ends the run of skips
        for _ in range(SKIPPED_WARNING_AFTER - 1):
            static.update(False)
    with pytest.warns(
        RuntimeWarning, match=rf"last {SKIPPED_WARNING_AFTER} updates .* loss scale 128"
    ) as told:
        for _ in range(3 * SKIPPED_WARNING_AFTER):
            static.update(False)
    assert len(told) == 1  # once


def test_a_dynamic_scale_overflowing_at_its_minimum_says_so():
    s = LossScaler.from_option(DynamicLossScale(initial=4.0, min_scale=1.0))
    with pytest.warns(RuntimeWarning, match=r"min_scale") as told:
        for _ in range(2 + SKIPPED_WARNING_AFTER):
            s.update(False)
    assert len(told) == 1 and s.scale == 1.0


def test_trainer_warns_when_every_update_is_skipped():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    trainer = ORTTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerOptions(loss_scale=3e38),  # a static scale: every fp32 gradient overflows
        loss_fn=lambda out, batch: out.square().mean() * 100,
    )
    weight = trainer.params["weight"].clone()
    with pytest.warns(RuntimeWarning, match=r"loss scale 3e\+38") as told:
        for _ in range(SKIPPED_WARNING_AFTER + 2):
            trainer.train_step(torch.ones(2, 4))
    assert len([w for w in told if "updates" in str(w.message)]) == 1
    assert trainer.skipped_steps == SKIPPED_WARNING_AFTER + 2 and trainer.step == 0
    assert torch.equal(trainer.params["weight"], weight)


def test_option_errors_are_clear():
    with pytest.raises(ValueError, match=r"bf16.*CUDA"):
        TrainerOptions(mixed_precision="bf16")
    with pytest.raises(ValueError, match="mixed_precision"):
        TrainerOptions(mixed_precision="fp8")
    with pytest.raises(ValueError, match="loss_scale"):
        TrainerOptions(loss_scale="sometimes")
    with pytest.raises(ValueError, match="loss_scale"):
        TrainerOptions(loss_scale=0.0)
    with pytest.raises(ValueError, match="window"):
        DynamicLossScale(window=0)
    assert TrainerOptions(mixed_precision="fp16").resolved_loss_scale == "dynamic"
    assert TrainerOptions().resolved_loss_scale is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels need a CUDA device")
def test_bf16_on_cuda_tracks_fp32():
    base = gpt2(layers=2, hidden=128, vocab=256)
    batches = [lm_batches(8, vocab=256)[i % 8] for i in range(200)]
    _, l32 = _train(copy.deepcopy(base), batches, TrainerOptions(device="cuda"))
    _, l16 = _train(
        copy.deepcopy(base), batches, TrainerOptions(device="cuda", mixed_precision="bf16")
    )
    assert abs(np.mean(l16[-10:]) - np.mean(l32[-10:])) <= 0.02 * np.mean(l32[-10:])
