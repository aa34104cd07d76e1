"""`ortrain optimize` on an exported BERT-MLM eval graph, and its errors."""

from __future__ import annotations

import collections
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from ortrain.cli import main
from tests.conftest import bert_batches, bert_mlm


@pytest.fixture(scope="module")
def bert_onnx(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("optimize") / "bert_mlm.onnx"
    model = bert_mlm(hidden=64).eval()
    batch = bert_batches(1, batch=2, seq=16)[0]
    del batch["labels"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (),
            str(path),
            kwargs=batch,
            dynamo=True,
            input_names=list(batch),
            output_names=["logits"],
        )
    return path


def _ops(path: Path) -> collections.Counter:
    import onnx

    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


@pytest.mark.slow
def test_optimize_bert_fewer_nodes_fused_ops_same_outputs(bert_onnx, tmp_path, capsys):
    out = tmp_path / "opt.onnx"
    report = tmp_path / "report.json"
    assert main(["optimize", str(bert_onnx), "-o", str(out), "--report", str(report)]) == 0
    before, after = _ops(bert_onnx), _ops(out)
    assert sum(after.values()) < sum(before.values())
    # 2 layers x (attention, FFN) residual LayerNorms; BiasGelu in both FFNs and the MLM head
    assert after["SkipLayerNormalization"] == 4 and after["BiasGelu"] == 3
    assert after["Gelu"] == 0
    printed = capsys.readouterr().out
    assert "fuse_skip_layer_norm" in printed and "outputs match" in printed
    assert report.is_file()
    # Independent check of the outputs on a real batch.
    batch = {
        k: v.numpy()
        for k, v in bert_batches(1, batch=2, seq=16, seed=9)[0].items()
        if k != "labels"
    }
    ref = ort.InferenceSession(str(bert_onnx)).run(None, batch)[0]
    got = ort.InferenceSession(str(out)).run(None, batch)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "content,expected",
    [(None, "no such file"), (b"garbage", "not a readable ONNX model")],
)
def test_optimize_bad_files_give_one_line_errors(tmp_path, content, expected):
    src = tmp_path / "in.onnx"
    if content is not None:
        src.write_bytes(content)
    proc = subprocess.run(
        [sys.executable, "-m", "ortrain.cli", "optimize", str(src), "-o", str(tmp_path / "o.onnx")],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0]
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["missing-folder", "file-as-folder", "read-only-fs", "report"])
def test_optimize_unwritable_output_is_one_line(bert_onnx, tmp_path, where):
    (tmp_path / "a-file").write_text("x")
    out, report = tmp_path / "o.onnx", None
    if where == "missing-folder":
        out = tmp_path / "no" / "such" / "o.onnx"
    elif where == "file-as-folder":
        out = tmp_path / "a-file" / "o.onnx"
    elif where == "read-only-fs":
        out = Path("/proc/ortrain-out.onnx")  # procfs takes no new files, even from root
    else:
        report = tmp_path / "missing" / "report.json"
    cmd = [sys.executable, "-m", "ortrain.cli", "optimize", str(bert_onnx), "-o", str(out)]
    cmd += ["--report", str(report)] if report else []
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ortrain optimize: error:"), proc.stderr
    assert ("report" if report else "output") in lines[0] and "Traceback" not in proc.stderr


def test_optimize_invalid_model(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Relu", ["missing"], ["y"])], "g", [x], [y])
    bad = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    src = tmp_path / "invalid.onnx"
    onnx.save(bad, str(src))
    assert main(["optimize", str(src), "-o", str(tmp_path / "o.onnx")]) == 1


@pytest.fixture(scope="module")
def dynamic_gpt2_onnx(tmp_path_factory) -> Path:
    """GPT-2 exported as users export it: batch and sequence axes symbolic."""
    from tests.conftest import export_dynamic, gpt2

    path = tmp_path_factory.mktemp("optimize") / "gpt2_dynamic.onnx"
    model = gpt2(layers=2, hidden=64, vocab=128).eval()
    ids = torch.randint(0, 128, (2, 16))
    return export_dynamic(
        model,
        lambda m, **b: m(**b, use_cache=False).logits,
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        path,
        "logits",
    )


def _dims(path: Path) -> list[list]:
    import onnx

    graph = onnx.load(str(path)).graph
    return [
        [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*graph.input, *graph.output]
    ]


@pytest.mark.slow
def test_optimize_keeps_symbolic_dims(dynamic_gpt2_onnx, tmp_path, capsys):
    out = tmp_path / "opt.onnx"
    args = ["optimize", str(dynamic_gpt2_onnx), "-o", str(out), "--dim", "seq=24"]
    assert main(args) == 0
    assert "outputs match" in capsys.readouterr().out
    dims = _dims(out)
    assert dims == _dims(dynamic_gpt2_onnx) and isinstance(dims[0][0], str)
    before, after = _ops(dynamic_gpt2_onnx), _ops(out)
    assert sum(after.values()) < sum(before.values()) and after["Gelu"] + after["FastGelu"] == 2
    # The optimized model runs at sizes the check did not use, like the original.
    rng = np.random.default_rng(4)
    for batch, seq in [(1, 7), (3, 40)]:
        feeds = {
            "input_ids": rng.integers(0, 128, (batch, seq)),
            "attention_mask": np.ones((batch, seq), dtype=np.int64),
        }
        ref = ort.InferenceSession(str(dynamic_gpt2_onnx)).run(None, feeds)[0]
        got = ort.InferenceSession(str(out)).run(None, feeds)[0]
        assert got.shape == (batch, seq, 128)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "dim, expected",
    [
        ("sq=16", "no input has a dimension named 'sq'"),
        ("seq=x", "expected NAME=SIZE"),
        ("seq=0", "expected NAME=SIZE"),
    ],
)
def test_optimize_bad_dim_gives_one_line_error(dynamic_gpt2_onnx, tmp_path, dim, expected, capsys):
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(dynamic_gpt2_onnx), "-o", str(out), "--dim", dim]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]
    assert not out.exists()


@pytest.mark.slow
def test_optimize_llama_fuses_rms_norms(tmp_path, capsys):
    """Llama's RMSNorm chains (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul) become
    SimplifiedLayerNormalization, and the residual Add before one SkipSimplified..."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import export_dynamic

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()

    src, out = tmp_path / "llama.onnx", tmp_path / "llama.opt.onnx"
    call = lambda m, **b: m(**b, use_cache=False).logits  # noqa: E731
    export_dynamic(model, call, {"input_ids": torch.randint(0, 96, (2, 8))}, src, "logits")
    assert main(["optimize", str(src), "-o", str(out), "--dim", "seq=12"]) == 0
    before, after = _ops(src), _ops(out)
    # 2 layers x 2 norms + the final one; the second norm of each layer and the final one
    # follow a residual Add.
    assert before["Sqrt"] == 5 and after["Sqrt"] == 0 and after["Pow"] == 0
    assert after["SimplifiedLayerNormalization"] + after["SkipSimplifiedLayerNormalization"] == 5
    assert after["SkipSimplifiedLayerNormalization"] >= 2
    ids = np.random.default_rng(2).integers(0, 96, (3, 20))
    ref = ort.InferenceSession(str(src)).run(None, {"input_ids": ids})[0]
    got = ort.InferenceSession(str(out)).run(None, {"input_ids": ids})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_optimize_blames_a_pass_that_leaves_an_unloadable_model(bert_onnx, tmp_path, monkeypatch):
    """A pass whose output ONNX Runtime rejects (here: a Gemm fed a rank-3 input, as a
    rewrite bug would leave it) is named, and nothing is written."""
    import onnx_ir as ir

    from ortrain import optimize
    from ortrain.optimize import OptimizeError

    def break_a_matmul(model: ir.Model) -> bool:
        node = next(n for n in model.graph if n.op_type == "MatMul" and len(n.inputs[0].shape) == 3)
        node.op_type = "Gemm"
        return True

    real = optimize.passes
    broken = optimize.Pass("broken", break_a_matmul, stage="fusions", test=optimize.TEST)
    monkeypatch.setattr(optimize, "passes", lambda level: [*real(level), broken])
    out = tmp_path / "o.onnx"
    with pytest.raises(OptimizeError, match=r"after pass 'broken': ONNX Runtime cannot run"):
        optimize.optimize_file(bert_onnx, out)
    assert not out.exists()


class _Encoder(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


@pytest.fixture(scope="module", params=[13, 15, 17])
def torchscript_bert(request, tmp_path_factory) -> tuple[int, Path]:
    """BERT-MLM as the TorchScript exporter writes it (its default opset is 17; older
    exports sit at 13-16), with dynamic batch and sequence axes."""
    opset = request.param
    path = tmp_path_factory.mktemp("torchscript") / f"bert{opset}.onnx"
    model = bert_mlm(hidden=64).eval()
    batch = bert_batches(1, batch=2, seq=16)[0]
    dynamic = {"batch": 0, "seq": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _Encoder(model),
            (batch["input_ids"], batch["attention_mask"]),
            str(path),
            dynamo=False,
            opset_version=opset,
            input_names=["input_ids", "attention_mask"],
            output_names=["logits"],
            dynamic_axes={k: {v: n for n, v in dynamic.items()} for k in ("input_ids",
                                                                          "attention_mask")},
        )  # fmt: skip
    return opset, path


@pytest.mark.slow
def test_optimize_fuses_below_opset_20_with_contrib_ops(torchscript_bert, tmp_path, capsys):
    import json

    opset, path = torchscript_bert
    out, report = tmp_path / "opt.onnx", tmp_path / "report.json"
    assert main(["optimize", str(path), "-o", str(out), "--report", str(report)]) == 0
    before, after = _ops(path), _ops(out)
    assert (before["LayerNormalization"] == 6) == (opset >= 17), before  # else decomposed
    # GELU: 2 FFNs and the MLM head, erf chains -> com.microsoft Gelu -> BiasGelu
    assert before["Erf"] == 3 and after["Erf"] == 0, (before, after)
    assert after["BiasGelu"] + after["Gelu"] == 3 and after["BiasGelu"] >= 2, after
    # LayerNorms: decomposed before opset 17, fused into LayerNormalization (ONNX Runtime
    # runs it at any opset) or, with the residual Add, SkipLayerNormalization
    norms = after["LayerNormalization"] + after["SkipLayerNormalization"]
    assert norms == 6 and after["ReduceMean"] == 0, after
    # the embeddings' Add reads a batch-broadcast position table: never a skip input
    assert after["SkipLayerNormalization"] <= 4
    records = {r["name"]: r for r in json.loads(report.read_text())}
    for name, record in records.items():
        if name.startswith("fuse_") and record["nodes_before"] == record["nodes_after"]:
            assert record["note"].startswith(("pattern absent", "match rejected")), record
    assert "found nothing:" in capsys.readouterr().out
    batch = {
        k: v.numpy()
        for k, v in bert_batches(1, batch=3, seq=24, seed=9)[0].items()
        if k in ("input_ids", "attention_mask")
    }
    ref = ort.InferenceSession(str(path)).run(None, batch)[0]
    got = ort.InferenceSession(str(out)).run(None, batch)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
