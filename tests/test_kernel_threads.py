"""Which threads ortrain's CPU kernels run on (``graph_passes/targets/cpu/kernel_threads.py``, the
``omp_team`` attribute in ``ortrain/runtime/kernel_util.h``: ``for_blocks``).

- the graph-level rule on hand-built graphs: kernels of graphs whose products are ONNX
  Runtime's own get ``omp_team = 0``, those of graphs with BLAS products keep the team;
  other nodes untouched; running it twice changes nothing;
- the kernel honours the attribute (the library counts calls run on the team) and its
  results do not depend on it;
- a trainer's serialized graphs follow the rule for both ``cpu_gemm`` choices, and both
  train GPT-2 as eager does.
"""

from __future__ import annotations

import ctypes

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ortrain import TrainerOptions
from ortrain.core.names import BLAS_DOMAIN, CPU_DOMAIN
from ortrain.graph_passes.targets.cpu.kernel_threads import ATTRIBUTE, place_kernel_threads
from ortrain.runtime import cpu_ops
from tests.conftest import gpt2, lm_batches
from tests.test_blas_gemm import _library as _blas_library
from tests.test_forward_kernels import _session, train_against_eager
from tests.test_grad_kernels import _f32, _library


def _team_attr(node: onnx.NodeProto) -> list[int]:
    return [a.i for a in node.attribute if a.name == ATTRIBUTE]


def _graph(blas: bool) -> onnx.GraphProto:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("FastGelu", ["h"], ["g"], domain=CPU_DOMAIN),
        helper.make_node("LayerNorm", ["g", "s"], ["y"], domain=CPU_DOMAIN, epsilon=1e-5),
        helper.make_node("Relu", ["y"], ["r"]),
    ]
    if blas:
        nodes.append(helper.make_node("Gemm", ["r", "w"], ["z"], domain=BLAS_DOMAIN))
    return helper.make_graph(nodes, "g", [], [])


def test_kernels_leave_the_team_where_the_products_are_onnxruntimes() -> None:
    graph = _graph(blas=False)
    assert place_kernel_threads(graph) == 2
    assert [_team_attr(n) for n in graph.node] == [[], [0], [0], []]
    ln = graph.node[2]
    assert [a.name for a in ln.attribute] == ["epsilon", ATTRIBUTE]  # epsilon kept
    assert place_kernel_threads(graph) == 0  # again: nothing to change, one attribute each
    assert [_team_attr(n) for n in graph.node] == [[], [0], [0], []]


def test_kernels_stay_on_the_team_beside_blas_products() -> None:
    graph = _graph(blas=True)
    graph.node[1].attribute.append(helper.make_attribute(ATTRIBUTE, 0))  # a stale setting
    assert place_kernel_threads(graph) == 1  # the stale one, removed
    assert all(_team_attr(n) == [] for n in graph.node)


def _fast_gelu(x: np.ndarray, **attrs: int) -> np.ndarray:
    node = helper.make_node("FastGelu", ["X"], ["Y"], domain=CPU_DOMAIN, **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]
    return _session(helper.make_model(graph, opset_imports=opsets)).run(None, {"X": x})[0]


def test_the_kernel_honours_the_attribute() -> None:
    _library()
    if not cpu_ops.omp_team():
        pytest.skip("the library does not share torch's OpenMP runtime here")
    lib = ctypes.CDLL(_library())
    runs = ctypes.c_long.in_dll(lib, "ortrain_team_runs")
    x = _f32(np.random.default_rng(3), (512, 300))  # several blocks
    before = runs.value
    on_team = _fast_gelu(x)
    assert runs.value == before + 1
    off_team = _fast_gelu(x, omp_team=0)
    assert runs.value == before + 1, "omp_team=0 must keep the blocks off the team"
    np.testing.assert_array_equal(on_team, off_team)
    _fast_gelu(x, omp_team=1)
    assert runs.value == before + 2


@pytest.mark.slow
@pytest.mark.parametrize("gemm", ["onnxruntime", "blas"])
def test_trainer_graphs_follow_their_products(gemm: str) -> None:
    if gemm == "blas":
        _blas_library()  # skips where a prerequisite is missing (no sgemm_ in torch)
    batches = lm_batches(3, batch=8, seq=64)  # products above the cost model's gemm_min_flops
    options = TrainerOptions(cpu_gemm=gemm, cpu_kernels="ortrain")
    # SGD: parameters comparable element-wise after steps (train_against_eager's note)
    trainer = train_against_eager(
        gpt2(layers=2), batches, torch.optim.SGD, options, lr=0.5, momentum=0.9
    )
    graph = onnx.ModelProto.FromString(
        next(iter(trainer._graphs.train.values())).graph.ort_data
    ).graph
    kernels = [n for n in graph.node if n.domain == CPU_DOMAIN]
    assert len(kernels) >= 10  # LayerNorms, GELUs, Softmaxes and their backwards
    blas = sum(n.domain == BLAS_DOMAIN for n in graph.node)
    if gemm == "blas":
        assert blas > 0
        assert all(_team_attr(n) == [] for n in kernels)
    else:
        assert blas == 0
        assert all(_team_attr(n) == [0] for n in kernels)
