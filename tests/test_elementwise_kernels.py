"""``ortrain.cpu.Mul`` / ``Add`` / ``Sub`` / ``Sum`` (``ortrain/runtime/elementwise_kernels.c``)
and the ``cpu_elementwise`` pass.

- the kernels against numpy's float32 arithmetic, bit for bit: every broadcast pattern of
  a Llama block (rows by a per-row scale, a row vector, a [1, 1, S, D] table, scalars),
  both operand orders, ranks 0-4, empty tensors; Sum of 2-8 inputs; errors;
- the pass on a hand-built graph (what moves, what stays, outputs unchanged) and a Llama
  trained against eager with it.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.targets.cpu.cost_model import COST_ENV, CpuCostModel
from ortrain.graph_passes.targets.cpu.elementwise import lower_elementwise
from tests.conftest import lm_batches
from tests.test_forward_kernels import _run, _same_outputs, train_against_eager
from tests.test_grad_kernels import _f32, _library

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
NUMPY = {"Mul": np.multiply, "Add": np.add, "Sub": np.subtract}

PAIRS = [
    ((8, 128, 256), (8, 128, 256)),  # same shape, several blocks
    ((8, 128, 256), (8, 128, 1)),  # a per-row scale (RMSNorm)
    ((8, 128, 256), (256,)),  # a row vector (a norm's weight)
    ((8, 4, 128, 64), (1, 1, 128, 64)),  # a rotary table
    ((8, 4, 128, 64), ()),  # a scalar
    ((3, 1, 5), (1, 4, 1)),  # both broadcast
    ((7,), (7,)),
    ((), ()),
    ((0, 5), (1, 5)),  # empty
]


@pytest.mark.parametrize("swap", [False, True], ids=["ab", "ba"])
@pytest.mark.parametrize("pair", PAIRS, ids=str)
@pytest.mark.parametrize("op", sorted(NUMPY))
def test_binary_matches_numpy(op: str, pair: tuple, swap: bool) -> None:
    rng = np.random.default_rng(len(pair[0]) + 3 * len(pair[1]))
    a, b = (np.asarray(_f32(rng, s)) for s in (pair[::-1] if swap else pair))
    (got,) = _run(op, {"A": a, "B": b}, ["Y"])
    want = NUMPY[op](a, b)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("parts", [2, 3, 8])
def test_sum_matches_numpy(parts: int) -> None:
    rng = np.random.default_rng(parts)
    xs = {f"x{i}": _f32(rng, (4, 3, 9000)) for i in range(parts)}
    (got,) = _run("Sum", xs, ["Y"])
    want = xs["x0"] + xs["x1"]
    for i in range(2, parts):
        want = want + xs[f"x{i}"]  # left to right, as the kernel adds them
    np.testing.assert_array_equal(got, want)


def test_errors_name_the_op_and_shapes() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(Exception, match=r"ortrain.cpu.Mul: A \[4, 5\] and B \[3, 5\] do not"):
        _run("Mul", {"A": _f32(rng, (4, 5)), "B": _f32(rng, (3, 5))}, ["Y"])
    with pytest.raises(Exception, match=r"ortrain.cpu.Sum: an input is \[4, 6\] but input 0"):
        _run("Sum", {"a": _f32(rng, (4, 5)), "b": _f32(rng, (4, 6))}, ["Y"])


# --------------------------------------------------------------------------- the pass
def test_pass_moves_large_fp32_arithmetic() -> None:
    mk = helper.make_node
    big, small = [8, 64, 128], [4, 8]  # 65536 elements (the default threshold) and 32
    nodes = [
        mk("Mul", ["x", "scale"], ["m"]),  # per-row scale: moves
        mk("Add", ["m", "w"], ["a"]),  # row vector: moves
        mk("Sub", ["a", "x"], ["s"]),  # moves
        mk("Sum", ["s", "x", "m"], ["t"]),  # moves
        mk("Mul", ["xs", "xs"], ["ms"]),  # small: stays
        mk("Add", ["i", "i"], ["ai"]),  # int64: stays
        mk("Mul", ["x", "dyn"], ["md"]),  # an operand of unknown shape: stays
        mk("Sum", ["x", "w"], ["tb"]),  # a broadcasting Sum: stays
    ]
    inputs = [
        helper.make_tensor_value_info("x", F32, big),
        helper.make_tensor_value_info("scale", F32, [8, 64, 1]),
        helper.make_tensor_value_info("w", F32, [128]),
        helper.make_tensor_value_info("xs", F32, small),
        helper.make_tensor_value_info("i", I64, big),
        helper.make_tensor_value_info("dyn", F32, ["n", 128]),
    ]
    names = ["t", "ms", "ai", "md", "tb"]
    outputs = [helper.make_tensor_value_info(n, I64 if n == "ai" else F32, None) for n in names]
    proto = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs), opset_imports=[helper.make_opsetid("", 18)]
    )
    proto = onnx.shape_inference.infer_shapes(proto)
    model = ir.serde.deserialize_model(proto)
    assert 8 * 64 * 128 == CpuCostModel.for_machine().elementwise_min_elements
    assert lower_elementwise(model) == 4
    moved = [n.outputs[0].name for n in model.graph if n.domain == CPU_DOMAIN]
    assert moved == ["m", "a", "s", "t"]
    rng = np.random.default_rng(1)
    feeds = {
        "x": _f32(rng, tuple(big)), "scale": _f32(rng, (8, 64, 1)), "w": _f32(rng, (128,)),
        "xs": _f32(rng, tuple(small)), "i": np.arange(65536, dtype=np.int64).reshape(big),
        "dyn": _f32(rng, (64, 128)),
    }  # fmt: skip
    _same_outputs(proto, model, feeds)


@pytest.mark.slow
def test_llama_trains_like_eager_on_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    _library()
    monkeypatch.setenv(COST_ENV, "elementwise_min_elements=1024")  # the forked build reads it
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager",
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    batches = lm_batches(3, batch=8, seq=32, vocab=128)
    trainer = train_against_eager(model, batches, torch.optim.SGD, lr=0.5, momentum=0.9)
    ops = [(n.domain, n.op_type) for n in trainer.train_graphs[0].graph]
    moved = sum(d == CPU_DOMAIN and t in ("Mul", "Add", "Sub", "Sum") for d, t in ops)
    assert moved >= 20, f"only {moved} of the Llama's element-wise ops moved"
