"""User-facing options of ORTTrainer."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import sys
import types
import typing
from typing import Any

import torch

from ortrain.loss_scaler import DynamicLossScale


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """How ORTTrainer builds and runs the training graph.

    One entry per field, in the form ``name: meaning``; ``python -m ortrain.options_doc
    --write`` puts them into the tables of docs/options.md (``tests/test_options_doc.py``
    fails when the page is stale or a field has no entry).

    device: "cpu", "cuda" or "cuda:N": where the graphs run; the module is moved there.
        CUDA needs onnxruntime-gpu (``pip install ortrain[gpu]``); "cuda" is the current
        device (``torch.cuda.set_device``).
    cuda_graph: CUDA only: capture each session once and replay it (ONNX Runtime's
        ``enable_cuda_graph``; static shapes, batches copied into fixed buffers); graphs
        with dropout or other random ops are refused.
    update_engine: what runs the optimizer update. "graph": the update ONNX graph;
        "kernels": the fused kernels of ``cuda_kernels/`` (AdamW / Adam / LAMB; built by
        CMake); "torch": torch's fused Adam/AdamW kernels (those of ``AdamW(fused=True)``)
        over the module's own parameter tensors and flat gradient / moment buffers;
        "backward": each parameter's Adam/AdamW update inside the gradient graph right
        after its gradient is made (CPU, one process, fp32, no accumulation, clipping or
        loss scaling): no gradient buffers at all (a gradient dies at its update, which
        lowers the peak), and ``trainer.grads`` stays empty; under ZeRO-2 and ZeRO-3 (CPU,
        Adam/AdamW, fp32, no accumulation or clipping) each gradient bucket's stretch of
        the rank's shard is updated with torch's kernels as its reduce lands ("zero-backward",
        from the second step on): the gradient shard is not kept. "auto": "backward" where
        it applies, else on CUDA the kernels when built, on CPU torch's kernels for
        Adam/AdamW in a single process and over each rank's shard under ZeRO, the graph
        otherwise. An optimizer whose update ortrain does not compile (another class than
        AdamW, Adam, SGD or Lamb, a subclass with its own ``step()``, ``amsgrad`` or
        ``maximize``) runs its own ``step()`` in eager PyTorch over ortrain's gradients
        (``EagerUpdate``; one warning says so), under "auto" only; ZeRO refuses it (data
        parallel runs it).
    grad_accumulation_steps: micro-steps per update; gradients are averaged, so N
        micro-batches of size b train like one batch of N·b. A micro-batch that fails in
        ONNX Runtime (``BatchError``) or gives a NaN/Inf loss ends its window: the window
        starts over without the good micro-batches before it, and the error says how many
        it discarded.
    max_grad_norm: global L2 clipping with ``torch.nn.utils.clip_grad_norm_`` semantics;
        None: off; ``math.inf``: no clipping, but ``trainer.last_grad_norm`` is still
        reported.
    seed: seeds the graph's dropout masks: same seed, same run.
    intra_op_threads: ONNX Runtime threads per session (None: ONNX Runtime's default). On
        CPU the BLAS products and ortrain's kernels run on torch's OpenMP threads instead
        (``torch.set_num_threads``), as eager torch's would.
    save_graphs_dir: write the ONNX graph after each build pass there, numbered in pass
        order (open it in Netron).
    check_finite: a NaN/Inf loss raises ``NonFiniteLossError`` and the update is not
        applied.
    zero_stage: with ``torch.distributed`` initialised (torchrun): 0 = data parallel
        (every rank holds the whole state; gradients are averaged), 1 = ZeRO-1 (each rank
        keeps and updates only its shard of the optimizer state), 2 = ZeRO-2 (also
        gradients: the model trains as segments cut at its repeated blocks, each
        block's gradients are reduced while the backward runs on, and a rank keeps only
        its shard of them; ``ortrain/distributed/sharded_grads.py``), 3 = ZeRO-3 (also
        parameters: each rank keeps 1/N of them, a segment's are gathered for its forward
        and again for its backward and dropped after; those eager code reads stay whole
        on every rank, said in a warning; the others are empty placeholders between steps, and
        ``state_dict()``, checkpoints and ``eval_step`` gather them all for their
        duration; ``sharded_params.py``). Ignored in a single process.
    reduce_bucket_mb: the size of a gradient bucket in MiB: data parallel all-reduces
        its gradients in buckets of this size, ZeRO-2 reduces each bucket as soon as
        the backward has produced its gradients (a rank holds the buckets in flight,
        not whole gradients).
    process_group: the ``torch.distributed`` group to train over (None: the default
        group).
    dist_timeout: seconds a collective waits for the other ranks before
        ``RankFailureError`` names the rank that died or hangs.
    broadcast_buffers: with ``torch.distributed``: after each optimizer update, rank 0's
        buffers (BatchNorm's running statistics, anything a forward writes into a buffer)
        go to every rank, as ``DistributedDataParallel(broadcast_buffers=True)`` gives
        them to its next forward: the ranks' next forwards, evaluations and checkpoints
        see rank 0's. False: each rank keeps the buffers its own batches made (DDP's
        ``broadcast_buffers=False``).
    mixed_precision: "fp16" or "bf16": the graphs compute in half precision from copies
        of the fp32 master weights; the op lists are in
        ``graph_passes/precision/mixed_precision.py``. bf16 needs CUDA (the CPU execution
        provider has no bf16 kernels). None: fp32.
    loss_scale: "dynamic" (or a ``DynamicLossScale(initial, window, factor, min_scale,
        hysteresis)``), a fixed float, or None. "auto": dynamic with fp16, none otherwise.
        Steps whose gradients overflow are skipped bit-identically
        (``trainer.skipped_steps``, ``trainer.loss_scale``).
    optimize_graph: the optimization passes (constant folding, CSE, GELU / LayerNorm /
        FusedMatMul / Gemm / BiasGelu fusions, label sparsity, backward cleanup); False
        builds the plain gradient graph, to compare or to debug a pass.
    memory_plan: recompute cheap forward values (casts, reshapes, activations, LayerNorm)
        and attention probabilities in the backward instead of keeping them alive;
        ``trainer.memory_report()`` shows what is kept.
    cpu_gemm: what runs the fp32 matrix products of CPU graphs: "onnxruntime" (MLAS),
        "blas" (``ortrain.blas.Gemm`` / ``BatchMatMul``, custom ops on the BLAS torch
        loaded: MKL on x86). "auto": "blas" on Intel CPUs when torch has MKL, MLAS
        elsewhere (MLAS measured the faster on AMD EPYC).
    cpu_kernels: what runs the fp32 GELU, LayerNorm and Softmax backwards, the masked and
        loss Softmaxes, the embedding gradients, the forward LayerNorms and GELUs and large
        element-wise ops of CPU graphs: "ortrain" (fused kernels, ``ortrain.cpu`` domain),
        "onnxruntime" (chains of standard ONNX ops: stock onnxruntime has no training
        kernels). "auto": "ortrain" when the library loads, with a warning and standard
        ops otherwise.
    bucketing: pad each batch's sequence axis on the right to one of a few bucket lengths
        (multiples of 16 up to 64, then four per doubling: 16, 32, 48, 64, 80, 96, 112,
        128, 160, ...) so variable-length data builds a few graphs instead of one per
        length. Tensors of the token ids' length are padded by name (``labels`` -100,
        ``input_ids`` the pad token) or, named otherwise (nanoGPT's ``idx, targets``),
        as one eager forward finds them read: a loss's targets with its
        ``ignore_index``, others with the pad token, floats with zeros; never past the
        model's position table (``max_position_embeddings``, ``n_positions``,
        ``block_size``, an ``assert`` on the length, a length eager fails at). Only where
        padding is exact: the first batch of each layout (its keys;
        right- or left-padded ``attention_mask``, one with holes, or none; -100-ignored
        labels) runs eagerly padded and unpadded once, a training layout in training
        mode without dropout, and is bucketed only where loss, gradients and outputs
        agree (left padding where the model allows it, e.g. BERT; no mask for a causal
        LM), and where the padded training graph shows no op mixing padded positions into
        the loss or a buffer update (an unmasked reduction, softmax or convolution over
        the sequence, batch statistics, a read of the last position: the warning names
        the node); else ortrain warns and builds per shape.
        ``eval_step`` outputs are cut back to the batch's length. "off": one graph per
        batch shape. A new shape builds a new gradient graph (the update graph is
        shared); at the 4th, 8th, 16th... shape ortrain warns.
    graph_cache: keep built graphs on disk, keyed by the model's structure and code, the
        ``loss_fn``, the batch signature, every build option and the library versions
        (not the weights), so a second run skips the export and the passes
        (``trainer.cache_hits``) and bucketing's trace of the forward's Python
        branches. True: ``$XDG_CACHE_HOME/ortrain/graphs`` (default
        ``~/.cache/ortrain/graphs``; ``ORTRAIN_GRAPH_CACHE=<dir>`` moves it, ``=0`` turns
        it off); a path: that folder; False: off. Entries are checked by a content hash; a
        damaged one is rebuilt with a warning, and a model whose key cannot be made
        trains uncached, with a warning. Processes that miss the same entry at
        once (the ranks of one machine) build it once: the first holds a lock beside
        the entry, the others wait for it and load what it wrote. Off with
        ``save_graphs_dir``.
    build_progress: a build that runs over 2 s prints one line per stage (export, passes,
        session) on stderr; False: quiet.
    verify: check every compiled graph's first step against eager PyTorch on the same
        batch and weights (the loss and every parameter's gradient, both without dropout;
        an evaluation graph's outputs), also a graph loaded from the graph cache
        (``ortrain/verify.py``). Its cost is one eager step per graph built, on CPU run
        on one thread in a forked child started before the build (so an eager step's
        memory does not set the training process's peak; with ``eager_if_faster="auto"``
        a second, timed one there and a timed forward; where torch may use a second core
        (``torch.get_num_threads()``) and the free memory holds both children, the build
        runs in its own child meanwhile), and while the graph's first run is compared a
        copy of what that run writes (the parameters, moments or gradients it changes, put
        back after) beside eager's gradients: the first step's peak is about two model
        sizes above a step's; ``ortrain.explain`` reports the time. False: trust the
        graphs unchecked.
    background_build: a step whose batch has no training graph yet starts its build in a
        forked child (one core, lowest priority) and runs in eager PyTorch on the other
        cores (the module's forward and backward, your torch optimizer's step over
        ortrain's own parameter and optimizer-state tensors), as do the steps after it
        until the graph arrives; then its signature's steps run on it, its first step
        checked against eager. No step waits for a build (a long run gains the build's
        time; on few cores a short one pays the eager steps' lost core); which steps ran
        in eager depends on the build's time, so runs agree to float rounding, not bit for
        bit. CPU, one process, full precision, no accumulation, Adam, AdamW or SGD (others
        are refused here). False (default): a step waits for its graph.
    eager_if_faster: "auto" (default): after a training graph's first, checked step and
        two timed steps, one eager forward of the batch (without gradients, what it
        changes put back) estimates eager's step: the forward times the model's ratio
        of step to forward, timed in the first-step check's child (warm, one thread; at
        most three, three without it), and never below that child's step over the
        thread count. A graph step faster than that estimate by more than its error
        keeps every step on the graph and never runs an eager step; any other goes on
        to a trial (below) (``ortrain/speed_trial.py``). Only within the limits of
        ``background_build``, and not for an optimizer whose own ``step()`` runs in
        eager; elsewhere every step runs on its graph, no error. True: the trial for
        every graph (refused outside those limits): three timed steps on each after an
        untimed first, alternating, all of them real training steps over the same
        state, then that batch signature's later steps run on the one whose median step
        is faster (the graph at a tie; ``ortrain.explain`` shows both times). For
        models whose graph ONNX Runtime runs slower than PyTorch (large convolutions on
        CPU, for one): never slower than eager. Where a trial ran, which steps run where
        after it depends on the times measured, so runs agree to float rounding, not
        bit for bit. With "auto" or True, within the same limits, a batch shape with no
        graph once the model has one (a new bucket length, a shorter last batch) steps
        in eager until those steps have lost, against its graph's estimated step (the
        graphs' own time per batch element), what its build would cost: the time the
        model's latest build took, over the cores where a forked child can build it on
        one while its steps go on in eager on the others (one thread fewer); then its
        graph is built (``ortrain/deferred_builds.py``): a rare shape costs no build, a
        common one at most that cost (``ortrain.explain`` lists them). Only another size
        of an input signature built already (same inputs, ranks, dtypes, Python values).
        Likewise a compiled segment's call of a new signature (a batch shape, or a size
        the data sets: the rows a mask selects, the tokens routed to an expert) runs in
        eager until such calls have lost, against the segment's compiled forward per
        element, what its last build took (``ortrain/ski_rental.py``); one process, full
        precision.
        False: every step runs on its graph, each new shape built at once.
    fallback: what happens when the whole model cannot be one training graph (the export
        fails, an op has no gradient rule, the first step disagrees with eager, or
        parameters are not float32).
        "auto" (default): the largest sub-modules that compile run as compiled segments
        inside torch autograd and the rest in eager PyTorch, with one warning naming each
        module left in eager and why (``ortrain/segments``; ``ortrain.explain`` lists the
        segments and their time); "off": raise instead (an all-compiled guarantee).
    segments: "auto": the whole model is one training graph where it compiles (else
        ``fallback``); "blocks": it trains as compiled segments cut at its repeated
        blocks (the layers of a transformer, children of a ``ModuleList`` or
        ``Sequential`` with the same structure), each checked against eager, blocks of
        one structure sharing one graph and session, the code around them in eager: a
        deep model builds about one block's graph, and its gradients come block by
        block (ZeRO-2 needs that, and sets it).
    """

    device: str = "cpu"
    cuda_graph: bool = False
    update_engine: str = "auto"
    grad_accumulation_steps: int = 1
    max_grad_norm: float | None = None
    seed: int = 0
    intra_op_threads: int | None = None
    save_graphs_dir: str | os.PathLike | None = None
    check_finite: bool = True
    zero_stage: int = 0
    process_group: Any = None  # torch.distributed.ProcessGroup
    dist_timeout: float = 300.0
    broadcast_buffers: bool = True
    mixed_precision: str | None = None
    loss_scale: str | float | DynamicLossScale | None = "auto"
    optimize_graph: bool = True
    memory_plan: bool = True
    cpu_gemm: str = "auto"
    cpu_kernels: str = "auto"
    bucketing: str = "auto"
    graph_cache: bool | str | os.PathLike = True
    build_progress: bool = True
    verify: bool = True
    background_build: bool = False
    eager_if_faster: bool | str = "auto"
    fallback: str = "auto"
    segments: str = "auto"
    reduce_bucket_mb: float = 25.0

    def __post_init__(self) -> None:
        _check_types(self)  # every field against its annotation; no NaN
        if isinstance(self.eager_if_faster, str) and self.eager_if_faster != "auto":
            raise ValueError(
                "TrainerOptions.eager_if_faster must be True, False or 'auto', got "
                f"{self.eager_if_faster!r}"
            )
        kind, _, index = self.device.partition(":")
        if (
            kind not in ("cpu", "cuda")
            or (index and not index.isdigit())
            or (kind == "cpu" and index)
        ):
            raise ValueError(
                f"TrainerOptions.device={self.device!r}: use 'cpu', 'cuda' or 'cuda:N'"
            )
        if self.update_engine not in ("auto", "graph", "kernels", "torch", "backward"):
            raise ValueError(
                "TrainerOptions.update_engine must be 'auto', 'graph', 'kernels', 'torch' or "
                f"'backward', got {self.update_engine!r}"
            )
        if self.cuda_graph and kind != "cuda":
            raise ValueError("TrainerOptions.cuda_graph=True needs device='cuda'")
        if self.grad_accumulation_steps < 1:
            raise ValueError(
                "TrainerOptions.grad_accumulation_steps must be >= 1, got "
                f"{self.grad_accumulation_steps}"
            )
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"TrainerOptions.max_grad_norm must be > 0, got {self.max_grad_norm}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(
                f"TrainerOptions.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}"
            )
        if not 0 < self.reduce_bucket_mb < math.inf:
            raise ValueError(
                "TrainerOptions.reduce_bucket_mb must be finite and > 0, got "
                f"{self.reduce_bucket_mb}"
            )
        if not 0 < self.dist_timeout < math.inf:
            raise ValueError(
                f"TrainerOptions.dist_timeout must be finite and > 0, got {self.dist_timeout}"
            )
        if self.mixed_precision not in (None, "fp16", "bf16"):
            raise ValueError(
                "TrainerOptions.mixed_precision must be 'fp16', 'bf16' or None, got "
                f"{self.mixed_precision!r}"
            )
        if self.mixed_precision == "bf16" and self.device == "cpu":
            raise ValueError(
                "TrainerOptions.mixed_precision='bf16' needs a CUDA device: ONNX Runtime's CPU "
                "execution provider has no bf16 kernels (use 'fp16' on CPU)"
            )
        ls = self.loss_scale
        if isinstance(ls, str) and ls not in ("auto", "dynamic"):
            raise ValueError(
                f"TrainerOptions.loss_scale must be 'auto', 'dynamic', a float, a "
                f"DynamicLossScale or None, got {ls!r}"
            )
        if isinstance(ls, (int, float)) and not (ls > 0 and ls != float("inf")):
            raise ValueError(f"TrainerOptions.loss_scale must be a finite value > 0, got {ls}")
        if self.cpu_gemm not in ("auto", "blas", "onnxruntime"):
            raise ValueError(
                "TrainerOptions.cpu_gemm must be 'auto', 'blas' or 'onnxruntime', got "
                f"{self.cpu_gemm!r}"
            )
        if self.cpu_kernels not in ("auto", "ortrain", "onnxruntime"):
            raise ValueError(
                "TrainerOptions.cpu_kernels must be 'auto', 'ortrain' or 'onnxruntime', got "
                f"{self.cpu_kernels!r}"
            )
        if self.bucketing not in ("auto", "off"):
            raise ValueError(
                f"TrainerOptions.bucketing must be 'auto' or 'off', got {self.bucketing!r}"
            )
        if self.segments not in ("auto", "blocks"):
            raise ValueError(
                f"TrainerOptions.segments must be 'auto' or 'blocks', got {self.segments!r}"
            )
        if self.fallback not in ("auto", "off"):
            raise ValueError(
                f"TrainerOptions.fallback must be 'auto' or 'off', got {self.fallback!r}"
            )
        if self.intra_op_threads is not None and self.intra_op_threads < 1:
            raise ValueError(
                f"TrainerOptions.intra_op_threads must be >= 1, got {self.intra_op_threads}"
            )
        if self.process_group is not None and not _is_process_group(self.process_group):
            raise TypeError(
                "TrainerOptions.process_group must be a torch.distributed ProcessGroup or None, "
                f"got {type(self.process_group).__name__}"
            )

    @property
    def resolved_loss_scale(self) -> str | float | DynamicLossScale | None:
        """The loss scale in effect: "auto" resolved against ``mixed_precision``."""
        if self.loss_scale == "auto":
            return "dynamic" if self.mixed_precision == "fp16" else None
        return self.loss_scale


# Type checks of TrainerOptions: from the annotations, so a new field is checked too.


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Each field's annotation; one naming a type this module cannot see (imported for
    type checking only) is not checked here rather than breaking every construction."""
    try:
        return typing.get_type_hints(cls)
    except NameError:
        pass
    names = vars(sys.modules[cls.__module__])
    hints = {}
    for field in dataclasses.fields(cls):
        try:  # the string annotation (``from __future__ import annotations``) evaluated
            hints[field.name] = typing.get_type_hints(
                types.SimpleNamespace(__annotations__={"x": field.type}), names
            )["x"]
        except NameError:
            hints[field.name] = Any
    return hints


def _conforms(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:  # bool is an int to Python, not to an option
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # an annotation this cannot read: the field's own check decides


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(tp))
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _check_types(options: TrainerOptions) -> None:
    """TypeError for a value of the wrong type (``grad_accumulation_steps=2.5``, a bool
    given as 1), ValueError for a NaN (it passes every ``<``/``>`` range check)."""
    hints = _field_types(type(options))
    for field in dataclasses.fields(options):
        value, tp = getattr(options, field.name), hints[field.name]
        if not _conforms(value, tp):
            raise TypeError(
                f"TrainerOptions.{field.name} must be {_type_name(tp)}, got {value!r} "
                f"({type(value).__name__})"
            )
        is_float = isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
        if is_float and math.isnan(value):
            raise ValueError(f"TrainerOptions.{field.name} must be a number, got {value}")


def _is_process_group(value: Any) -> bool:
    dist = torch.distributed
    return dist.is_available() and isinstance(value, dist.ProcessGroup)
