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
