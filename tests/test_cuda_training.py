"""Training on ONNX Runtime's CUDA execution provider (skips without a CUDA device and
onnxruntime-gpu); device validation runs everywhere."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.runtime.session import DeviceError, cuda_available, providers
from tests.conftest import bert_batches, bert_mlm, decay_groups, gpt2, lm_batches

needs_cuda = pytest.mark.skipif(
    not cuda_available(), reason="needs a CUDA device and onnxruntime-gpu (CUDAExecutionProvider)"
)


def _run(model, batches, options):
    opt = torch.optim.AdamW(decay_groups(model), lr=2e-3, weight_decay=0.01)
    trainer = ORTTrainer(model, opt, options)
    return trainer, [trainer.train_step(**b).item() for b in batches]


def test_device_option_is_validated():
    with pytest.raises(ValueError, match="cuda:N"):
        TrainerOptions(device="gpu")
    with pytest.raises(ValueError, match="cuda:N"):
        TrainerOptions(device="cuda:x")
    with pytest.raises(ValueError, match="cuda_graph"):
        TrainerOptions(cuda_graph=True)
    assert TrainerOptions(device="cuda:1").device == "cuda:1"


@needs_cuda
def test_cuda_without_an_index_is_the_current_device():
    """torchrun's ranks call torch.cuda.set_device(local_rank) and pass device="cuda": the
    sessions, the stream and the state must all be on that GPU, not on GPU 0."""
    model = gpt2(layers=1, hidden=32, vocab=64)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         TrainerOptions(device="cuda"))  # fmt: skip
    current = torch.cuda.current_device()
    assert trainer.device == torch.device("cuda", current)
    trainer.train_step(**lm_batches(1, vocab=64)[0])
    assert {p.device for p in trainer.params.values()} == {torch.device("cuda", current)}


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_cuda_provider_follows_torchs_tf32_setting(precision):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        (name, options), cpu = providers(torch.device("cuda:1"))
    finally:
        torch.set_float32_matmul_precision(before)
    assert (name, cpu, options["device_id"]) == (
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
        "1",
    )
    assert options["use_tf32"] == ("0" if precision == "highest" else "1")


def _pad_relu_model():
    import onnx_ir as ir
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.INT64, [2, 3])
    f = helper.make_tensor_value_info("f", TensorProto.FLOAT, [2, 3])
    outs = [helper.make_tensor_value_info(n, t, None) for n, t in [("y", 7), ("r", 1)]]
    pads = helper.make_tensor("pads", TensorProto.INT64, [4], [0, 0, 0, 1])
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["y"], name="label_pad"),
        helper.make_node("Relu", ["f"], ["r"], name="relu"),
    ]
    proto = helper.make_model(
        helper.make_graph(nodes, "g", [x, f], outs, [pads]),
        opset_imports=[helper.make_opsetid("", 20)],
    )
    proto.ir_version = 10
    return ir.serde.deserialize_model(proto)


def test_nodes_not_on_a_provider_are_named():
    import onnx_ir as ir
    import onnxruntime as ort

    from ortrain.runtime.session import _RECORD_ASSIGNMENT, nodes_not_on

    so = ort.SessionOptions()
    so.add_session_config_entry(_RECORD_ASSIGNMENT, "1")
    data = ir.serde.serialize_model(_pad_relu_model()).SerializeToString()
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    off = nodes_not_on(sess, "CUDAExecutionProvider")
    assert sorted(off) == [("Pad", "label_pad"), ("Relu", "relu")]
    assert nodes_not_on(sess, "CPUExecutionProvider") == []


def _fake_cuda_sessions(monkeypatch) -> list[bool]:
    """ort.InferenceSession as on a GPU where no node has a CUDA kernel: graph capture
    fails as ONNX Runtime 1.31 fails it; otherwise a CPU session."""
    import onnxruntime as ort

    real, captures = ort.InferenceSession, []

    def fake(data, so, providers, disabled_optimizers):
        name, options = providers[0]
        assert name == "CUDAExecutionProvider"
        captures.append(options.get("enable_cuda_graph") == "1")
        if captures[-1]:
            raise RuntimeError(
                "[ONNXRuntimeError] : 1 : FAIL : This session cannot use the graph capture "
                "feature as requested by the user  as all compute graph nodes have not been "
                "partitioned to the CUDAExecutionProvider"
            )
        return real(data, so, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(ort, "InferenceSession", fake)
    return captures


def test_cuda_graph_failure_names_the_nodes_on_the_cpu(monkeypatch):
    from ortrain.runtime.session import make_session

    captures = _fake_cuda_sessions(monkeypatch)
    with pytest.raises(DeviceError, match=r"cuda_graph=True.*2 node\(s\).*Pad 'label_pad'"):
        make_session(_pad_relu_model(), threads=1, device=torch.device("cuda"), cuda_graph=True)
    assert captures == [True, False]  # the second, plain session only to name the nodes


def test_nodes_on_the_cpu_under_cuda_are_warned_about(monkeypatch):
    from ortrain.runtime.session import make_session

    _fake_cuda_sessions(monkeypatch)
    with pytest.warns(RuntimeWarning, match=r"2 node\(s\) \((Pad|Relu) .*run on the CPU"):
        make_session(_pad_relu_model(), threads=1, device=torch.device("cuda"))


@pytest.mark.skipif(cuda_available(), reason="checks the error raised where CUDA is missing")
def test_cuda_without_a_gpu_build_fails_clearly():
    model = gpt2(layers=1, hidden=64, vocab=128)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DeviceError, match="cuda"):
        ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions("cuda"))
    for k, v in model.state_dict().items():  # nothing was moved or changed
        assert v.device.type == "cpu" and torch.equal(v, before[k])


@needs_cuda
@pytest.mark.parametrize("which", ["gpt2", "bert"])
def test_cuda_fp32_matches_cpu_per_step(which):
    if which == "gpt2":
        base, batches = gpt2(layers=4, hidden=256), lm_batches(20)
    else:
        base, batches = bert_mlm(), bert_batches(20)
    _, cpu = _run(copy.deepcopy(base), batches, TrainerOptions())
    trainer, gpu = _run(copy.deepcopy(base), batches, TrainerOptions(device="cuda"))
    np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=0)
    assert next(trainer.module.parameters()).device.type == "cuda"


@needs_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_half_precision_tracks_fp32_after_200_steps(precision):
    base = gpt2(layers=2, hidden=128, vocab=256)
    data = lm_batches(8, vocab=256)
    batches = [data[i % len(data)] for i in range(200)]
    _, l32 = _run(copy.deepcopy(base), batches, TrainerOptions(device="cuda"))
    opts = TrainerOptions(device="cuda", mixed_precision=precision)
    _, low = _run(copy.deepcopy(base), batches, opts)
    end32, end_low = np.mean(l32[-10:]), np.mean(low[-10:])
    assert abs(end_low - end32) <= 0.02 * end32, (end_low, end32)


@needs_cuda
def test_cuda_graph_replay_gives_the_same_losses():
    base, batches = gpt2(layers=2, hidden=128, vocab=256), lm_batches(6, vocab=256)
    _, plain = _run(copy.deepcopy(base), batches, TrainerOptions(device="cuda"))
    graph_opts = TrainerOptions(device="cuda", cuda_graph=True)
    _, graphed = _run(copy.deepcopy(base), batches, graph_opts)
    np.testing.assert_allclose(graphed, plain, rtol=1e-6, atol=0)


@needs_cuda
def test_cuda_batch_on_device_and_checkpoint_roundtrip(tmp_path):
    base, batches = gpt2(layers=1, hidden=64, vocab=128), lm_batches(4, vocab=128)
    trainer, _ = _run(copy.deepcopy(base), batches[:2], TrainerOptions(device="cuda"))
    on_device = {k: v.cuda() for k, v in batches[2].items()}
    trainer.save_checkpoint(tmp_path / "ck.pt")
    a = trainer.train_step(**on_device).item()
    other = copy.deepcopy(base)
    restored, _ = _run(other, [], TrainerOptions(device="cuda"))
    restored.load_checkpoint(tmp_path / "ck.pt")
    assert restored.train_step(**batches[2]).item() == a


@needs_cuda
@pytest.mark.parametrize("precision", [None, "fp16"])
@pytest.mark.parametrize("which", ["gpt2", "bert"])
def test_cuda_graphs_run_entirely_on_the_gpu(which, precision):
    """Every node of the training and eval graphs on CUDAExecutionProvider: a node left on
    the CPU costs a host round trip per step and blocks CUDA graphs (GPT-2's int64 label
    Pad and the NLL loss did, before pad_as_concat and the stock-op NLL)."""
    if which == "gpt2":
        model, batches = gpt2(layers=2, hidden=64, vocab=128), lm_batches(2, vocab=128)
    else:
        model, batches = bert_mlm(), bert_batches(2)
    opts = TrainerOptions(device="cuda", mixed_precision=precision)
    trainer, _ = _run(model, batches, opts)
    trainer.eval_step(**batches[0])
    sessions = [
        c.session.session for c in [*trainer._graphs.train.values(), *trainer._graphs.eval.values()]
    ]
    assert sessions
    for sess in sessions:  # ONNX Runtime's record of where each node runs (>= 1.31)
        placed = {
            sg.ep_name: [n.op_type for n in sg.get_nodes()]
            for sg in sess.get_provider_graph_assignment_info()
        }
        assert list(placed) == ["CUDAExecutionProvider"], placed


# ------------------------------------------------ the predicted defects (issue 37), on a GPU
# Each is rehearsed on CPU with stand-ins in tests/test_gpu_path.py; scripts/gpu-checks.sh
# runs these (``-k probe``) as its defect probes.
@needs_cuda
def test_probe_the_cuda_provider_really_runs_the_sessions():
    """A real session's providers, not onnxruntime's fixed list (defect 2)."""
    from ortrain.runtime.session import cuda_unavailable_reason

    assert cuda_unavailable_reason() is None
    model = gpt2(layers=1, hidden=64, vocab=128)
    trainer, _ = _run(model, lm_batches(1, vocab=128), TrainerOptions(device="cuda"))
    for c in trainer._graphs.train.values():
        assert c.session.session.get_providers()[0] == "CUDAExecutionProvider"


@needs_cuda
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("engine", ["graph", "auto"])
def test_probe_cuda_graph_applies_the_first_step_once(engine, accum):
    """ONNX Runtime's first run of a capturing session runs the graph twice (defect 1): the
    step counter, the accumulated gradients the update read and the parameters must still
    equal those of plain runs, after the first step and after later ones.

    The two runs' gradients differ by CUDA's reduction-order noise, which AdamW turns into
    steps of up to lr where the gradient is zero in exact arithmetic (GPT-2's attention key
    biases: exactly zero in one run, noise in the other): each parameter element may also
    differ by what the runs' gradient differences can move Adam's steps
    (tests/adam_noise.py), nothing where they differ beyond float noise. A first step
    applied twice moves every parameter by about lr and counts 2; gradients accumulated
    twice double."""
    from tests.adam_noise import NOISE_FLOOR, AdamDrift, TrainerGradients, assert_params_close

    lr = 1e-2
    base, batches = gpt2(layers=2, hidden=64, vocab=128), lm_batches(3 * accum, vocab=128)
    results = []
    for graph in (False, True):
        opts = TrainerOptions(
            device="cuda", cuda_graph=graph, update_engine=engine, grad_accumulation_steps=accum
        )
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        trainer = ORTTrainer(model, opt, opts)
        read, steps = TrainerGradients(trainer), []
        for i, b in enumerate(batches):
            loss = trainer.train_step(**b).item()
            if (i + 1) % accum == 0:
                params = {k: v.detach().cpu().clone() for k, v in model.named_parameters()}
                steps.append((loss, int(trainer.step_tensor), read(trainer.grad_params), params))
        results.append(steps)
    drift = AdamDrift(lr)
    for (l0, s0, g0, p0), (l1, s1, g1, p1) in zip(*results, strict=True):
        assert s1 == s0  # 1 after the first step, not 2
        np.testing.assert_allclose(l1, l0, rtol=1e-6, atol=0)
        assert g1.keys() == g0.keys()
        scale = max(g.abs().max().item() for g in g0.values())
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=NOISE_FLOOR * scale, msg=k)
        drift.observe(g0, g1)
        assert_params_close(p1, p0, rtol=1e-6, atol=1e-7, drift=drift)
    assert results[1][0][1] == 1


@needs_cuda
def test_probe_cuda_graph_refuses_dropout():
    """Replayed seeds would freeze the masks (defect 5)."""
    model = gpt2(layers=1, hidden=64, vocab=128, dropout=0.1)
    opts = TrainerOptions(device="cuda", cuda_graph=True)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), opts)
    with pytest.raises(DeviceError, match=r"draw random numbers.*dropout"):
        trainer.train_step(**lm_batches(1, vocab=128)[0])


@needs_cuda
def test_probe_dropout_masks_change_between_steps_without_cuda_graph():
    """The masks ONNX Runtime's CUDA Dropout draws move on from step to step: the losses of
    one batch repeated with lr=0 differ (they would repeat if the seed were frozen)."""
    model = gpt2(layers=1, hidden=64, vocab=128, dropout=0.3)
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.0), TrainerOptions(device="cuda")
    )
    batch = lm_batches(1, vocab=128)[0]
    losses = [trainer.train_step(**batch).item() for _ in range(3)]
    assert len(set(losses)) == 3, losses


@needs_cuda
@pytest.mark.parametrize("which", ["mixed", "deep"])
def test_probe_segments_train_like_eager_on_cuda(which):
    """A model that cannot be one graph (an op without a gradient rule, a data-dependent
    shape) trains as compiled segments inside torch autograd on CUDA: the segments' sessions
    run on CUDAExecutionProvider, the eager glue on torch's CUDA tensors, and the losses and
    parameters follow eager CUDA training (SGD: reduction-order noise stays noise-sized)."""
    from tests.test_fallback import _batches, _Deep, _Mixed

    make = {"mixed": _Mixed, "deep": _Deep}[which]
    model, ref = make().cuda(), make().cuda()
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        TrainerOptions(device="cuda", fallback="auto"),
    )  # fmt: skip
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for i, (x, y) in enumerate(_batches(4)):
        want = ref(x.cuda(), y.cuda())
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        got = trainer.train_step(x, y)
        torch.testing.assert_close(got.cpu(), want.detach().cpu(), rtol=1e-4, atol=1e-6,
                                   msg=f"step {i}")  # fmt: skip
    assert trainer.segments is not None and not trainer.program.whole
    runners = trainer.segments.model.runners
    assert runners
    sessions = [r.fwd.session for t in runners.values() for r in t.values() if r is not None]
    assert sessions
    assert {s.get_providers()[0] for s in sessions} == {"CUDAExecutionProvider"}
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.device.type == "cuda", k
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=k)
