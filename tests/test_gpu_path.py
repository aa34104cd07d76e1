"""The CUDA path's predicted defects and the distributed code shared with CUDA, rehearsed
on CPU with stand-ins (issue 37); tests/test_cuda_training.py runs the same probes on a GPU.

1. a capturing session's first run executes the graph twice: in-place updates once only;
2. ONNX Runtime's silent fallback to the CPU is caught on a real session, naming the library;
4. capture-time failures get their own error, naming the node, with the state restored;
5. random ops (dropout) under CUDA graphs are refused, naming the nodes;
and data parallel / ZeRO-1 hand their collectives tensors on the trainer's device, each over
the backend for that device, through the same reducer code at any world size.
"""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.distributed as dist

import ortrain.runtime.session as session_mod
from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import BatchError, DeviceError
from ortrain.runtime.session import (
    BoundSession,
    CudaGraphCaptureError,
    capture_error,
    make_session,
    random_nodes,
)
from tests.conftest import gpt2, lm_batches

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------- 1. capture runs twice
class _Binding:
    def __init__(self) -> None:
        self.inputs: dict[str, int] = {}
        self.outputs: dict[str, int] = {}

    def bind_input(self, name, kind, index, dtype, shape, ptr) -> None:
        self.inputs[name] = ptr

    def bind_output(self, name, kind, index=0, dtype=None, shape=None, ptr=None) -> None:
        self.outputs[name] = ptr


class CapturingSession:
    """A stand-in for an ONNX Runtime session created with ``enable_cuda_graph``: its
    graph is ``execute(tensors)`` over the bound tensors (updating them in place as the
    bound outputs would be written), and it runs as ONNX Runtime runs a capturing session
    (InferenceSession::Run): the first run executes the graph ``allocating_runs`` times
    (the CUDA provider's min_num_runs_before_cuda_graph_capture_, 1), then once more while
    capturing (captured work runs when the capture is replayed at its end), all within
    that one call; later runs replay."""

    def __init__(
        self,
        inputs: list[str],
        outputs: list[str],
        execute: Callable[[], None],
        *,
        capture: bool = True,
        fail: Exception | None = None,
        allocating_runs: int = 1,
    ):
        self.allocating_runs = allocating_runs
        self._inputs, self._outputs, self._execute = inputs, outputs, execute
        self.capture, self.fail = capture, fail
        self.runs = 0  # run_with_iobinding calls
        self.executions = 0  # times the graph's work was done on the device
        self.binding = _Binding()

    def io_binding(self) -> _Binding:
        return self.binding

    def get_inputs(self) -> list:
        return [type("Arg", (), {"name": n})() for n in self._inputs]

    def get_outputs(self) -> list:
        return [type("Arg", (), {"name": n})() for n in self._outputs]

    def get_provider_options(self) -> dict:
        return {"CUDAExecutionProvider": {"enable_cuda_graph": "1" if self.capture else "0"}}

    def _run_graph(self) -> None:
        self._execute()
        self.executions += 1

    def run_with_iobinding(self, binding: _Binding) -> None:
        self.runs += 1
        if self.capture and self.runs == 1:
            for _ in range(self.allocating_runs):
                self._run_graph()
            if self.fail is not None:
                raise self.fail
            self._run_graph()  # the captured run, replayed at the end of the capture
        else:
            self._run_graph()


def _update_graph(state: dict[str, torch.Tensor]) -> Callable[[], None]:
    """step += 1; m = 0.9 m + g; p -= 0.1 m; loss = sum(p) (an optimizer update)."""

    def execute() -> None:
        state["step"] += 1
        state["m"].mul_(0.9).add_(state["g"])
        state["p"].sub_(0.1 * state["m"])
        state["loss"].copy_(state["p"].sum())

    return execute


def _bound_update(
    capture: bool = True,
    fail: Exception | None = None,
    watch: bool = True,
    allocating_runs: int = 1,
):
    state = {
        "step": torch.zeros(()),
        "p": torch.tensor([1.0, 2.0, 3.0]),
        "g": torch.tensor([0.5, -1.0, 2.0]),
        "m": torch.zeros(3),
        "loss": torch.zeros(()),
    }
    sess = CapturingSession(
        ["step", "p", "g", "m"],
        ["new:step", "new:p", "new:m", "loss"],
        _update_graph(state),
        capture=capture,
        fail=fail,
        allocating_runs=allocating_runs,
    )
    bound = BoundSession(sess, captures=None if watch else False)  # type: ignore[arg-type]
    bound.bind_inputs({k: state[k] for k in ("step", "p", "g", "m")})
    bound.bind_outputs(
        {"new:step": state["step"], "new:p": state["p"], "new:m": state["m"], "loss": state["loss"]}
    )
    return sess, bound, state


def _reference(steps: int) -> dict[str, torch.Tensor]:
    _, bound, state = _bound_update(capture=False)
    for _ in range(steps):
        bound.run()
    return state


def test_stand_in_shows_the_defect_without_the_fix():
    """What a session that ignored the capture would do: the first step applied twice."""
    sess, bound, state = _bound_update(watch=False)
    bound.run()
    assert float(state["step"]) == 2.0 and sess.executions == 2


@pytest.mark.parametrize("allocating_runs", [1, 2])
@pytest.mark.parametrize("steps", [1, 3])
def test_first_step_of_a_capturing_session_is_applied_once(steps, allocating_runs):
    sess, bound, state = _bound_update(allocating_runs=allocating_runs)
    assert bound.captures and set(bound.written_in_place()) == {"new:step", "new:p", "new:m"}
    for _ in range(steps):
        bound.run()
    ref = _reference(steps)
    assert float(state["step"]) == steps
    for k in ("p", "m", "loss"):
        torch.testing.assert_close(state[k], ref[k], rtol=0, atol=0)
    # first step: allocate + capture (both undone) + one replay; then one replay a step
    assert (sess.runs, sess.executions) == (steps + 1, steps + 1 + allocating_runs)
    assert bound.captured


def test_accumulated_gradients_are_not_doubled():
    """A gradient accumulator (input and output bound to one buffer) takes one micro-step's
    gradient per run, the first included."""
    grad = torch.zeros(4)
    new = torch.tensor([1.0, -2.0, 0.5, 4.0])

    def execute() -> None:
        grad.add_(new)

    sess = CapturingSession(["acc:w"], ["grad:w"], execute)
    bound = BoundSession(sess)  # type: ignore[arg-type]
    bound.bind_inputs({"acc:w": grad})
    bound.bind_outputs({"grad:w": grad})
    bound.run()
    torch.testing.assert_close(grad, new, rtol=0, atol=0)
    bound.run()
    torch.testing.assert_close(grad, 2 * new, rtol=0, atol=0)


def test_views_into_one_flat_buffer_count_as_written_in_place():
    """Distributed/flat layouts bind views: an output overlapping any bound input's memory
    is in place; one that only sits beside it is not."""
    flat = torch.zeros(8)
    sess = CapturingSession(["a", "b"], ["x", "y"], lambda: None)
    bound = BoundSession(sess)  # type: ignore[arg-type]
    bound.bind_inputs({"a": flat[0:4]})
    bound.bind_outputs({"x": flat[2:6], "y": flat[4:8]})
    assert set(bound.written_in_place()) == {"x"}
    bound.mark_written({"b": flat[6:8]})
    assert set(bound.written_in_place()) == {"x", "b"}


def test_a_capturing_session_that_writes_nothing_in_place_runs_once():
    """Outputs only (a gradient graph without accumulation): the first run's outputs are
    the captured replay's, and no extra replay is needed."""
    grad = torch.zeros(3)

    def execute() -> None:
        grad.copy_(torch.tensor([1.0, 2.0, 3.0]))

    sess = CapturingSession(["w"], ["grad:w"], execute)
    bound = BoundSession(sess)  # type: ignore[arg-type]
    bound.bind_inputs({"w": torch.ones(3)})
    bound.bind_outputs({"grad:w": grad})
    bound.run()
    assert (sess.runs, sess.executions, bound.captured) == (1, 2, True)
    bound.run()
    assert (sess.runs, sess.executions) == (2, 3)
    torch.testing.assert_close(grad, torch.tensor([1.0, 2.0, 3.0]), rtol=0, atol=0)


def test_plain_sessions_run_once_per_call():
    sess, bound, _ = _bound_update(capture=False)
    bound.run()
    assert not bound.captures and (sess.runs, sess.executions) == (1, 1)


def test_real_cpu_sessions_are_not_capturing():
    model = _dropout_model(0.0)
    bound = BoundSession(make_session(model, threads=1))
    assert not bound.captures


# ------------------------------------------------------------ 4. capture-time failures
_CAPTURE_FAILURE = RuntimeError(
    "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running MatMul "
    "node. Name:'/attn/MatMul' Status Message: CUDA error cudaErrorStreamCaptureUnsupported:"
    "operation not permitted when stream is capturing"
)


def test_capture_failure_names_capture_and_the_node_and_restores_the_state():
    sess, bound, state = _bound_update(fail=_CAPTURE_FAILURE)
    before = {k: v.clone() for k, v in state.items()}
    with pytest.raises(CudaGraphCaptureError) as info:
        bound.run()
    msg = str(info.value)
    assert "capturing the CUDA graph failed at node '/attn/MatMul' (op MatMul)" in msg
    assert "cuda_graph=False" in msg and "StreamCapture" in msg
    assert sess.executions == 1  # the graph did run once before failing...
    for k in ("step", "p", "m"):  # ...and its in-place writes were undone
        torch.testing.assert_close(state[k], before[k], rtol=0, atol=0)
    assert not isinstance(info.value, BatchError) and isinstance(info.value, DeviceError)


def test_failure_before_the_capture_is_named_as_such():
    err = capture_error(
        RuntimeError(
            "Non-zero status code returned while running Gather node. "
            "Name:'emb' Status Message: indices out of range"
        )
    )
    assert "the run before the capture failed at node 'emb' (op Gather)" in str(err)
    bare = capture_error(RuntimeError(""))
    assert "RuntimeError" in str(bare) and "at node" not in str(bare)


def test_trainer_lets_a_capture_error_through(monkeypatch):
    """The trainer wraps ONNX Runtime's run errors into BatchError; a capture error keeps
    its own type and message."""

    def fail(self: BoundSession) -> None:
        raise capture_error(_CAPTURE_FAILURE)

    model = gpt2(layers=1, hidden=32, vocab=64)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions())
    monkeypatch.setattr(BoundSession, "run", fail)
    with pytest.raises(CudaGraphCaptureError, match="/attn/MatMul"):
        trainer.train_step(**lm_batches(1, vocab=64)[0])


# ------------------------------------------------------------ 5. dropout under capture
def _dropout_model(ratio: float | None, training: bool | None = True, op: str = "Dropout"):
    import onnx_ir as ir
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    inits, inputs = [], ["x"]
    if ratio is not None or training is not None:
        inputs.append("ratio" if ratio is not None else "")
        if ratio is not None:
            inits.append(helper.make_tensor("ratio", TensorProto.FLOAT, [], [ratio]))
    if training is not None:
        inputs.append("training")
        inits.append(helper.make_tensor("training", TensorProto.BOOL, [], [training]))
    if op == "Dropout":
        node = helper.make_node("Dropout", inputs, ["y"], name="drop", seed=3)
    else:
        node = helper.make_node(op, ["x"], ["y"], name="noise", dtype=TensorProto.FLOAT)
    proto = helper.make_model(
        helper.make_graph([node], "g", [x], [y], inits),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    proto.ir_version = 8
    return ir.serde.deserialize_model(proto)


@pytest.mark.parametrize(
    ("ratio", "training", "op", "drawn"),
    [
        (0.1, True, "Dropout", True),
        (0.0, True, "Dropout", False),  # p = 0: the mask is all ones
        (0.1, False, "Dropout", False),  # inference mode
        (None, None, "Dropout", False),  # no training_mode input: inference
        (None, True, "Dropout", True),  # no ratio: 0.5
        (None, None, "RandomUniformLike", True),
    ],
)
def test_random_nodes_are_found(ratio, training, op, drawn):
    model = _dropout_model(ratio, training, op)
    name = "drop" if op == "Dropout" else "noise"
    assert random_nodes(model) == ([(op, name)] if drawn else [])


def test_random_nodes_inside_subgraphs_are_found():
    import onnx_ir as ir
    from onnx import TensorProto, helper

    inner = _dropout_model(0.2).graph
    branch = ir.serde.serialize_graph(inner)
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    node = helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)
    proto = helper.make_model(
        helper.make_graph([node], "g", [cond, x], [y]), opset_imports=[helper.make_opsetid("", 17)]
    )
    found = random_nodes(ir.serde.deserialize_model(proto))
    assert found == [("Dropout", "drop"), ("Dropout", "drop")]


def test_cuda_graph_with_dropout_is_refused_before_any_session(monkeypatch):
    def no_session(*args, **kwargs):
        raise AssertionError("no session may be created")

    monkeypatch.setattr(ort, "InferenceSession", no_session)
    with pytest.raises(DeviceError, match=r"cuda_graph=True: 1 node\(s\) \(Dropout 'drop'\)"):
        make_session(_dropout_model(0.1), threads=1, device=torch.device("cuda"), cuda_graph=True)


def test_cuda_graph_without_random_draws_goes_on_to_the_session(monkeypatch):
    made = []

    def fake(data, so, providers, disabled_optimizers):
        made.append(providers[0][1]["enable_cuda_graph"])
        raise RuntimeError("stop here")

    monkeypatch.setattr(ort, "InferenceSession", fake)
    with pytest.raises(RuntimeError, match="stop here"):
        make_session(_dropout_model(0.0), threads=1, device=torch.device("cuda"), cuda_graph=True)
    assert made == ["1"]


# ----------------------------------------------------- 2. the CUDA provider really loads
@pytest.fixture
def gpu_build_without_cuda(monkeypatch):
    """This machine as a GPU build that lists CUDAExecutionProvider and cannot create it
    (ONNX Runtime's CPU build falls back as a GPU build missing a library does)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    monkeypatch.setattr(session_mod, "_preload_cuda_libraries", lambda: None)
    session_mod.cuda_unavailable_reason.cache_clear()
    yield
    session_mod.cuda_unavailable_reason.cache_clear()


@pytest.mark.skipif(
    (Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so").is_file(),
    reason="an onnxruntime-gpu install: its CUDA provider loads, or names another library",
)
def test_fallback_to_the_cpu_is_caught_on_a_real_session(gpu_build_without_cuda):
    why = session_mod.cuda_unavailable_reason()
    assert why is not None and "fell back to the CPU" in why
    assert "libonnxruntime_providers_cuda.so is not in" in why  # a CPU build: no library
    assert not session_mod.cuda_available()
    with pytest.raises(DeviceError, match=r"device cuda: onnxruntime .* fell back to the CPU"):
        session_mod.check_device(torch.device("cuda"))


def test_a_working_provider_is_accepted(gpu_build_without_cuda, monkeypatch):
    class Session:
        def __init__(self, *args, **kwargs):
            pass

        def get_providers(self):
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    monkeypatch.setattr(ort, "InferenceSession", Session)
    assert session_mod.cuda_unavailable_reason() is None
    session_mod.check_device(torch.device("cuda:0"))


def _library_needing_a_missing_one(tmp: Path) -> Path:
    """A provider library stand-in linked against a library that is then removed."""
    (tmp / "dep.c").write_text("int dep_h6(void) { return 1; }\n")
    (tmp / "prov.c").write_text("int dep_h6(void);\nint prov(void) { return dep_h6(); }\n")
    cc = ["gcc", "-shared", "-fPIC"]
    subprocess.run([*cc, "-o", tmp / "libdep_h6.so.3", tmp / "dep.c"], check=True)
    lib = tmp / "libonnxruntime_providers_cuda.so"
    subprocess.run([*cc, "-o", lib, tmp / "prov.c", tmp / "libdep_h6.so.3"], check=True)
    (tmp / "libdep_h6.so.3").unlink()
    return lib


def test_the_missing_library_is_named(tmp_path):
    lib = _library_needing_a_missing_one(tmp_path)
    said = session_mod._provider_load_failure("", lib)
    assert said.startswith("missing library libdep_h6.so.3 (")
    assert "cannot open shared object file" in said


def test_ort_log_is_the_fallback_reason(tmp_path):
    log = "x\nFailed to create CUDAExecutionProvider: libcublasLt.so.13: cannot open\n"
    said = session_mod._provider_load_failure(log, Path("/nonexistent/libonnxruntime_x.so"))
    assert said.startswith("missing library libcublasLt.so.13")
    assert "libonnxruntime_x.so is not in /nonexistent" in said
    (tmp_path / "ok.c").write_text("int ok(void) { return 0; }\n")
    lib = tmp_path / "libok.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", lib, tmp_path / "ok.c"], check=True)
    loads = session_mod._provider_load_failure(log, lib)  # the loader has no word: the log's
    assert loads == "missing library libcublasLt.so.13 (" + loads.split(" (", 1)[1]
    assert loads.endswith(
        ": Failed to create CUDAExecutionProvider: libcublasLt.so.13: cannot open"
    )
    assert "no reason" in session_mod._provider_load_failure("", lib)


def test_torchs_cuda_libraries_are_found_beside_torch(tmp_path, monkeypatch):
    """onnxruntime-gpu installed with --target elsewhere: torch's nvidia-* libraries are
    preloaded from torch's site-packages."""
    rel = [
        ("nvidia", "cu13", "lib", "libcublasLt.so.13"),
        ("nvidia", "cudnn", "lib", "libcudnn.so.9"),
    ]
    monkeypatch.setattr(ort, "_get_nvidia_dll_paths", lambda *a: rel, raising=False)
    ort_root, torch_root = tmp_path / "target", tmp_path / "site"
    ort_root.mkdir()
    lib = torch_root / "nvidia" / "cu13" / "lib" / "libcublasLt.so.13"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    assert session_mod.torch_cuda_libraries(ort_root, torch_root) == [lib]
    assert session_mod.torch_cuda_libraries(torch_root, torch_root) == []  # same place


# ------------------------------------------- distributed: the device and the backend
def test_backend_follows_the_device():
    from ortrain.distributed.comm import backend_for

    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"


def _routing_comm(world: int, rank: int = 0):
    """A Comm whose two groups are markers, for checking which carries what."""
    from ortrain.distributed.comm import Comm
    from ortrain.distributed.health import RankHealth

    comm = Comm.__new__(Comm)
    comm.timeout_s, comm.device = 1.0, torch.device("cuda", 0)
    comm.global_ranks, comm.rank, comm.world_size = list(range(world)), rank, world
    comm.group, comm.device_group = "gloo-group", "nccl-group"
    comm.health = RankHealth.__new__(RankHealth)
    comm.health.seq = 0
    return comm


def test_device_tensors_go_over_the_device_group(monkeypatch):
    calls = []

    class Work:
        def wait(self) -> None:
            pass

    def record(name):
        def op(*args, group=None, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            calls.append((name, group, [(t.device.type, t.shape[0]) for t in tensors]))
            return Work()

        return op

    for name in ("all_reduce", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, record(name))
    comm = _routing_comm(world=2, rank=1)
    meta = torch.empty(8, device="meta")  # stands in for a CUDA tensor: not host memory
    comm.all_reduce_buckets([meta[:4], meta[4:]])
    comm.reduce_scatter(meta)
    comm.all_gather(meta)
    comm.all_reduce(torch.zeros(1))  # a host flag
    assert calls == [
        ("all_reduce", "nccl-group", [("meta", 4)]),
        ("all_reduce", "nccl-group", [("meta", 4)]),
        # in place: this rank's shard is the output (NCCL's in-place reduce-scatter)
        ("reduce_scatter_tensor", "nccl-group", [("meta", 4), ("meta", 8)]),
        ("all_gather_into_tensor", "nccl-group", [("meta", 8), ("meta", 4)]),
        ("all_reduce", "gloo-group", [("cpu", 1)]),
    ]


def test_reduce_scatter_output_is_this_ranks_shard(monkeypatch):
    seen = {}

    def rs(out, inp, group=None):
        seen["offset"] = out.data_ptr() - inp.data_ptr()

    monkeypatch.setattr(dist, "reduce_scatter_tensor", rs)
    comm = _routing_comm(world=4, rank=2)
    flat = torch.zeros(16)
    comm.group_for = lambda t: "nccl-group"  # type: ignore[method-assign]
    comm.reduce_scatter(flat)
    assert seen["offset"] == 2 * 4 * flat.element_size()


@pytest.mark.parametrize(("zero_stage", "engine"), [(None, "kernels"), (0, "graph"), (1, "zero1")])
def test_auto_update_on_cuda_keeps_the_reducer(monkeypatch, zero_stage, engine):
    """ "auto" on CUDA takes the fused kernels in a single process only: their engine runs
    no reducer, so data parallel would skip its all-reduce and the ranks drift apart."""
    from ortrain.runtime import update_engines

    monkeypatch.setattr(update_engines, "kernels_available", lambda device: True)
    facts = update_engines.EngineFacts(
        requested="auto",
        device=torch.device("cuda", 0),
        kind="adamw",
        zero_stage=zero_stage,
        cpu_kernels=False,
        accumulation=1,
        clipping=False,
        fp32=True,
    )
    assert update_engines.choose_engine(facts) == engine


@pytest.fixture
def world_of_one(tmp_path):
    """torch.distributed with one rank: torchrun's (``--nproc_per_node 1``) where it set
    one up, else a file store here; gloo, plus NCCL for CUDA tensors."""
    started = not dist.is_initialized()
    if started:
        if "RANK" in __import__("os").environ:
            dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        else:
            store = dist.FileStore(str(tmp_path / "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)"
        ),
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", [0, 1])
def test_world_of_one_reducer_on_the_trainers_device(world_of_one, monkeypatch, device, stage):
    """Data parallel and ZeRO-1 through the reducer at world size 1 (one process on one
    device: the collectives run, over gloo on CPU and NCCL on CUDA) train as one process
    without a reducer, and every tensor handed to a collective that moves the model lives
    on the trainer's device.

    Per step: the loss, the gradient norm and every gradient element the update read (a
    reducer that drops or doubles a gradient changes them; AdamW alone would not see a
    doubled gradient: its step is scale-free), then every parameter. Two runs differ by
    reduction-order noise (on CUDA), which AdamW turns into steps of up to lr where the
    gradient is zero in exact arithmetic (the attention key biases): each parameter
    element may also differ by what the two runs' gradient differences can move Adam's
    steps (tests/adam_noise.py), nothing where the gradients differ beyond float noise."""
    import ortrain.program_context as context_mod
    from ortrain.distributed import make_reducer
    from ortrain.distributed.comm import Comm
    from tests.adam_noise import NOISE_FLOOR, AdamDrift, TrainerGradients, assert_params_close

    if device == "cuda" and session_mod.cuda_unavailable_reason() is not None:
        pytest.skip(f"needs ONNX Runtime's CUDA provider: {session_mod.cuda_unavailable_reason()}")
    handed: list[tuple[str, str, torch.dtype]] = []
    for op in ("all_reduce_buckets", "reduce_scatter", "all_gather", "broadcast_tensors"):
        real = getattr(Comm, op)

        def spy(self, tensors, _real=real, _op=op):
            ts = tensors if isinstance(tensors, list | tuple) else [tensors]
            handed.extend((_op, t.device.type, t.dtype) for t in ts)
            return _real(self, tensors)

        monkeypatch.setattr(Comm, op, spy)

    lr, max_norm = 1e-2, 1.0
    base, batches = gpt2(layers=1, hidden=32, vocab=64), lm_batches(4, vocab=64)
    opts = dict(device=device, zero_stage=stage, max_grad_norm=max_norm, update_engine="graph")

    def train(reducer: bool):
        """Per step (loss, gradient norm, the gradients the update read: clipped as it
        clips them), and the parameters at the end."""
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        if reducer:
            monkeypatch.setattr(
                context_mod,
                "join_process_group",
                lambda s, o: make_reducer(s, o, Comm(None, 60.0, s.device)),
            )
        trainer = ORTTrainer(model, opt, TrainerOptions(**opts))
        read, steps = TrainerGradients(trainer), []
        for b in batches:
            loss = trainer.train_step(**b).item()
            norm = trainer.last_grad_norm
            clip = min(1.0, max_norm / (norm + 1e-6))
            grads = {k: g * clip for k, g in read(trainer.grad_params).items()}
            steps.append((loss, norm, grads))
        trainer.sync_to_module()
        return steps, {k: v.detach().cpu() for k, v in model.named_parameters()}

    plain, plain_params = train(reducer=False)
    assert handed == []
    reduced, reduced_params = train(reducer=True)
    drift = AdamDrift(lr)
    for (loss, norm, grads), (loss0, norm0, grads0) in zip(reduced, plain, strict=True):
        np.testing.assert_allclose(loss, loss0, rtol=1e-5, atol=0)
        np.testing.assert_allclose(norm, norm0, rtol=1e-5, atol=0)
        assert grads.keys() == grads0.keys()
        scale = max(g.abs().max().item() for g in grads0.values())
        for name, g in grads.items():
            torch.testing.assert_close(
                g, grads0[name], rtol=1e-5, atol=NOISE_FLOOR * scale, msg=name
            )
        drift.observe(grads0, grads)
    # the last step's update (clipping, ZeRO-1's shard update and gather) too
    assert_params_close(reduced_params, plain_params, rtol=1e-5, atol=1e-6, drift=drift)
    # the model's tensors (float32) on the trainer's device; the ranks' fingerprints
    # (distributed/fingerprint.py: bytes and lengths) are host control messages
    model_ops = {op for op, _, dtype in handed if dtype == torch.float32}
    assert model_ops == (
        {"broadcast_tensors", "all_reduce_buckets"}
        if stage == 0
        else {"broadcast_tensors", "reduce_scatter", "all_gather"}
    )
    assert {where for _, where, dtype in handed if dtype == torch.float32} == {device}
    fingerprints = {w for op, w, dtype in handed if op == "all_gather" and dtype != torch.float32}
    assert fingerprints <= {"cpu"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "device,precision",
    [
        pytest.param("cpu", None, id="cpu"),
        pytest.param(
            "cuda",
            None,
            id="cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)"
            ),
        ),
        pytest.param("cpu", "fp16", id="cpu-fp16"),
    ],
)
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("engine", ["graph", "auto"])
def test_zero2_and_3_world_of_one_train_as_one_process(
    world_of_one, monkeypatch, device, precision, stage, engine
):
    """ZeRO-2 and ZeRO-3 at world size 1 (the collectives run: gloo on CPU, NCCL on CUDA)
    train as one process cut at the same blocks without a reducer: per-step losses and
    the final parameters (AdamW, tied embedding and head), with every model tensor handed
    to a collective on the trainer's device; in fp32, and in fp16 (the segments compute in
    fp16, dynamic loss scaling). Without clipping: its norm is summed in another order
    over a shard, and AdamW turns that noise into steps of up to lr where a gradient is
    zero in exact arithmetic (the 2- and 3-rank tests clip). The shard's update graph
    against the update graph of one process, and ("auto") torch's fused kernels over the
    shard's pieces on CPU (in fp32, each bucket's as it lands, in the backward) against
    torch's over the whole flat buffers."""
    import ortrain.program_context as context_mod
    from ortrain.distributed import make_reducer
    from ortrain.distributed.comm import Comm

    if device == "cuda" and session_mod.cuda_unavailable_reason() is not None:
        pytest.skip(f"needs ONNX Runtime's CUDA provider: {session_mod.cuda_unavailable_reason()}")
    handed: list[tuple[str, str]] = []
    for op in ("start_reduce_to_owners", "start_broadcasts", "all_gather", "broadcast_tensors"):
        real = getattr(Comm, op)

        def spy(self, tensors, *args, _real=real, _op=op):
            ts = tensors if isinstance(tensors, list | tuple) else [tensors]
            ts = [t[0] if isinstance(t, tuple) else t for t in ts]  # (tensor, source rank)
            handed.extend((_op, t.device.type) for t in ts if t.dtype == torch.float32)
            return _real(self, tensors, *args)

        monkeypatch.setattr(Comm, op, spy)

    base, batches = gpt2(layers=2, hidden=32, vocab=64), lm_batches(8, vocab=64)

    def train(reducer: bool):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if reducer:
            monkeypatch.setattr(
                context_mod,
                "join_process_group",
                lambda s, o: make_reducer(s, o, Comm(None, 60.0, s.device)),
            )
        options = TrainerOptions(
            device=device,
            zero_stage=stage if reducer else 0,
            segments="auto" if reducer else "blocks",
            reduce_bucket_mb=0.01,
            # the same kernels both sides (the graph's AdamW and torch's round apart)
            update_engine=engine if reducer or engine == "graph" else "torch",
            mixed_precision=precision,
        )
        trainer = ORTTrainer(model, opt, options)
        if reducer:
            torch_kernels = engine == "auto" and device == "cpu"
            # ZeRO-2/3 in fp32 without clipping: each bucket's stretch updated as it lands
            landing = torch_kernels and precision is None
            want = "zero-backward" if landing else "zero-torch" if torch_kernels else "zero1"
            assert trainer.update_engine.name == want
        losses = [trainer.train_step(**b).item() for b in batches]
        if reducer:  # no whole gradients; under ZeRO-3 no whole parameters between steps
            assert trainer.grads == {}
            if stage == 3:
                assert sum(p.numel() for p in model.parameters()) == 0
        return losses, {k: v.detach().cpu() for k, v in trainer.state_dict()["model"].items()}

    plain, plain_params = train(reducer=False)
    assert handed == []
    reduced, reduced_params = train(reducer=True)
    np.testing.assert_allclose(reduced, plain, rtol=1e-5, atol=0)
    assert reduced_params.keys() == plain_params.keys()
    for name, p in reduced_params.items():
        torch.testing.assert_close(
            p, plain_params[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    ops = {op for op, _ in handed}
    assert "start_reduce_to_owners" in ops and ("start_broadcasts" in ops) == (stage == 3)
    assert {where for _, where in handed} == {device}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_clips_by_the_norm_torch_takes(world_of_one, monkeypatch, stage):
    """The gradient norm ZeRO clips by is the one torch's ``clip_grad_norm_`` takes of the
    same gradients, to float rounding, on tensors of a million elements (world size 1:
    one shard holds them all). One reduction over the whole flat shard was off by over
    1e-4 here, and by more on larger models."""
    import ortrain.program_context as context_mod
    from ortrain.distributed import make_reducer
    from ortrain.distributed.comm import Comm

    torch.manual_seed(0)
    width = 1024
    layers = [torch.nn.Linear(width, width) for _ in range(5)]
    base = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.Tanh())])
    x, y = torch.randn(8, width), torch.randn(8, width)

    ref = copy.deepcopy(base)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    want = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))

    monkeypatch.setattr(
        context_mod,
        "join_process_group",
        lambda s, o: make_reducer(s, o, Comm(None, 60.0, s.device)),
    )
    model = copy.deepcopy(base)
    opts = TrainerOptions(zero_stage=stage, max_grad_norm=1.0, build_progress=False)
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opts,
        loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch["y"]),
    )  # fmt: skip
    trainer.train_step(x, y=y)
    assert trainer.last_grad_norm == pytest.approx(want, rel=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero2_and_3_bucket_variable_lengths(world_of_one, monkeypatch, stage):
    """Masked batches of many lengths under ZeRO-2 and ZeRO-3 (world size 1, gloo) are
    padded to a few bucket lengths, as in one process: losses and parameters equal the
    single process's cut at the same blocks on the same batches, and the segments are
    built per bucket, not per length."""
    import ortrain.program_context as context_mod
    from ortrain.bucketing import bucket_length
    from ortrain.distributed import make_reducer
    from ortrain.distributed.comm import Comm
    from tests.test_bucketing import random_lengths, varlen_batch

    lengths = random_lengths(10, 3, 5, 40, seed=5)
    batches = [varlen_batch(ls, vocab=64, seed=i) for i, ls in enumerate(lengths)]
    base = gpt2(layers=2, hidden=32, vocab=64)

    def train(reducer: bool):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with monkeypatch.context() as patch:
            if reducer:
                patch.setattr(
                    context_mod,
                    "join_process_group",
                    lambda s, o: make_reducer(s, o, Comm(None, 60.0, s.device)),
                )
            options = TrainerOptions(
                zero_stage=stage if reducer else 0,
                segments="auto" if reducer else "blocks",
                reduce_bucket_mb=0.01,
                update_engine="graph",
                # one process builds a new signature at once, as ZeRO's ranks do (alike)
                eager_if_faster=False,
            )
            trainer = ORTTrainer(model, opt, options)
            losses = [trainer.train_step(**b).item() for b in batches]
            state = {k: v.detach().clone() for k, v in trainer.state_dict()["model"].items()}
        return trainer, losses, state

    plain, plain_losses, plain_state = train(reducer=False)
    zero, losses, state = train(reducer=True)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5, atol=0)
    for name, p in state.items():
        torch.testing.assert_close(
            p, plain_state[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    buckets = {bucket_length(max(ls)) for ls in lengths}
    assert len({max(ls) for ls in lengths}) > len(buckets) >= 2
    assert zero.segments is not None and plain.segments is not None
    assert zero.segments.model.builds == plain.segments.model.builds
    calls = {n: len(t) for n, t in zero.segments.model.runners.items()}
    assert calls == {n: len(t) for n, t in plain.segments.model.runners.items()}
    assert calls and max(calls.values()) <= len(buckets), calls  # a graph per bucket at most
    assert set(zero.bucketing.verdicts) and all(v.exact for v in zero.bucketing.verdicts.values())


# ------------------------------------------------ scripts/gpu-checks.sh and its benchmark
def _bench():
    import importlib.util
    import sys

    path = ROOT / "benchmarks" / "bench_gpu.py"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _result(workload: str, backend: str, ms: float, batch: int = 8) -> dict:
    return {
        "workload": workload,
        "backend": backend,
        "batch": batch,
        "seq": 128,
        "ok": True,
        "median_step_s": ms / 1000,
        "tokens_per_s": batch * 128 / (ms / 1000),
        "first_step_s": 1.0,
        "device_used_mib": 100.0,
    }


def test_bench_summary_checks_the_issues_targets():
    bench = _bench()
    runs = [
        _result("w", "torch", 100.0),
        _result("w", "ortrain", 80.0),  # 1.25x: met
        _result("w", "torch-amp-fp16", 50.0),
        _result("w", "ortrain-fp16", 45.0),  # 1.11x: not met
        {"workload": "w", "backend": "torch-compile", "batch": 8, "ok": False, "cut": "cut at 9 s"},
    ]
    largest = [
        {"workload": "w", "backend": "torch", "largest_batch": 64, "exact": True, "stopped": "oom"},
        {
            "workload": "w",
            "backend": "ortrain",
            "largest_batch": 128,
            "exact": False,
            "stopped": "",
        },
    ]
    checks = {c["what"]: c for c in bench.summarize(runs, largest)["checks"]}
    fp32, fp16 = checks["ortrain fp32 vs eager"], checks["ortrain fp16 vs torch AMP fp16"]
    assert (round(fp32["ratio"], 3), fp32["met"]) == (1.25, True)
    assert (round(fp16["ratio"], 3), fp16["met"]) == (1.111, False)
    big = checks["largest batch ortrain fp32 vs eager"]
    assert (big["ratio"], big["met"]) == (2.0, True) and "lower bound" in big["note"]
    meta = {
        "dry_run": False,
        "device_name": "GPU",
        "torch": "t",
        "onnxruntime": "o",
        "steps": 10,
        "warmup": 3,
        "budget_s": 300.0,
        "used_s": 200.0,
    }
    md = bench.markdown(
        {
            "meta": meta,
            "runs": runs,
            "largest": largest,
            "summary": {"checks": list(checks.values())},
        }
    )
    assert "| w | ortrain | 8 | 80.0 | 12800 | 1.25x |" in md
    assert "| w | torch-compile | 8 | | | | | | | | cut at 9 s |" in md
    assert "| w | ortrain fp16 vs torch AMP fp16 | 1.11x | 1.15x | no |" in md


def test_bench_runs_over_their_limit_are_cut_and_later_ones_skipped(tmp_path, monkeypatch):
    bench = _bench()

    def slow(cmd, stdout, stderr, timeout):
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(bench.subprocess, "run", slow)
    args = bench.parse_args(["--dry-run", "--out", str(tmp_path)])
    budget = bench.Budget(total_s=30.0, run_cap_s=12.0)
    cut = bench.run_child(args, budget, "gpt2-dry", "ortrain", 2)
    assert cut["ok"] is False and cut["cut"] == "cut at its limit of 12 s"
    spent = bench.Budget(total_s=3.0, run_cap_s=12.0)
    skipped = bench.run_child(args, spent, "gpt2-dry", "torch", 2)
    assert skipped["skipped"] == "the benchmark's time budget was spent"


def test_largest_batch_doubles_until_out_of_memory(tmp_path, monkeypatch):
    bench = _bench()
    tried = []

    def fake(args, budget, name, backend, batch):
        tried.append(batch)
        ok = batch <= 8
        return {"workload": name, "backend": backend, "batch": batch, "ok": ok, "oom": not ok}

    monkeypatch.setattr(bench, "run_child", fake)
    args = bench.parse_args(["--dry-run", "--out", str(tmp_path), "--max-doublings", "5"])
    found = bench.largest_batch(args, bench.Budget(100, 10), "gpt2-dry", "torch", None)
    assert tried == [2, 4, 8, 16]
    assert (found["largest_batch"], found["exact"]) == (8, True)
    assert found["stopped"] == "out of memory at batch 16"


@pytest.mark.slow
def test_gpu_checks_dry_run_writes_the_summary(tmp_path):
    """scripts/gpu-checks.sh --dry-run: the provider check, the probes, a world-of-one
    reducer case under torchrun and the benchmark on CPU, within budgets, into $OUT. (The
    kernel build and the GPU test files are left to a manual dry run: minutes here.)"""
    import json
    import os

    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        # no batch doublings: test_largest_batch_doubles_until_out_of_memory checks the search;
        # one workload: the plumbing is the same for the other
        "BENCH_ARGS": "--backends torch,ortrain --max-doublings 0 --workloads gpt2-dry",
        "BUDGET_dp": "240",
        # one world-of-one case: the suite runs them all itself; here the plumbing
        "DP_SELECT": "world_of_one_reducer and 1-cpu",
        "BUDGET_probes": "240",
        # the probes' plumbing on one test: the suite runs the others itself
        "PROBES_SELECT": "stand_in_shows_the_defect_without_the_fix",
        "ORTRAIN_GRAPH_CACHE": str(tmp_path / "cache"),
    }
    cmd = ["bash", str(ROOT / "scripts" / "gpu-checks.sh"), "--dry-run", "--total-s", "1200"]
    cmd += ["--steps", "install,provider,probes,dp,bench"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    out = tmp_path / "out"
    summary = json.loads((out / "gpu-checks.json").read_text())
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert status == dict.fromkeys(["install", "provider", "probes", "dp", "bench"], "ok"), (
        done.stdout[-3000:]
    )
    assert done.returncode == 0
    bench = summary["bench"]
    assert bench["meta"]["dry_run"] and {r["backend"] for r in bench["runs"]} == {
        "torch",
        "ortrain",
    }
    assert all(r["ok"] for r in bench["runs"]) and len(bench["largest"]) == 2
    assert {r["workload"] for r in bench["runs"]} == {"gpt2-dry"}
    md = (out / "gpu-checks.md").read_text()
    assert "| dp | ok |" in md and "# GPU benchmark (dry run on CPU: tiny models)" in md
