"""export_forward in a forked child vs in this process (ortrain/export.py)."""

from __future__ import annotations

import collections
import os

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from ortrain.errors import ExportError
from ortrain.export import export_forward
from tests.conftest import bert_batches, bert_mlm

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph)


def _run(model: ir.Model, feeds: dict) -> list[np.ndarray]:
    data = ir.serde.serialize_model(model).SerializeToString()
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return sess.run(None, {v.name: feeds[v.name] for v in model.graph.inputs})


def test_child_export_equals_in_process_export(monkeypatch):
    model = bert_mlm(hidden=64, layers=1)
    batch = bert_batches(1, batch=2, seq=16)[0]
    forks = []
    real_fork = os.fork

    def counting_fork() -> int:
        forks.append(1)
        return real_fork()

    monkeypatch.setattr(os, "fork", counting_fork)
    child = export_forward(model, batch, train=False, with_outputs=True)
    assert forks == [1]
    monkeypatch.setenv("ORTRAIN_EXPORT_IN_PROCESS", "1")
    here = export_forward(model, batch, train=False, with_outputs=True)
    assert forks == [1]
    assert _ops(child.model) == _ops(here.model)
    assert [v.name for v in child.model.graph.inputs] == [v.name for v in here.model.graph.inputs]
    assert (child.io, child.output_names, child.output_keys) == (
        here.io,
        here.output_names,
        here.output_keys,
    )
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    feeds = {n: t.detach().numpy() for n, t in state.items()}
    feeds.update({k: v.numpy() for k, v in batch.items()})
    for a, b in zip(_run(child.model, feeds), _run(here.model, feeds), strict=True):
        np.testing.assert_array_equal(a, b)
    with torch.no_grad():
        want = model.eval()(**batch)
    np.testing.assert_allclose(_run(child.model, feeds)[0], want.loss.numpy(), rtol=1e-5)


class _NoScalarLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)  # not a scalar: export_forward refuses it


def test_child_export_errors_reach_the_caller():
    with pytest.raises(ExportError, match="the loss must be a scalar"):
        export_forward(_NoScalarLoss(), {"x": torch.randn(2, 4)}, train=True)
