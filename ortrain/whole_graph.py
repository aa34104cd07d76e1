"""The whole model as one graph per batch signature: what is built, found and run.

``WholeGraphs`` holds what a trainer compiled while its model is one graph:

1. per batch signature, the export of the training forward (``ForwardSource``): every
   training graph of the signature is built from it (one per label-row bucket:
   ``graph_passes/training/label_sparsity.py``), and so is its evaluation graph where
   graphs are checked against eager (one export per model and signature, not per mode);
2. the graphs themselves, each built once, from the graph cache (``ortrain/build_cache.py``)
   or by ``run_build`` (a forked child where the process can fork), their build records
   appended to ``log``;
3. per graph a ``CompiledGraph``: its session, bound by role by the caller
   (``runtime/binder.py``: a training graph's binding needs the update engine), the names
   and dtypes of its batch inputs, and whether its first step agreed with eager.

``find_train`` picks the graph a batch runs on: its signature's, with the fewest labelled
rows that hold the batch's.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ortrain import nested_batch
from ortrain.bucketing import BORROW_LIMIT
from ortrain.build import BuiltGraph, ForwardSource, StageRecord, graph_for, holding, label_rows
from ortrain.core.errors import first_line
from ortrain.core.roles import Role
from ortrain.index_check import check_batch
from ortrain.length_family import LengthFamily, varying_axes
from ortrain.runtime.session import BoundSession

if TYPE_CHECKING:
    import onnx_ir as ir

    from ortrain.build_cache import GraphCache
    from ortrain.core.build_config import BuildConfig
    from ortrain.export import LossFn

RunBuild = Callable[[Callable[[], Any], Mapping[str, Any]], Any]


def signature(batch: Mapping[str, Any]) -> tuple:
    """What a graph is built for: each tensor's shape and dtype (those in the batch's
    containers too), each other value's repr."""
    sig = []
    for k, v in nested_batch.flat(batch).items():
        if isinstance(v, torch.Tensor):
            sig.append((k, tuple(v.shape), v.dtype))
        else:
            sig.append((k, "const", repr(v)))
    return tuple(sig)


def without_sizes(sig: tuple) -> tuple:
    """A signature (``signature``) with each tensor's sizes left out (its rank kept):
    what the sizes of one kind of batch share."""
    return tuple(
        (k, len(shape), d) if isinstance(shape, tuple) else (k, shape, d) for k, shape, d in sig
    )


def _shapes(sig: tuple) -> dict[str, tuple[int, ...]]:
    return {k: shape for k, shape, _ in sig if isinstance(shape, tuple)}


class NotOneGraph(Exception):
    """The whole model cannot be one training graph; ``fallback="auto"`` segments it.
    ``error``: what to raise instead where eager cannot run the batch either."""

    def __init__(self, cause: str, error: Exception):
        super().__init__(cause)
        self.cause = cause
        self.error = error

    def eager_fails_too(self, eager: BaseException, model: str, hint: str = "") -> Exception:
        """``error`` saying that the model's own forward fails on the batch in eager
        PyTorch (a bug or a bad batch of the user's, not the compiler's); ``hint``: what
        about the batch may be why."""
        said = (
            f"; {model}'s forward fails on this batch in eager PyTorch too "
            f"({type(eager).__name__}: {first_line(eager)}): fix the model or the batch"
            f"{hint}"
        )
        try:
            return type(self.error)(f"{self.error}{said}")
        except TypeError:  # an error type that takes other arguments: keep it, add a note
            self.error.add_note(said[2:])
            return self.error


@dataclasses.dataclass
class CompiledGraph:
    """One batch shape signature's gradient (or eval) session and batch names."""

    session: BoundSession
    graph: BuiltGraph  # what the session runs, serialized (for inspection and tests)
    batch_names: list[str]
    batch_dtypes: dict[str, torch.dtype]
    output_keys: list[str]
    # CUDA graphs replay fixed addresses: each batch is copied into these buffers.
    static_batch: dict[str, torch.Tensor] | None = None
    # (the graph's new value, the buffer) per buffer a training step updates
    buffer_updates: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=list
    )
    cache_hit: bool = False  # loaded from the graph cache, not built by this process
    verified: bool = False  # its first step agreed with eager (ortrain/first_step.py)
    unchecked: str = ""  # why it could not be checked (it draws random numbers)

    @classmethod
    def of(
        cls, session: BoundSession, built: BuiltGraph, batch: Mapping[str, Any], **kwargs: Any
    ) -> CompiledGraph:
        names = [r.name for r in built.io if r.role is Role.BATCH]
        flat = nested_batch.flat(batch)
        dtypes = {k: flat[k].dtype for k in names}
        return cls(session, built, names, dtypes, built.output_keys, **kwargs)

    @functools.cached_property
    def model(self) -> ir.Model:
        return self.graph.model()

    def bind_batch(self, batch: Mapping[str, Any], device: torch.device) -> list[torch.Tensor]:
        """Check ``batch``'s indices as eager would (ids and labels in range, and indices
        computed from them) and bind its tensors; returns what must live until the run."""
        batch = nested_batch.flat(batch)  # (a container's tensors: inputs of their own)
        check_batch(self.graph.index_checks, batch)
        if self.graph.computed_indices is not None:
            self.graph.computed_indices.check(batch)
        keep = []
        for name in self.batch_names:
            t = batch[name]
            if self.static_batch is not None:  # CUDA graph: the captured addresses
                buf = self.static_batch.get(name)
                if buf is None:
                    buf = self.static_batch[name] = torch.empty(
                        t.shape, dtype=t.dtype, device=device
                    )
                buf.copy_(t, non_blocking=True)
                t = buf
            elif t.device != device:  # a host batch: one copy (CUDA: on our stream)
                t = t.to(device, non_blocking=True)
            t = t.contiguous()
            keep.append(t)
            self.session.bind_batch(name, t)
        return keep

    def host_outputs(self) -> dict[str, torch.Tensor]:
        """An evaluation run's outputs by key, copied: the session reuses its buffers."""
        values = self.session.binding.get_outputs()
        return {k: torch.from_numpy(v.numpy()).clone() for k, v in zip(self.output_keys, values)}


class WholeGraphs:
    """The model's graphs by batch signature (cases 1-3 of the module's docstring)."""

    def __init__(
        self,
        module: torch.nn.Module,
        loss_fn: LossFn | None,
        cache: GraphCache,
        run_build: RunBuild,
        log: list[StageRecord],
    ):
        self.module = module
        self.loss_fn = loss_fn
        self.cache = cache
        self.run_build = run_build
        self.log = log
        self.train: dict[tuple, CompiledGraph] = {}  # by (signature, label rows)
        self.eval: dict[tuple, CompiledGraph] = {}  # by signature
        self.forwards: dict[tuple, ForwardSource] = {}  # by signature
        # by signature without sizes: the symbolic export its later sizes start from
        self.families: dict[tuple, LengthFamily] = {}
        self._borrowed: collections.Counter[tuple] = collections.Counter()
        self.count = 0  # graphs built or loaded (training and eval)

    def has_train(self, batch: Mapping[str, Any]) -> bool:
        sig = signature(batch)
        return any(s == sig for s, _ in self.train)

    def find_train(self, batch: Mapping[str, Any], borrow: bool = False) -> CompiledGraph | None:
        """The training graph ``batch`` runs on, if one is built. ``borrow`` (a step):
        else one with more labelled rows than the batch needs, up to ``BORROW_LIMIT``
        times per row count, as bucketing lends a longer length's graph (padded batches'
        labelled rows vary with their real length: each count a build is too many)."""
        sig = signature(batch)
        forward = self.forwards.get(sig)
        if forward is None:
            return None
        built = [rows for s, rows in self.train if s == sig]
        needed = label_rows(forward.sites, batch)
        rows = graph_for(forward.sites, needed, built)
        if rows is None:  # what a build for this batch would make, if it exists already
            target = label_rows(forward.sites, batch, headroom=True)
            rows = target if target in built else None
            if rows is None and borrow and self._borrowed[(sig, target)] < BORROW_LIMIT:
                rows = holding(forward.sites, needed, built)
                self._borrowed[(sig, target)] += rows is not None
        return None if rows is None else self.train[(sig, rows)]

    def family(self, batch: Mapping[str, Any]) -> LengthFamily | None:
        """Where ``batch`` is another size of a signature exported before, the sizes'
        symbolic export (``ortrain/length_family.py``): the one traced already, or the
        axes to trace it on; None for a signature's first size."""
        sig = signature(batch)
        sized = without_sizes(sig)
        known = self.families.get(sized)
        if known is not None:
            return known
        for other in self.forwards:
            if other != sig and without_sizes(other) == sized:
                axes = varying_axes(_shapes(sig), _shapes(other))
                return LengthFamily(axes) if axes else None
        return None

    def drop_family(self, batch: Mapping[str, Any], why: str) -> None:
        """``batch``'s signature's sizes exported each at its own from now on."""
        sig = signature(batch)
        self.forwards.pop(sig, None)  # (its forward came from the symbolic export)
        sized = without_sizes(sig)
        known = self.families.get(sized) or LengthFamily({})
        self.families[sized] = dataclasses.replace(known, wire=None, failed=why)

    def build_train(
        self, batch: Mapping[str, Any], settings: BuildConfig, fresh: bool = False
    ) -> tuple[tuple, BuiltGraph, bool]:
        """The training graph of ``batch`` (exported unless its signature was; ``fresh``:
        exported and built anew over the cache's entry). Returns (label rows, graph,
        whether it came from the graph cache). Raises what the build raises."""
        hits = self.cache.hits
        forward, rows, built = self.train_job(batch, settings, fresh)()
        return self.adopt_train(batch, forward, rows, built, self.cache.hits > hits)

    def train_job(
        self, batch: Mapping[str, Any], settings: BuildConfig, fresh: bool = False
    ) -> Callable[[], tuple[ForwardSource, tuple, BuiltGraph]]:
        """What builds ``batch``'s training graph (or loads it from the cache), to run here
        or in a forked child (``ortrain/background_build.py``); ``adopt_train`` takes its
        result."""
        forward = None if fresh else self.forwards.get(signature(batch))
        family = self.family(batch) if forward is None and not fresh else None

        def job() -> tuple[ForwardSource, tuple, BuiltGraph]:
            return self.cache.build_train(
                functools.partial(self.run_build, batch=batch),
                self.module,
                batch,
                self.loss_fn,
                settings,
                forward,
                len(self.log) + 1,
                fresh=fresh,
                family=family,
            )

        return job

    def adopt_train(
        self, batch: Mapping[str, Any], forward: ForwardSource, rows: tuple, built: BuiltGraph,
        hit: bool,
    ) -> tuple[tuple, BuiltGraph, bool]:  # fmt: skip
        sig = signature(batch)
        if sig not in self.forwards:
            _warn_many_shapes(len(self.forwards) + 1, batch)
        if forward.family is not None:  # the signature's later sizes start from it
            self.families[without_sizes(sig)] = forward.family
            forward = dataclasses.replace(forward, family=None)
        self.forwards[sig] = forward
        self.log.extend(built.log)
        return rows, built, hit

    def add_train(self, batch: Mapping[str, Any], rows: tuple, compiled: CompiledGraph) -> None:
        self.train[(signature(batch), rows)] = compiled
        self.count += 1

    def build_eval(
        self, batch: Mapping[str, Any], settings: BuildConfig, *, checked: bool, fresh: bool
    ) -> BuiltGraph:
        """The evaluation graph of ``batch``'s signature: from the training export of that
        signature where there is one and graphs are ``checked`` (its first run against
        eager decides), else (or ``fresh``) from an export in evaluation mode."""
        forward = None if fresh or not checked else self.forwards.get(signature(batch))
        built = self.cache.build_eval(
            functools.partial(self.run_build, batch=batch),
            self.module,
            batch,
            self.loss_fn,
            settings,
            len(self.log) + 1,
            forward,
            fresh=fresh,
        )
        self.log.extend(built.log)
        return built

    def add_eval(self, batch: Mapping[str, Any], compiled: CompiledGraph) -> None:
        self.eval[signature(batch)] = compiled
        self.count += 1

    def forget_train(self, compiled: CompiledGraph, batch: Mapping[str, Any]) -> None:
        """``compiled`` disagreed with eager: it and its signature's export go."""
        self.train = {k: c for k, c in self.train.items() if c is not compiled}
        self.forwards.pop(signature(batch), None)

    def clear_train(self) -> None:
        self.train.clear()
        self.forwards.clear()


SHAPES_WARNING_AT = 4  # then at every doubling


def _warn_many_shapes(count: int, batch: Mapping[str, Any]) -> None:
    """Each batch shape exports and builds its own graph: say so when shapes keep coming."""
    if count < SHAPES_WARNING_AT or count & (count - 1):
        return
    shapes = ", ".join(
        f"{k}: {list(v.shape)} {str(v.dtype).removeprefix('torch.')}"
        if isinstance(v, torch.Tensor)
        else f"{k}={v!r:.40}"
        for k, v in batch.items()
        if v is not None
    )
    # a Python number passed to the forward is a constant of its graph: each value is a
    # graph of its own, whatever the shapes
    values = [k for k, v in batch.items() if isinstance(v, bool | int | float)]
    advice = (
        f" Python values passed to the forward ({', '.join(values)}) are constants of "
        "each graph, so each new value is a graph too: pass them as tensors "
        "(torch.tensor(value)) to keep one."
        if values
        else ""
    )
    from ortrain.bucketing import layout

    why = layout(batch, 0)
    unpadded = (
        f" This batch is not one it pads ({why}): it pads the tensors of a batch's "
        "token ids' length (input_ids, else the first 2-D integer tensor), learning "
        "which of them a loss's targets are; pad such batches yourself."
        if isinstance(why, str)
        else ""
    )
    warnings.warn(
        f"ortrain has built training graphs for {count} batch signatures (latest: {shapes}); "
        "each new shape is exported and compiled again and keeps its own session. "
        "bucketing='auto' pads batches to a few lengths by itself where that is exact "
        "(right-padded or unmasked, a loss that skips the padded targets); other batches: "
        "pad them to a few lengths, e.g. "
        f"DataCollatorWithPadding(tokenizer, pad_to_multiple_of=64).{unpadded}{advice}",
        stacklevel=7,
    )
