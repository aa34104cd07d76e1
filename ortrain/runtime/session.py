"""ONNX Runtime sessions with persistent, zero-copy bindings, on CPU or CUDA.

State tensors are torch tensors; ONNX Runtime reads and writes their memory directly:
IOBinding binds each one by device and data pointer, once. A step rebinds only the
batch. On CUDA the session runs on a torch stream the trainer owns
(``user_compute_stream``), so torch work before and after a run (batch copies, fused
kernels, collectives) is ordered with it without host synchronisation.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import onnxruntime as ort
import torch

from ortrain.core.errors import DeviceError
from ortrain.core.names import BLAS_DOMAIN, CPU_DOMAIN, RANDOM_OPS
from ortrain.runtime import cpu_ops

if TYPE_CHECKING:
    import onnx_ir as ir


class CompiledGraph(Protocol):
    """A graph built and serialized for ONNX Runtime elsewhere (``ortrain/build.py``'s
    ``BuiltGraph``, a segment's ``GraphBytes``): what a session is made from."""

    @property
    def ort_data(self) -> bytes: ...

    recomputes: bool  # holds recomputed copies (ONNX Runtime's CSE must stay off)
    planned_peak_bytes: int
    blas_gemm: bool
    cpu_kernels: bool


# Keep ONNX Runtime from deleting Dropout nodes: training graphs need live masks.
DISABLED_OPTIMIZERS = ["EliminateDropout"]
# Graphs with recomputed copies (graph_passes/memory/recompute.py) also keep ONNX Runtime's CSE
# off: it would merge each copy back into the forward value it stands in for.
RECOMPUTE_DISABLED = ["CommonSubexpressionElimination"]

_TORCH_TO_NP: dict[torch.dtype, Any] = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    # no numpy type: ONNX Runtime takes the ONNX element type's number (TensorProto.BFLOAT16)
    torch.bfloat16: 16,
}


class CudaGraphCaptureError(DeviceError):
    """The first run of a session with ``cuda_graph=True`` (ONNX Runtime runs the graph,
    then captures it) failed; the buffers the graph writes in place were restored."""


_CUDA = "CUDAExecutionProvider"
_PROVIDER_LIBRARY = "libonnxruntime_providers_cuda.so"


def cuda_available() -> bool:
    """Whether a CUDA session really runs on ONNX Runtime's CUDA provider here (a probe
    session is opened once: the provider list of a GPU build names CUDA whether or not
    its libraries load)."""
    return cuda_unavailable_reason() is None


@functools.cache
def cuda_unavailable_reason(device_index: int = 0) -> str | None:
    """None when a tiny session on ``cuda:<device_index>`` runs on CUDAExecutionProvider;
    otherwise why not, naming the library ONNX Runtime could not load where it can."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device on this machine"
    if _CUDA not in ort.get_available_providers():
        return (
            f"this onnxruntime ({ort.__version__}) has no CUDAExecutionProvider; install "
            "ortrain[gpu] (onnxruntime-gpu) instead of onnxruntime"
        )
    _preload_cuda_libraries()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    with _captured_stderr() as log:
        session = ort.InferenceSession(
            _probe_model(),
            opts,
            providers=[(_CUDA, {"device_id": str(device_index)}), "CPUExecutionProvider"],
        )
    if session.get_providers()[0] == _CUDA:
        return None
    return (
        f"onnxruntime {ort.__version__} lists CUDAExecutionProvider but could not create it "
        f"and fell back to the CPU: {_provider_load_failure(log())}"
    )


def _probe_model() -> bytes:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x], [y])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    return proto.SerializeToString()


@contextlib.contextmanager
def _captured_stderr() -> Iterator[Callable[[], str]]:
    """Capture what native code writes to file descriptor 2 (ONNX Runtime's log)."""
    import os
    import sys
    import tempfile

    text = ""
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield lambda: text
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")


_LIBRARY = re.compile(r"(lib[\w.+-]+\.so(?:\.\d+)*)")


def _provider_load_failure(log: str, library: Path | None = None) -> str:
    """What kept ONNX Runtime's CUDA provider from loading: the dynamic loader's word on
    its provider library (which names the first missing dependency), else its own log."""
    library = library or Path(ort.__file__).parent / "capi" / _PROVIDER_LIBRARY
    said = []
    if not library.is_file():
        said.append(f"{library.name} is not in {library.parent} (not an onnxruntime-gpu install)")
    else:
        try:
            ctypes.CDLL(str(library))
        except OSError as exc:
            said.append(str(exc))
    logged = [ln.strip() for ln in log.splitlines() if "CUDA" in ln or ".so" in ln]
    said += logged[:1]
    if not said:
        return "ONNX Runtime gave no reason (run with log_severity_level=0 to see its log)"
    # the first library named that is not ONNX Runtime's own
    missing = [m for m in _LIBRARY.findall(" ".join(said)) if not m.startswith("libonnxruntime")]
    hint = (
        f"missing library {missing[0]} (install the CUDA/cuDNN libraries of the CUDA major "
        "version this onnxruntime-gpu was built for, or import torch built for it first)"
        if missing
        else "the reason"
    )
    return f"{hint}: {'; '.join(said)}"


def check_device(device: torch.device) -> None:
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise DeviceError(f"device {device}: ortrain runs on 'cpu' or 'cuda[:N]'")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {device}: torch sees no CUDA device on this machine")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceError(f"device {device}: only {torch.cuda.device_count()} CUDA devices")
    why = cuda_unavailable_reason(device.index or 0)
    if why is not None:
        raise DeviceError(f"device {device}: {why}")


def torch_cuda_libraries(
    ort_root: Path | None = None, torch_root: Path | None = None
) -> list[Path]:
    """The CUDA/cuDNN libraries of torch's nvidia-* wheels that ``onnxruntime.preload_dlls``
    would look for beside onnxruntime, where onnxruntime sits elsewhere (a wheel installed
    with ``pip install --target``): preload_dlls looks only in its own site-packages."""
    ort_root = ort_root or Path(ort.__file__).resolve().parent.parent
    torch_root = torch_root or Path(torch.__file__).resolve().parent.parent
    if ort_root == torch_root:
        return []
    paths = getattr(ort, "_get_nvidia_dll_paths", None)  # onnxruntime >= 1.21
    if paths is None:
        return []
    try:
        relative = paths(False, True, True)
    except Exception:
        return []
    found = (torch_root.joinpath(*parts) for parts in relative)
    return [p for p in found if p.is_file()]


@functools.cache
def _preload_cuda_libraries() -> None:
    # onnxruntime-gpu finds CUDA/cuDNN through the loader's path; pip-installed ones (the
    # nvidia-* wheels torch brings) are not on it. preload_dlls loads them by path (torch
    # imported first: its copies are reused); torch's own, by path, where onnxruntime was
    # installed apart from torch. A later dlopen by name finds the loaded ones.
    for lib in torch_cuda_libraries():
        try:
            ctypes.CDLL(str(lib))
        except OSError as e:
            warnings.warn(f"loading {lib} failed: {e}", RuntimeWarning, stacklevel=3)
    preload = getattr(ort, "preload_dlls", None)  # onnxruntime >= 1.21
    if preload is None:
        return
    try:
        preload(msvc=False)
    except Exception as e:  # the probe session then reports what is missing
        warnings.warn(f"onnxruntime.preload_dlls failed: {e}", RuntimeWarning, stacklevel=3)


def providers(
    device: torch.device, stream: torch.cuda.Stream | None = None, cuda_graph: bool = False
) -> list:
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    options: dict[str, str] = {"device_id": str(device.index or 0)}
    # ONNX Runtime's CUDA provider runs fp32 GEMMs in TF32 unless told otherwise; torch
    # does not by default. Follow torch's setting so that fp32 means the same in both.
    options["use_tf32"] = "0" if torch.get_float32_matmul_precision() == "highest" else "1"
    if stream is not None:  # torch's default stream is 0, which ORT reads as "none"
        options["user_compute_stream"] = str(stream.cuda_stream)
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


# One CPU arena for all of ortrain's sessions (gradient graphs, update, eval), so that a
# graph per label-row count (graph_passes/training/label_sparsity.py) does not keep an activation
# arena of its own. Sessions opt in one by one: other sessions of the process are
# unaffected.
#
# Its first region is half the planned activation peak of the first graph that asks (the
# gradient graph: memory_plan.planned_peak_bytes). ONNX Runtime's BFC arena starts at
# 1 MiB and adds regions of twice the size: a run spreads over a dozen regions, and a
# large tensor that fits in none of their free chunks (GPT-2 small's 98 MiB logits)
# opens a new one. Regions of p/2, p, 2p hold a run that needs p in the first two
# (GPT-2 small batch 2 x 256: steady peak RSS 2908 -> 2759 MiB; tiny GPT-2/BERT within
# +-6 MiB at batch 8..152). A first region of the whole peak was worse: the run spilled
# into a doubled 2p region (BERT-tiny batch 128: +900 MiB). Pages are touched only when
# used, so the regions cost address space before they cost memory.
_arena_registered = False
_MIB = 1 << 20


def register_cpu_arena(planned_peak_bytes: int = 0) -> None:
    """Create the shared CPU arena, its first region half ``planned_peak_bytes`` (rounded
    up to MiB; ONNX Runtime's default, 1 MiB, when that is smaller). Later calls do
    nothing."""
    global _arena_registered
    if _arena_registered:
        return
    cfg: dict[str, int] = {}
    first = -(-planned_peak_bytes // (2 * _MIB)) * _MIB
    if first > _MIB:
        cfg["initial_chunk_size_bytes"] = first
    info = ort.OrtMemoryInfo(
        "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
    )
    with contextlib.suppress(Exception):  # one registered already: use that one
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(cfg))
    _arena_registered = True


def make_session(
    model: ir.Model | CompiledGraph,
    *,
    threads: int | None,
    save_path: str | None = None,
    device: torch.device | None = None,
    stream: torch.cuda.Stream | None = None,
    cuda_graph: bool = False,
) -> ort.InferenceSession:
    device = device or torch.device("cpu")
    if cuda_graph and device.type == "cuda":
        built = getattr(model, "random_ops", None)  # a built graph says so (no graph library)
        refuse_random_nodes(list(built) if built is not None else random_nodes(model))
    arena_bytes = 0
    if hasattr(model, "ort_data"):  # built apart (ortrain/build.py, segments): ordered already
        data, recomputes = model.ort_data, model.recomputes
        arena_bytes, blas, kernels = model.planned_peak_bytes, model.blas_gemm, model.cpu_kernels
        wrong = tuple(getattr(model, "wrong_optimizers", ()))
    else:  # an onnx_ir model made in this process (an update graph)
        from ortrain.graph_passes.infra.serialize import serialize_for_ort

        data, recomputes = serialize_for_ort(model)
        wrong = optimizers_to_disable(model)
        blas = BLAS_DOMAIN in model.opset_imports
        kernels = CPU_DOMAIN in model.opset_imports
    if save_path is not None:
        with open(save_path, "wb") as f:
            f.write(data)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    # A memory pattern planned on the first run is re-allocated on the second and the
    # first run's blocks are kept: ~25% more peak RSS and a slow second step.
    so.enable_mem_pattern = False
    # Two sessions (gradient, update) alternate every step; spinning idle threads of one
    # would steal the cores from the other.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads is not None:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if blas:  # ortrain.blas.Gemm nodes (graph_passes/targets/cpu/blas_gemm.py)
        so.register_custom_ops_library(str(cpu_ops.blas_library_path()))
    elif kernels:  # ortrain.cpu fused backward kernels (rules/nn.py)
        so.register_custom_ops_library(str(cpu_ops.library_path()))
    if device.type == "cpu":
        register_cpu_arena(arena_bytes)
        so.add_session_config_entry("session.use_env_allocators", "1")
    else:
        so.add_session_config_entry(_RECORD_ASSIGNMENT, "1")
    disabled = [*DISABLED_OPTIMIZERS, *wrong, *(RECOMPUTE_DISABLED if recomputes else [])]

    def new(capture: bool) -> ort.InferenceSession:
        return ort.InferenceSession(
            data, so, providers=providers(device, stream, capture), disabled_optimizers=disabled
        )

    if device.type == "cpu":
        return new(False)
    try:
        session = new(cuda_graph)
    except Exception as exc:
        if not cuda_graph or "graph capture" not in str(exc):
            raise
        off = nodes_not_on(new(False), _CUDA)
        raise DeviceError(
            "cuda_graph=True: ONNX Runtime captures a CUDA graph only when every node runs "
            f"on CUDA, and {_describe(off) or 'some nodes'} run on the CPU (its CUDA provider "
            "has no kernel for them); train with cuda_graph=False"
        ) from exc
    off = nodes_not_on(session, _CUDA)
    if off:
        warnings.warn(
            f"{_describe(off)} run on the CPU under ONNX Runtime's CUDA provider (no CUDA "
            "kernel): each step copies their inputs between the GPU and the host",
            RuntimeWarning,
            stacklevel=2,
        )
    return session


_RECORD_ASSIGNMENT = "session.record_ep_graph_assignment_info"

# RANDOM_OPS (ortrain.core.names): ONNX Runtime's CUDA kernels take their Philox seed and
# offset from a generator on the host as kernel arguments: a captured CUDA graph replays
# the first step's arguments, so every replay draws the same numbers.


def random_nodes(model: ir.Model) -> list[tuple[str, str]]:
    """(op type, node name) of the nodes that draw random numbers when run, subgraphs
    included. A Dropout whose ratio is a constant 0 or whose training_mode is a constant
    False draws nothing and is left out."""
    import onnx_ir as ir

    def const(node: ir.Node, i: int) -> float | None:
        v = node.inputs[i] if i < len(node.inputs) else None
        t = ir.convenience.get_const_tensor(v) if v is not None else None
        return None if t is None or t.size != 1 else float(t.numpy().reshape(-1)[0])

    found = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type not in RANDOM_OPS:
            continue
        if node.op_type == "Dropout":
            # absent ratio: 0.5; absent training_mode: inference (no draw)
            ratio = const(node, 1) if len(node.inputs) > 1 and node.inputs[1] else 0.5
            training = const(node, 2) if len(node.inputs) > 2 and node.inputs[2] else 0.0
            if ratio == 0.0 or training == 0.0:
                continue
        found.append((node.op_type, node.name or ""))
    return found


def optimizers_to_disable(model: ir.Model) -> tuple[str, ...]:
    """ONNX Runtime graph optimizers that would compute this graph wrongly, besides
    ``DISABLED_OPTIMIZERS``:

    - MatmulTransposeFusion folds a Transpose into a MatMul whose other operand is 1-D,
      and the CPU FusedMatMul then ignores ``transA`` (``W.T @ v`` computed as ``W @ v``;
      ortrain's own fuse_matmul_transpose leaves those alone);
    - ConstantSharing merges equal constants, and a training-mode BatchNormalization
      (``graph_passes/targets/cpu/batch_norm_training.py``) writes its running statistics
      into its mean and variance inputs: with ``affine=False`` its bias (zeros) and its
      mean placeholder (zeros) became one buffer, overwritten by the statistics."""
    import onnx_ir as ir

    found: list[str] = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type == "MatMul" and any(
            v is not None and v.shape is not None and len(v.shape) == 1 for v in node.inputs
        ):
            found.append("MatmulTransposeFusion")
        attr = node.attributes.get("training_mode")
        if node.op_type == "BatchNormalization" and attr is not None and attr.value:
            found.append("ConstantSharing")
    return tuple(dict.fromkeys(found))


def refuse_random_nodes(nodes: list[tuple[str, str]]) -> None:
    """``cuda_graph=True`` would freeze the random draws (dropout masks) at the captured
    first step's: refuse a graph that has any (``random_nodes``), naming them."""
    if nodes:
        raise DeviceError(
            f"cuda_graph=True: {_describe(nodes)} draw random numbers; a CUDA graph replays "
            "the seeds captured at the first step, so every step would draw the same dropout "
            "masks. Set the model's dropout probabilities to 0 (e.g. hidden_dropout_prob=0.0, "
            "attention_probs_dropout_prob=0.0) or train with cuda_graph=False"
        )


def nodes_not_on(session: ort.InferenceSession, provider: str) -> list[tuple[str, str]]:
    """(op type, node name) of the nodes ONNX Runtime assigned to a provider other than
    ``provider`` (sessions created with ``session.record_ep_graph_assignment_info``);
    empty where this onnxruntime cannot say (older than 1.31)."""
    get = getattr(session, "get_provider_graph_assignment_info", None)
    if get is None:
        return []
    try:
        subgraphs = get()
    except Exception:  # recording off, or not implemented by this build
        return []
    return [
        (n.op_type, n.name) for sg in subgraphs if sg.ep_name != provider for n in sg.get_nodes()
    ]


def _describe(nodes: list[tuple[str, str]], limit: int = 5) -> str:
    shown = ", ".join(f"{op} '{name}'" for op, name in nodes[:limit])
    more = f" and {len(nodes) - limit} more" if len(nodes) > limit else ""
    return f"{len(nodes)} node(s) ({shown}{more})" if nodes else ""


def _where(t: torch.Tensor) -> tuple[str, int]:
    if t.device.type == "cuda":
        return "cuda", t.device.index or 0
    return "cpu", 0


_SPARE: dict[torch.device, torch.Tensor] = {}


def _address(t: torch.Tensor) -> int:
    """``t``'s data pointer to bind. A tensor of no elements may have none (0), which ONNX
    Runtime refuses for an output ("Pointer to data memory is not valid"): a zero-size
    parameter's gradient, a cluster of no classes. Nothing is read or written through
    it, so any live address on its device does."""
    ptr = t.data_ptr()
    if ptr or t.numel():
        return ptr
    spare = _SPARE.get(t.device)
    if spare is None:
        spare = _SPARE[t.device] = torch.empty(64, dtype=torch.uint8, device=t.device)
    return spare.data_ptr()


def captures_cuda_graph(session: ort.InferenceSession) -> bool:
    """Whether ``session`` was created with ONNX Runtime's ``enable_cuda_graph``."""
    get = getattr(session, "get_provider_options", None)
    try:
        options = get() if get is not None else {}
    except Exception:
        return False
    return str(options.get(_CUDA, {}).get("enable_cuda_graph", "0")).lower() in ("1", "true")


# What ONNX Runtime's messages say when CUDA graph capture itself failed (not a node).
_CAPTURE_WORDS = re.compile(
    r"captur|cudaGraph|cudaStream(Begin|End)Capture|cudaErrorStreamCapture", re.IGNORECASE
)
_NODE = re.compile(r"running (\w+) node\. Name:'([^']*)'")


def capture_error(exc: Exception) -> CudaGraphCaptureError:
    """The error of a failed first run of a capturing session, naming the node and op
    where ONNX Runtime's message does."""
    text = str(exc).strip()
    node = _NODE.search(text)
    where = f" at node '{node.group(2)}' (op {node.group(1)})" if node else ""
    what = (
        "capturing the CUDA graph failed"
        if _CAPTURE_WORDS.search(text)
        else "the run before the capture failed"
    )
    first = text.splitlines()[0] if text else type(exc).__name__
    return CudaGraphCaptureError(
        f"cuda_graph=True: the first run of this session (ONNX Runtime runs the graph, then "
        f"captures it as a CUDA graph) failed: {what}{where}. Parameters, optimizer state and "
        f"accumulated gradients are as before the step. Train with cuda_graph=False to run "
        f"without capture. ONNX Runtime said: {first}"
    )


class UnbindableError(TypeError):
    """A tensor ONNX Runtime cannot take: its graph cannot run."""


# the real types a complex tensor's real view has, as ONNX Runtime names them
_REAL_VIEW_TYPE = {torch.complex64: "tensor(float)", torch.complex128: "tensor(double)"}


class BoundSession:
    """A session plus an IOBinding whose persistent inputs/outputs are bound once.

    A session that captures a CUDA graph (``enable_cuda_graph``) is run once more on its
    first ``run``: ONNX Runtime's first run executes the graph N + 1 times within that
    call (InferenceSession::Run: N plain runs to allocate, N = 1 for the CUDA provider,
    then the capture, replayed at its end), so every buffer the graph writes in place (an
    output bound to an input's memory: parameters, moments, the step counter, gradient
    accumulators) would take N + 1 updates. Those buffers are saved before the first run
    and put back after it; a second run replays the captured graph once.
    """

    def __init__(self, session: ort.InferenceSession, *, captures: bool | None = None):
        self.session = session
        self.binding = session.io_binding()
        self.input_names = {i.name for i in session.get_inputs()}
        self.output_names = [o.name for o in session.get_outputs()]
        # the tensors whose memory is bound, kept alive by name: binding a name again (a
        # segment's outputs, allocated per call) lets the one it replaces go
        self.bound_inputs: dict[str, torch.Tensor] = {}  # persistent inputs, for inspection
        self.bound_outputs: dict[str, torch.Tensor] = {}
        self.captures = captures_cuda_graph(session) if captures is None else captures
        self.captured = False
        self._written: dict[str, torch.Tensor] = {}  # written in place beside the aliases

    def _complex_as_real(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A complex ``t`` as its real view (the same memory, a last dimension of 2) where
        the graph's input is that view, the form the exporter gives a complex value (a
        rotary table kept as complex64); else ``t`` (``_check`` refuses a complex one)."""
        if not t.is_complex():
            return t
        kind, shape = next((i.type, i.shape) for i in self.session.get_inputs() if i.name == name)
        real = torch.view_as_real(t)
        same = len(shape) == real.dim() and all(
            d == n for d, n in zip(shape, real.shape, strict=True) if isinstance(d, int)
        )
        return real if kind == _REAL_VIEW_TYPE.get(t.dtype) and same else t

    @staticmethod
    def _check(name: str, t: torch.Tensor) -> None:
        if not t.is_contiguous():
            raise ValueError(f"'{name}': tensors bound to ONNX Runtime must be contiguous")
        if t.dtype not in _TORCH_TO_NP:
            raise UnbindableError(f"'{name}': dtype {t.dtype} cannot be bound to ONNX Runtime")

    def bind_inputs(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name in self.input_names:
                t = self._complex_as_real(name, t)
                self.bound_inputs[name] = t
                self.bind_batch(name, t)

    def bind_outputs(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self._check(name, t)
            self.bound_outputs[name] = t
            kind, index = _where(t)
            self.binding.bind_output(
                name, kind, index, _TORCH_TO_NP[t.dtype], list(t.shape), _address(t)
            )

    def release_outputs(self) -> None:
        """Unbind the outputs and let their tensors go (a segment's, allocated per call and
        handed on: the session must not keep them alive until its next call)."""
        self.binding.clear_binding_outputs()
        self.bound_outputs.clear()

    def mark_written(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Bound inputs the graph writes in place without an output bound to them (custom
        kernels that update their input)."""
        self._written.update(tensors)

    def written_in_place(self) -> dict[str, torch.Tensor]:
        """The bound tensors a run changes that it also reads: each output whose memory
        overlaps a bound input's, and those ``mark_written`` named."""
        spans = [_span(t) for t in self.bound_inputs.values()]
        out = {
            name: t
            for name, t in self.bound_outputs.items()
            if any(_overlap(_span(t), s) for s in spans)
        }
        return {**out, **self._written}

    def bind_batch(self, name: str, t: torch.Tensor) -> None:
        """Bind a tensor by pointer (no copy); the caller keeps ``t`` alive for the run (a
        complex one as its real view, the same memory)."""
        t = self._complex_as_real(name, t)
        self._check(name, t)
        kind, index = _where(t)
        self.binding.bind_input(
            name, kind, index, _TORCH_TO_NP[t.dtype], list(t.shape), _address(t)
        )

    def bind_output_to_cpu(self, name: str) -> None:
        self.binding.bind_output(name, "cpu")

    def run(self) -> None:
        if not self.captures or self.captured:
            self.session.run_with_iobinding(self.binding)
            return
        written = list(self.written_in_place().values())
        if not written:  # nothing read back: the first run's outputs are the replay's
            self._first_run([], [])
            self.captured = True
            return
        saved = [t.detach().to("cpu", copy=True) for t in written]  # host: no device peak
        self._first_run(written, saved)
        _restore(written, saved)
        self.captured = True
        self.session.run_with_iobinding(self.binding)  # the replay: one update

    def _first_run(self, written: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
        """ONNX Runtime's first run of a capturing session: it runs, captures, replays."""
        try:
            self.session.run_with_iobinding(self.binding)
        except Exception as exc:
            _restore(written, saved)
            raise capture_error(exc) from exc


def _span(t: torch.Tensor) -> tuple[str, int, int]:
    start = t.data_ptr()
    return (str(t.device), start, start + t.numel() * t.element_size())


def _overlap(a: tuple[str, int, int], b: tuple[str, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _restore(tensors: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    for t, s in zip(tensors, saved, strict=True):
        t.copy_(s)
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for d in devices:  # ONNX Runtime's stream may not be torch's current one
        torch.cuda.current_stream(d).synchronize()
