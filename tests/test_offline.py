"""`ortrain build-training` + TrainingSession.load: training with no torch model present."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from ortrain.cli import main
from ortrain.offline import ArtifactError, TrainingSession


class MLPWithLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)
        )

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.body(x), y)


@pytest.fixture
def exported(tmp_path):
    torch.manual_seed(0)
    model = MLPWithLoss()
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    path = tmp_path / "mlp.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (x, y), str(path), dynamo=True, input_names=["x", "y"], output_names=["loss"]
        )
    return model, path


def test_build_training_then_train_without_torch_model(exported, tmp_path):
    model, path = exported
    ref = copy.deepcopy(model)
    frozen = "body.0.bias"
    out = tmp_path / "artifacts"
    assert (
        main(
            [
                "build-training",
                str(path),
                "--loss",
                "loss",
                "--trainable-from-initializers",
                "--frozen",
                frozen,
                "--optimizer",
                "adamw",
                "--lr",
                "0.01",
                "--weight-decay",
                "0.0",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    session = TrainingSession.load(out)
    assert frozen in session.manifest["frozen"] and frozen not in session.manifest["parameters"]
    ref.body[0].bias.requires_grad_(False)
    opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=0.01, weight_decay=0.0
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        loss = ref(x, y)
        loss.backward()
        opt.step()
        assert session.train_step(x=x, y=y) == pytest.approx(loss.item(), rel=1e-5)
    assert session.step == 5
    trained = dict(ref.named_parameters())
    for name, value in session.parameters.items():
        torch.testing.assert_close(value, trained[name].detach(), rtol=1e-5, atol=1e-6)


def test_build_training_errors(exported, tmp_path, capsys):
    _, path = exported
    assert (
        main(
            [
                "build-training",
                str(path),
                "--loss",
                "nope",
                "--trainable-from-initializers",
                "-o",
                str(tmp_path / "a"),
            ]
        )
        == 1
    )
    assert "loss output 'nope'" in capsys.readouterr().err
    assert (
        main(
            [
                "build-training",
                str(path),
                "--loss",
                "loss",
                "--trainable-from-initializers",
                "--frozen",
                "missing.weight",
                "-o",
                str(tmp_path / "a"),
            ]
        )
        == 1
    )
    with pytest.raises(ArtifactError, match="manifest"):
        TrainingSession.load(tmp_path / "empty")


def _cli(path, out, *extra: str) -> int:
    args = ["build-training", str(path), "--loss", "loss", "--trainable-from-initializers"]
    return main([*args, *extra, "-o", str(out)])


@pytest.mark.parametrize(
    "flags, told",
    [
        (("--max-grad-norm", "-1"), "TrainerOptions.max_grad_norm must be > 0, got -1.0"),
        (("--max-grad-norm", "0"), "TrainerOptions.max_grad_norm must be > 0, got 0.0"),
        (("--max-grad-norm", "nan"), "TrainerOptions.max_grad_norm must be a number, got nan"),
        (("--lr", "nan"), "Invalid learning rate: nan"),
        (("--lr", "-0.1"), "Invalid learning rate: -0.1"),
        (("--weight-decay", "nan"), "Invalid weight_decay value: nan"),
        (("--optimizer", "sgd", "--weight-decay", "-1"), "Invalid weight_decay value: -1.0"),
        (("--optimizer", "lamb", "--lr", "nan"), "Invalid learning rate: nan"),
    ],
)
def test_build_training_refuses_what_the_trainer_refuses(tmp_path, capsys, flags, told):
    """The same rule and words as ORTTrainer's (TrainerOptions, the torch optimizer's own
    constructor), before the model is read: a missing model file is not even looked at."""
    out = tmp_path / "a"
    assert _cli(tmp_path / "not-read.onnx", out, *flags) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and told in err[0], err
    assert not out.exists()


def _written(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_failed_build_leaves_an_existing_folder_as_it_was(
    exported, tmp_path, monkeypatch, capsys
):
    _, path = exported
    out = tmp_path / "artifacts"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # what else the folder holds stays
    assert _cli(path, out, "--lr", "0.01") == 0
    before = _written(out)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("ortrain.offline.np.savez", full_disk)
    # another update graph: written before the state, it would replace the old one
    assert _cli(path, out, "--optimizer", "sgd", "--lr", "0.02") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot write {out}: No space left on device" in err[-1], err
    assert _written(out) == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp
    assert _cli(path, tmp_path / "new", "--lr", "0.02") == 1
    assert not (tmp_path / "new").exists()
    monkeypatch.undo()
    assert _cli(path, out, "--optimizer", "sgd", "--lr", "0.02") == 0  # a build that works
    assert TrainingSession.load(out).manifest["optimizer"]["kind"] == "sgd"  # replaces them
    assert (out / "notes.txt").read_text() == "mine"


def test_build_training_never_follows_links_in_its_folder(exported, tmp_path):
    """A shared artifact folder with links planted at the artifacts' names: they are
    replaced, the files they point to are not written."""
    _, path = exported
    out = tmp_path / "shared"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for name in ("gradient.onnx", "state.npz", "manifest.json"):
        (out / name).symlink_to(victim)
    assert _cli(path, out) == 0
    assert victim.read_text() == "precious"
    assert not any((out / n).is_symlink() for n in ("gradient.onnx", "manifest.json"))
    TrainingSession.load(out)


@pytest.fixture(scope="module")
def dynamic_gpt2(tmp_path_factory):
    """GPT-2 with its loss, exported with dynamic batch and sequence axes (``optimize=False``:
    torch.onnx's optimizer would merge equal initializers, e.g. a fresh model's zero biases,
    into one tensor, and fold the tied LM head's transpose into a separate copy)."""
    from tests.conftest import export_dynamic, gpt2

    model = gpt2(layers=2, hidden=64, vocab=128)
    ids = torch.randint(0, 128, (2, 16))
    path = tmp_path_factory.mktemp("offline") / "gpt2_loss.onnx"
    export_dynamic(
        model,
        lambda m, **b: m(**b, use_cache=False).loss,
        {"input_ids": ids, "labels": ids.clone()},
        path,
        "loss",
        optimize=False,
    )
    return model, path


def _build(path, out, *extra: str) -> int:
    args = ["build-training", str(path), "--loss", "loss", "--trainable-from-initializers"]
    return main([*args, "--weight-decay", "0.0", "-o", str(out), *extra])


@pytest.mark.slow
@pytest.mark.parametrize("cpu_gemm", ["onnxruntime", "blas"])
def test_build_training_dynamic_axes_at_given_sizes(dynamic_gpt2, tmp_path, cpu_gemm, monkeypatch):
    """cpu_gemm="blas": every product of the loaded gradient graph on the BLAS op."""
    import collections

    import onnx

    from ortrain.graph_passes.targets.cpu.cost_model import COST_ENV
    from ortrain.runtime import cpu_ops

    model, path = dynamic_gpt2
    ref = copy.deepcopy(model)
    out = tmp_path / "artifacts"
    assert _build(path, out, "--dim", "batch=4", "--dim", "seq=24") == 0
    if cpu_gemm == "blas":
        try:  # a missing prerequisite skips; the op failing to build fails below
            cpu_ops._compiler()
            cpu_ops._torch_sgemm()
        except cpu_ops.CpuOpsLibraryError as exc:
            pytest.skip(f"the BLAS GEMM op cannot be built here: {exc}")
        monkeypatch.setenv(COST_ENV, "gemm_min_flops=0")
    session = TrainingSession.load(out, cpu_gemm=cpu_gemm)
    blas_ops = session.lowered.get("blas_gemm", {}).get("ortrain.blas::Gemm", 0)
    assert blas_ops >= 8 if cpu_gemm == "blas" else "blas_gemm" not in session.lowered
    assert session.manifest["batch_shapes"] == {"input_ids": [4, 24], "labels": [4, 24]}
    # Every parameter (the tied embedding once, under either name), none of the exporter's
    # constants.
    trained = session.manifest["parameters"]
    names = {f"model.{n}" for n, _ in model.named_parameters(remove_duplicate=False)}
    assert len(trained) == len(list(model.parameters())) and set(trained) <= names
    ops = collections.Counter(n.op_type for n in onnx.load(str(out / "gradient.onnx")).graph.node)
    assert ops["Gelu"] + ops["FastGelu"] == 2 and ops["Tanh"] == 0
    ids = _steps_like_eager(session, ref, (4, 24))
    with pytest.raises(ArtifactError, match=r"'input_ids': shape \[4, 16\].*\[4, 24\]"):
        session.train_step(input_ids=ids[:, :16], labels=ids[:, :16])


@pytest.mark.slow
def test_load_lowers_with_the_pipelines_target_stage(dynamic_gpt2, tmp_path, monkeypatch):
    """The CPU kernels and BLAS products come from the training pipeline's target stage at
    load (the passes a trainer's build runs, by the same gates), and train like eager."""
    from ortrain.graph_passes.targets.cpu.cost_model import COST_ENV
    from ortrain.graph_passes.training_pipeline import pipeline_entries
    from ortrain.runtime import cpu_ops

    try:
        cpu_ops._compiler()
        cpu_ops._torch_sgemm()
    except cpu_ops.CpuOpsLibraryError as exc:
        pytest.skip(f"ortrain's CPU kernels cannot be built here: {exc}")
    monkeypatch.setenv(COST_ENV, "gemm_min_flops=0")
    model, path = dynamic_gpt2
    ref = copy.deepcopy(model)
    out = tmp_path / "artifacts"
    # SGD: each weight moves by its gradient, so the weights compare the gradients element
    # by element (Adam's normalized step would turn float noise of ~0 gradients into lr)
    sgd = ("--optimizer", "sgd", "--lr", "0.1")
    assert _build(path, out, "--dim", "batch=2", "--dim", "seq=16", *sgd) == 0
    session = TrainingSession.load(out, cpu_gemm="blas", cpu_kernels="ortrain")
    order = [e.pass_.name for e in pipeline_entries(*_every_gate())]
    lowered = list(session.lowered)
    assert lowered == [n for n in order if n in lowered]  # the pipeline's order
    # the embedding gradients' scatters, the tied head's in-place leaf, the kernels
    for name in ("blas_gemm", "scatter_rows", "scatter_in_place", "cpu_softmax",
                 "cpu_layer_norm"):  # fmt: skip
        assert name in lowered, (name, lowered)
    assert session.lowered["cpu_softmax"].get("ortrain.cpu::Softmax", 0) >= 2
    _steps_like_eager(session, ref, (2, 16), sgd_lr=0.1)
    trained = dict(ref.named_parameters(remove_duplicate=False))
    for name, value in session.parameters.items():  # every one: the names are model.<param>
        ref_value = trained[name.removeprefix("model.")].detach()
        torch.testing.assert_close(value, ref_value, rtol=1e-4, atol=1e-5, msg=name)


def _steps_like_eager(
    session: TrainingSession, ref, shape: tuple[int, int], sgd_lr: float | None = None
) -> torch.Tensor:
    """Three steps (AdamW, or SGD at ``sgd_lr``) of the GPT-2 artifacts and of eager on the
    same batches, the losses equal step by step; returns the last batch."""
    if sgd_lr is None:
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    else:
        opt = torch.optim.SGD(ref.parameters(), lr=sgd_lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 128, shape, generator=g)
        opt.zero_grad()
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        assert session.train_step(input_ids=ids, labels=ids) == pytest.approx(loss.item(), rel=1e-5)
    return ids


def _every_gate():
    from ortrain.graph_passes import pass_table
    from ortrain.graph_passes.training_pipeline import BuildProducts

    return pass_table.EVERY_GATE, pass_table.EVERY_INPUT, BuildProducts()


@pytest.mark.slow
def test_build_training_no_optimize_builds_the_plain_graph(dynamic_gpt2, tmp_path):
    import collections
    import subprocess
    import sys
    from pathlib import Path

    import onnx

    _, path = dynamic_gpt2
    out = tmp_path / "plain"
    # A fresh process, as from the shell (it once failed there on a module not yet imported).
    args = ["build-training", str(path), "--loss", "loss", "--trainable-from-initializers"]
    args += ["--dim", "batch=2", "--dim", "seq=8", "--no-optimize", "-o", str(out)]
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-m", "ortrain.cli", *args], capture_output=True, text=True, cwd=root
    )
    assert proc.returncode == 0, proc.stderr
    ops = collections.Counter(n.op_type for n in onnx.load(str(out / "gradient.onnx")).graph.node)
    assert ops["Gelu"] == ops["FastGelu"] == 0 and ops["Tanh"] == 2


@pytest.mark.parametrize(
    "dims, expected",
    [
        ((), "symbolic dimensions ['batch', 'seq']"),
        (("--dim", "batch=2"), "symbolic dimensions ['seq']"),
        (("--dim", "batch=2", "--dim", "sq=8"), "no input has a dimension named 'sq'"),
    ],
)
def test_build_training_symbolic_dims_errors(dynamic_gpt2, tmp_path, capsys, dims, expected):
    _, path = dynamic_gpt2
    assert _build(path, tmp_path / "a", *dims) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_build_training_unwritable_output_is_one_line(tmp_path):
    import subprocess
    import sys

    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]  # fmt: skip
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 4], [0.1] * 12)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    loss = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    graph = helper.make_graph(nodes, "g", [x], [loss], [w])
    src = tmp_path / "tiny.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), src)
    cmd = [sys.executable, "-m", "ortrain.cli", "build-training", str(src), "--loss", "loss",
           "--trainable-from-initializers", "-o", "/proc/ortrain-artifacts"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ortrain build-training: error: cannot write")


def test_the_artifacts_are_a_program_every_graph_value_of_which_has_a_role(exported, tmp_path):
    """The manifest is the program's: every input and output of ``gradient.onnx`` has a
    role (the weights, the batch, the loss, each gradient ``of`` its parameter), one
    segment, the update after it; the session binds by those roles."""
    import json

    import onnx_ir as ir

    _, path = exported
    out = tmp_path / "artifacts"
    args = ["build-training", str(path), "--loss", "loss", "--trainable-from-initializers"]
    assert main([*args, "--frozen", "body.0.bias", "-o", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "ortrain.program/1"
    assert manifest["program"]["update"] == "graph"
    assert [s["kind"] for s in manifest["program"]["segments"]] == ["graph"]
    roles = {name: (role, of) for name, role, of in manifest["io"]}
    graph = ir.load(out / "gradient.onnx").graph
    names = [v.name for v in (*graph.inputs, *graph.outputs)]
    assert sorted(roles) == sorted(names)
    assert roles["body.0.bias"] == ("frozen_parameter", None)
    assert roles["x"] == ("batch", None) and roles["loss"] == ("loss", None)
    grads = {of for role, of in roles.values() if role == "gradient"}
    params = {n for n, (role, _) in roles.items() if role == "parameter"}
    assert grads == params == set(manifest["parameters"]) and len(params) == 3
    assert not (out / "update.onnx").exists()
    session = TrainingSession.load(out)
    assert sorted(session.state.grads) == sorted(params)
    assert session.parameters["body.0.bias"] is session.state.params["body.0.bias"]


def test_artifacts_of_the_older_format_are_refused_with_what_to_do(exported, tmp_path):
    import json

    _, path = exported
    out = tmp_path / "artifacts"
    assert main(["build-training", str(path), "--loss", "loss", "--trainable-from-initializers",
                 "-o", str(out)]) == 0  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "format": "ortrain.artifacts/1"}))
    with pytest.raises(ArtifactError, match=r"format 'ortrain.artifacts/1'.*build them again"):
        TrainingSession.load(out)
