"""Automatic bucketing: variable-length batches padded to a few lengths, exactly.

The passes need static shapes, so every batch shape is a graph of its own (an export and
a build). Real data comes in many lengths; padding each batch's sequence axis up to one
of a few bucket lengths (``bucket_length``) bounds the builds, and for a model that takes
an ``attention_mask`` and a loss that skips ``-100`` labels it changes nothing the user
sees:

1. Padding is appended on the right of the sequence axis (axis 1 of every batch tensor
   that starts with the mask's ``[batch, length]``): ``attention_mask`` 0, ``labels``
   -100, ``input_ids`` the model's pad token (else 0), ``token_type_ids`` 0,
   ``position_ids`` continuing each row; never past the model's position table
   (``max_position_embeddings``). Real tokens keep their positions (left-padded
   batches too: their padding stays where it was), padded keys are masked out, and
   padded labels are skipped, so the loss and every gradient equal the unpadded batch's
   (up to float rounding).
2. Batches without an ``attention_mask`` (packed or length-sorted data, a short last
   batch) are padded the same way on the right of their token ids' length (``input_ids``,
   else the first 2-D integer tensor): exact for a causal model whose loss skips the
   padded labels (no real position sees a later one), and checked like any layout (3.),
   which refuses it for a bidirectional encoder. A tensor of that length with a name the
   rules above do not know (nanoGPT's ``idx`` and ``targets``) is padded as one eager
   forward finds it read (``padding_roles.py``, once per layout): a loss's targets with
   its ``ignore_index``, token ids with the pad token, floats with zeros. Such a layout is
   padded from the second length it comes in on: data of one shape (the common case of a
   hand-written loop) runs at its own length, with no check, trace or padded compute.
   Not bucketed
   (one graph per shape, as ``bucketing="off"``): an ``attention_mask`` that is not 2-D
   0/1, no mask and no 2-D integer tensor, a batch tensor with the length on another
   axis, non-integer labels.
3. "Exact" is a claim about the model, so it is checked, not assumed: the first time a
   batch layout (its keys; right-padded, left-padded, a mask with holes, or no mask;
   training or evaluation) would be padded, the module runs eagerly on the batch and on
   it padded to a larger bucket, a training layout in training mode (batch statistics
   see the padding) and both without dropout, the buffers put back; loss, parameter
   gradients (training) and outputs cut back (evaluation) must agree to float32
   rounding. A layout whose results change warns once and keeps one graph per shape:
   pooling over all positions, a loss averaged over every token, a classifier reading
   the last position, BatchNorm over tokens in training, an encoder without a mask, or
   a left-padded causal LM batch (a fully masked query row attends uniformly to every
   key, the appended ones too, and GPT-2 predicts the first real label from such a row).
   The check samples one batch; a training layout is also proven on its padded graph
   (``ortrain/padding/``, once per layout, on the graph the step runs next): a
   layout whose graph mixes padded positions into the loss or a buffer update (a max
   over time that ignores the mask, whatever the values of the first batch) is refused
   with the node that mixes, and that graph dropped. A layout's verdict is kept in the
   graph cache (under the model's code and the padded batch's signature): a later run
   with the same bucket does not run the eager check again.
4. Buckets stop at the model's position table (``max_position_embeddings``,
   ``n_positions``, nanoGPT's ``block_size``), at the end of the traced range of lengths
   (6.: an ``assert T <= block_size`` ends it), and below a length eager failed at: each
   new bucket length of a layout is run once in eager (a forward) before batches go to
   it, so a table nothing names does not fail the user's step.
   A length whose bucket has no graph yet runs on a longer bucket's graph, up to
   ``BORROW_LIMIT`` times, then builds its own: a long tail of rare lengths costs no
   builds (padding further is as exact). A layout's first padded batch goes to such a
   graph too (one built for an unpadded batch of its own length): the graph's proof
   holds for any real length, so the layout is proven without a build. A bucket with
   no graph to borrow steps in eager until a build pays (``deferred_builds.py``).
5. ``eval_step``'s outputs are cut back to the batch's length on the axes that the check
   saw grow with the padding (``logits``' sequence axis; attention maps' two).
6. A forward that branches in Python on the length (BigBird's block-sparse attention
   past a few blocks, ``if T > k``) computes another function at the bucket length than
   at the batch's when a threshold lies between them, which 3. samples once per layout
   and cannot see. The forward is traced once with the length symbolic
   (``ortrain/length_branches.py``): a batch is padded only within the range of
   lengths that take the bucket length's branches (a trace that fails leaves 3. alone).
   Its range is kept in the graph cache: a later run does not trace again.
7. A layout's first padded batch starts its graph's build and eager's reference step for
   the first-step check (each in a forked child) before the eager check (3.) and the
   trace (6.), which run here meanwhile, on one thread fewer: the build's export is the
   longest of them, and the others cost the first step nothing. A layout they refuse
   drops the build (``WholeProgram.start_early``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ortrain.core.errors import first_line
from ortrain.core.names import LOSS_LABELS
from ortrain.export import LossFn, call_arguments, other_outputs, step_loss
from ortrain.length_branches import LOWEST, UNKNOWN, BranchRegions, GraphCache
from ortrain.padding_roles import Pad, padding_values

MODES = ("auto", "off")
IGNORE_INDEX = -100  # torch's cross_entropy default, what HF losses and ortrain's label sites skip
MASK = "attention_mask"
_SMALL = 64  # up to here buckets are multiples of _GRAIN
_GRAIN = 16
# The check's tolerances: padding that is exact changes results by float32 rounding only
# (summation order of larger products), far below what a change of semantics moves.
CHECK_RTOL = 1e-5
CHECK_FAILED = "the eager check failed"  # (not kept: the failure need not be the model's)
# eager fails on the batch as given: no verdict on the layout (its next batch is checked),
# the batch runs as given and its step raises eager's error
EAGER_FAILS = "eager fails on the batch itself"
# Batches a bucket without a graph runs padded into a longer one that has a graph, before
# it gets its own: a build costs tens of steps on small models, each borrowed step wastes
# a fraction of one.
BORROW_LIMIT = 32


def bucket_length(n: int) -> int:
    """The smallest bucket length >= ``n``: multiples of 16 up to 64, then four per doubling
    (multiples of an eighth of the next power of two: 80, 96, 112, 128, 160, 192, ...).

    Padding adds under 25% (at most 15 tokens up to 64), and lengths up to ``L`` > 64 use
    at most ``4 + 4 * ceil(log2(L / 64))`` buckets (8 up to 128, 20 up to 1024)."""
    if n < 1:
        raise ValueError(f"a sequence length must be >= 1, got {n}")
    if n <= _SMALL:
        return -(-n // _GRAIN) * _GRAIN
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


def bucket_lengths(max_length: int) -> list[int]:
    """Every bucket length a batch of at most ``max_length`` tokens can get."""
    out: list[int] = []
    n = 1
    while n <= max_length:
        out.append(bucket_length(n))
        n = out[-1] + 1
    return out


PadFn = Callable[[torch.Tensor, int], torch.Tensor]
# a padded batch's graph started early -> what drops it (``WholeProgram.start_early``)
Start = Callable[[dict[str, Any]], Callable[[], None]]


def _nothing() -> None:
    pass


@contextlib.contextmanager
def _one_thread_fewer(fewer: bool) -> Iterator[None]:
    """Torch's threads less one while a forked child computes beside: OpenMP's team would
    wait at every barrier for the thread that lost its core to the child."""
    threads = torch.get_num_threads()
    if fewer and threads > 1:
        torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# a padded batch and what its learned tensors' padding holds (None: the names say it all)
# -> its training graph's padding proof (verdict, detail); None: no graph; ("pending",
# why): its graph is building (ortrain/background_build.py), asked again later
Prove = Callable[[dict[str, Any], "Mapping[str, float | None] | None"], "tuple[str, str] | None"]


def _constant(value: float) -> PadFn:
    def pad(t: torch.Tensor, extra: int) -> torch.Tensor:
        shape = (t.shape[0], extra, *t.shape[2:])
        return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=1)

    return pad


def _continue_positions(t: torch.Tensor, extra: int) -> torch.Tensor:
    step = torch.arange(1, extra + 1, dtype=t.dtype, device=t.device)
    return torch.cat([t, t[:, -1:] + step], dim=1)


def _on(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """``batch`` with its tensors on the module's device (the eager check)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters(), torch.empty(0)).device


def _integer(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


@dataclasses.dataclass(frozen=True)
class Layout:
    """How to pad one batch: its length and a pad function per sequence-axis tensor."""

    length: int
    pads: dict[str, PadFn]
    # "right": every row's mask is ones then zeros (or all ones); "left": zeros then ones;
    # "holes": any other mask; "unmasked": no attention_mask (causal models, packed data)
    side: str
    # sequence-axis tensors whose padding is not known by name: learned (``padding_roles``)
    learn: tuple[str, ...] = ()
    # what the graph's padding proof may assume each padded tensor holds (None: anything)
    holds: dict[str, float | None] = dataclasses.field(default_factory=dict)

    @property
    def right_padded(self) -> bool:
        return self.side in ("right", "unmasked")

    def key(self, train: bool) -> tuple:
        return (train, tuple(sorted(self.pads)), self.side)

    def apply(self, batch: Mapping[str, Any], to: int) -> dict[str, Any]:
        extra = to - self.length
        if extra <= 0:
            return dict(batch)
        return {k: self.pads[k](v, extra) if k in self.pads else v for k, v in batch.items()}


def layout(
    batch: Mapping[str, Any], pad_id: int, learned: Mapping[str, Pad] | None = None
) -> Layout | str:
    """The batch's padding plan, or why it cannot be padded. ``learned``: the padding of
    batch tensors whose names say nothing (``padding_roles``); one not in it is in the
    plan's ``learn`` (padded with zeros until learned)."""
    mask = batch.get(MASK)
    if mask is None:  # unmasked: keyed by its token ids (input_ids, else the first such)
        ids = batch.get("input_ids")
        if ids is None:
            ids = next((v for v in batch.values() if _token_ids(v)), None)
        if not _token_ids(ids):
            return f"no {MASK} and no 2-D integer tensor of token ids"
        b, n = ids.shape
        return _plan(batch, b, n, pad_id, "unmasked", learned or {})
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        return f"no 2-D {MASK}"
    if not bool(((mask == 0) | (mask == 1)).all()):
        return f"{MASK} holds values other than 0 and 1"
    b, n = mask.shape
    if bool((mask[:, 1:] <= mask[:, :-1]).all()):
        side = "right"
    elif bool((mask[:, 1:] >= mask[:, :-1]).all()):
        side = "left"
    else:
        side = "holes"
    return _plan(batch, b, n, pad_id, side, learned or {})


def _token_ids(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.ndim == 2 and _integer(v)


def _plan(
    batch: Mapping[str, Any],
    b: int,
    n: int,
    pad_id: int,
    side: str,
    learned: Mapping[str, Pad],
) -> Layout | str:
    pads: dict[str, PadFn] = {}
    holds: dict[str, float | None] = {}
    learn: list[str] = []  # (padded with zeros meanwhile)
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            continue
        if v.ndim >= 2 and tuple(v.shape[:2]) == (b, n):
            if k in _NAMED:
                if not _integer(v) and k != MASK:
                    return f"'{k}' is {v.dtype}, not token ids"
                value, holds[k] = _NAMED[k]
                if k == "input_ids":
                    value = holds[k] = pad_id
                pads[k] = _continue_positions if k == "position_ids" else _constant(value)
            elif k in learned:
                pads[k] = _constant(learned[k])
                holds[k] = learned[k]
            else:
                pads[k] = _constant(0)
                learn.append(k)
        elif n in tuple(v.shape[1:]):
            return f"'{k}' {list(v.shape)} has the length {n} on an axis other than 1"
    return Layout(n, pads, side, tuple(learn), holds)


# the padding of batch tensors named as transformers names them: (value, what the graph's
# proof may assume it holds: None, anything); input_ids: the model's pad token
_NAMED: dict[str, tuple[int, int | None]] = {
    MASK: (0, 0),
    "input_ids": (0, 0),
    "labels": (IGNORE_INDEX, IGNORE_INDEX),
    LOSS_LABELS: (IGNORE_INDEX, IGNORE_INDEX),
    "token_type_ids": (0, None),
    "position_ids": (0, None),  # continuing each row
}


def max_positions(module: torch.nn.Module) -> int | None:
    """The longest sequence the model's position table holds (HF configs, nanoGPT's and
    minGPT's), else None."""
    cfg = getattr(module, "config", None)
    for name in ("max_position_embeddings", "n_positions", "block_size"):  # (nanoGPT's last)
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(module, "block_size", None)  # minGPT keeps it on the model
    return value if isinstance(value, int) and value > 0 else None


def pad_token_id(module: torch.nn.Module) -> int:
    """The id padded ``input_ids`` get: the model config's pad token, else 0."""
    pad = getattr(getattr(module, "config", None), "pad_token_id", None)
    return pad if isinstance(pad, int) and pad >= 0 else 0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The eager check of one batch layout: exact or not, and the output axes to cut."""

    exact: bool
    reason: str = ""
    seq_axes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Padded:
    """A batch as it goes to the graph, with what ``cut`` needs to undo the padding."""

    batch: dict[str, Any]
    length: int | None = None  # the real length; None: not padded
    seq_axes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def cut(self, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """In place: each output's padded axes narrowed to the real length."""
        if self.length is None:
            return outputs
        for k, axes in self.seq_axes.items():
            t = outputs.get(k)
            if t is not None:
                for axis in axes:
                    t = t.narrow(axis, 0, self.length)
                outputs[k] = t.contiguous()
        return outputs


class Bucketing:
    """Pads batches to bucket lengths where that is exact (module docstring)."""

    def __init__(
        self,
        module: torch.nn.Module,
        loss_fn: LossFn | None,
        mode: str = "auto",
        sync: Callable[[], object] | None = None,
        cache: GraphCache | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"TrainerOptions.bucketing must be 'auto' or 'off', got {mode!r}")
        self.module = module
        self.loss_fn = loss_fn
        self.mode = mode
        self._sync = sync  # the trainer's weights into the module before a check
        self._pad_id = pad_token_id(module)
        self._max = max_positions(module)  # buckets stop there: no position past the table
        self.verdicts: dict[tuple, Verdict] = {}
        self.proofs: dict[tuple, tuple[str, str]] = {}  # per layout: the graph's (verdict, why)
        self._graphs: dict[tuple, set[int]] = {}  # per layout: the lengths given to the trainer
        self._borrowed: collections.Counter[tuple] = collections.Counter()
        # per layout: ranges of lengths that take the same Python branches (6.)
        self._cache = cache
        self.branches = BranchRegions(module, loss_fn, cache)
        self._told: set[tuple] = set()  # (layout, range) warned about
        # per layout: the padding of tensors whose names say nothing (padding_roles.py)
        self.learned: dict[tuple, dict[str, Pad]] = {}
        # per layout: the shortest length its padded eager run failed at (not padded to)
        self._fails: dict[tuple, int] = {}
        self._ran: dict[tuple, set[int]] = {}  # per layout: lengths eager ran padded to
        self._lengths: dict[tuple, set[int]] = {}  # per layout to learn: the lengths seen

    def pad(
        self,
        batch: dict[str, Any],
        *,
        train: bool,
        prove: Prove | None = None,
        proof_first: bool = False,
        start: Start | None = None,
    ) -> Padded:
        """``batch`` padded to its bucket where that is exact. ``prove``: the training
        graph of a padded batch, built, says whether padding mixes into the loss (3.);
        asked once per layout. ``proof_first``: its graph may come later (built in the
        background, or deferred while its steps run in eager: ``deferred_builds.py``),
        so it is asked before the eager check, which runs once the graph is there (a
        layout's batches run unpadded until then). ``start``: the padded batch's graph started
        before a layout's first eager check and length trace, which run while it builds
        (what it returns drops it where the batch is not padded after all)."""
        if self.mode == "off":
            return Padded(batch)
        plan = layout(batch, self._pad_id)
        if isinstance(plan, str):
            return Padded(batch)
        key = plan.key(train)
        holds = None  # (the names say what the padding holds)
        if plan.learn:
            if key not in self.learned:  # padded from its second length on (2.)
                seen = self._lengths.setdefault(key, set())
                seen.add(plan.length)
                if len(seen) < 2:
                    return Padded(batch)
            learned = self._learned(key, batch, plan, train)
            if learned is None:  # eager fails on the batch: it runs as given (and raises)
                return Padded(batch)
            plan = layout(batch, self._pad_id, learned)
            assert not isinstance(plan, str)
            holds = plan.holds
        verdict = self.verdicts.get(key)
        to = self.bucket(plan.length)
        if verdict is None or verdict.exact:  # (a layout's first padded batch too: a
            to = self._borrow(key, to)  # longer batch's graph is proven for it, not built)
        to = self._capped(key, plan.length, to)
        if to == plan.length:  # its own bucket already
            self._graphs.setdefault(key, set()).add(to)
            return Padded(batch)
        if verdict is None and proof_first and prove is not None and key not in self.proofs:
            proof = prove(plan.apply(batch, to), holds)
            if proof is not None and proof[0] == "pending":
                return Padded(batch)
        drop = _nothing
        if verdict is None and start is not None and not proof_first and key not in self.proofs:
            if self._sync is not None:  # (the children see the weights as they are now)
                self._sync()
            drop = start(plan.apply(batch, to))
        early = drop is not _nothing
        try:
            verdict = self._verdict(key, verdict, batch, plan, to, train, early)
            same = verdict.exact and self._same_branches(key, batch, plan, to, train)
        except BaseException:
            drop()
            raise
        if not same or not self._runs_at(key, batch, plan, to, train):
            drop()
            return Padded(batch)
        padded = plan.apply(batch, to)
        if prove is not None and key not in self.proofs:
            proof = prove(padded, holds)
            if proof is not None and proof[0] == "pending":
                return Padded(batch)  # its graph builds in the background: unpadded meanwhile
            verdict = self._proven(key, proof, plan, train)
            if not verdict.exact:
                return Padded(batch)
        self._graphs.setdefault(key, set()).add(to)
        return Padded(padded, plan.length, verdict.seq_axes)

    def needs_eager(self, batch: Mapping[str, Any], *, train: bool) -> bool:
        """Whether ``pad`` would run the module in eager on ``batch`` (the layout's check,
        its padding values, the length trace, a new bucket length's forward): nothing
        known yet, in this process or the graph cache. Changes nothing. ZeRO-3 asks it
        first, as those runs need every parameter whole on every rank."""
        if self.mode == "off":
            return False
        plan = layout(batch, self._pad_id)
        if isinstance(plan, str):
            return False
        key = plan.key(train)
        cache = self._cache
        kind = "train" if train else "eval"
        if plan.learn:
            learned = self.learned.get(key)
            if learned is None:
                if len(self._lengths.get(key, set()) | {plan.length}) < 2:
                    return False
                signed = plan.apply(batch, self.bucket(plan.length))
                kept = cache.recall(f"padding-values/{kind}/{plan.side}", signed) if cache else None
                if kept is None:
                    return True
                learned = dict(kept[0])
            plan = layout(batch, self._pad_id, learned)
            assert not isinstance(plan, str)
        verdict = self.verdicts.get(key)
        to = self.bucket(plan.length)
        if verdict is not None and verdict.exact:
            to = self._lender(key, to)
        to = self._capped(key, plan.length, to)
        if to == plan.length:
            return False
        padded = plan.apply(batch, to)
        if verdict is None:
            kept = cache.recall(f"padding-check/{kind}/{plan.side}", padded) if cache else None
            if kept is None:
                return True
            verdict = Verdict(bool(kept[0][0]), str(kept[0][1]))
        if not verdict.exact:
            return False
        upper = self._max if self._max is not None else 1 << 20
        padded = _on(padded, _device(self.module))
        if not self.branches.known(key, padded, list(plan.pads), upper, train):
            return True
        if to in self._ran.get(key, set()):
            return False
        return cache is None or cache.recall(f"padding-runs/{kind}/{plan.side}", padded) is None

    def _verdict(
        self,
        key: tuple,
        verdict: Verdict | None,
        batch: Mapping[str, Any],
        plan: Layout,
        to: int,
        train: bool,
        early: bool,
    ) -> Verdict:
        """The layout's verdict, checked here (3.) the first time (``early``: beside the
        graph started for it, on one thread fewer); a refusal warns once."""
        if verdict is not None:
            return verdict
        with _one_thread_fewer(early):
            verdict = self._checked(batch, plan, to, train)
        if verdict.reason.startswith(EAGER_FAILS):  # a bad batch says nothing of the layout
            return verdict
        if verdict.reason.startswith(CHECK_FAILED):  # only this long (a table's end, an assert)
            self._fail(key, plan, to, train, verdict.reason)
            return verdict
        self._ran.setdefault(key, set()).add(to)
        self.verdicts[key] = verdict
        if not verdict.exact:
            side = {"left": "left-padded ", "holes": "masked (with holes) "}.get(plan.side, "")
            warnings.warn(
                f"ortrain: {side}batches with {', '.join(sorted(plan.pads))} are not padded "
                f"to bucket lengths ({'training' if train else 'evaluation'}): "
                f"{verdict.reason}; each length builds its own graph",
                stacklevel=5,
            )
        return verdict

    def _same_branches(
        self, key: tuple, batch: Mapping[str, Any], plan: Layout, to: int, train: bool
    ) -> bool:
        """Whether the batch's length and ``to`` take the same Python branches of the
        forward (``ortrain/length_branches.py``), traced once per range."""
        upper = self._max if self._max is not None else 1 << 20
        padded = _on(plan.apply(batch, to), next(self.module.parameters()).device)
        lo, hi = self.branches.region(key, padded, list(plan.pads), upper, train)
        if (lo, hi) not in (UNKNOWN, (LOWEST, upper)) and (key, lo, hi) not in self._told:
            self._told.add((key, lo, hi))
            warnings.warn(
                f"ortrain: {type(self.module).__name__}'s forward branches in Python on the "
                f"sequence length: lengths {lo} to {hi} take the path length "
                f"{to} takes; batches are padded to a bucket only within such a range "
                f"(others build a graph of their own length)",
                stacklevel=5,
            )
        return lo <= plan.length <= hi

    def _proven(
        self, key: tuple, proof: tuple[str, str] | None, plan: Layout, train: bool
    ) -> Verdict:
        """The layout's verdict after the graph's analysis (None: no graph to analyse)."""
        verdict = self.verdicts[key]
        if proof is None:
            return verdict
        self.proofs[key] = proof
        if proof[0] != "mixes":
            return verdict
        verdict = self.verdicts[key] = Verdict(False, proof[1])
        warnings.warn(
            f"ortrain: batches with {', '.join(sorted(plan.pads))} are not padded to bucket "
            f"lengths ({'training' if train else 'evaluation'}): the training graph shows "
            f"padding reaching the loss: {proof[1]}; each length builds its own graph",
            stacklevel=5,
        )
        return verdict

    def _borrow(self, key: tuple, own: int) -> int:
        """``own``, or the smallest longer length that has a graph already while ``own`` has
        none and has borrowed fewer than ``BORROW_LIMIT`` times (rare lengths never pay a
        build; a common one gets its graph after a bounded waste)."""
        to = self._lender(key, own)
        if to != own:
            self._borrowed[(key, own)] += 1
        return to

    def _lender(self, key: tuple, own: int) -> int:
        """The length ``_borrow`` would pad to (counting nothing)."""
        graphs = self._graphs.get(key, set())
        longer = [n for n in graphs if n > own]
        if own in graphs or not longer or self._borrowed[(key, own)] >= BORROW_LIMIT:
            return own
        return min(longer)

    def _fail(self, key: tuple, plan: Layout, to: int, train: bool, why: str) -> None:
        if to < self._fails.get(key, 1 << 62):
            self._fails[key] = to
            warnings.warn(
                f"ortrain: batches with {', '.join(sorted(plan.pads))} are not padded to {to} "
                f"or more ({'training' if train else 'evaluation'}): {why}",
                stacklevel=6,
            )

    def _runs_at(
        self, key: tuple, batch: Mapping[str, Any], plan: Layout, to: int, train: bool
    ) -> bool:
        """Whether eager runs the forward padded to ``to``, tried once per length before a
        layout's batches go there (past a position table nothing names, every later
        batch's step would fail where the user's own batch runs). Kept in the graph cache."""
        if to in self._ran.get(key, set()):
            return True
        what = f"padding-runs/{'train' if train else 'eval'}/{plan.side}"
        padded = _on(plan.apply(batch, to), _device(self.module))
        if self._cache is None or self._cache.recall(what, padded) is None:
            try:
                self._forward(padded, train)
            except Exception as exc:
                try:  # a bad batch fails as given too: that says nothing of the length
                    self._forward(_on(batch, _device(self.module)), train)
                except Exception:
                    return False
                why = f"{CHECK_FAILED} ({type(exc).__name__}: {first_line(exc)})"
                self._fail(key, plan, to, train, why)
                return False
            if self._cache is not None:
                self._cache.remember(what, padded, True)
        self._ran.setdefault(key, set()).add(to)
        return True

    def _forward(self, batch: Mapping[str, Any], train: bool) -> None:
        with self._looking(train, []), torch.no_grad():
            args, kwargs = call_arguments(self.module, batch)
            step_loss(self.module(*args, **kwargs), batch, self.loss_fn)

    def _capped(self, key: tuple, length: int, to: int) -> int:
        """``to``, or less: no longer than the traced range of lengths that take
        ``length``'s Python branches (6.: a model's ``assert T <= block_size`` ends one),
        never as long as a length whose padded eager run failed (the batch unpadded)."""
        for lo, hi in self.branches.regions.get(key, []):
            if (lo, hi) != UNKNOWN and lo <= length <= hi < to:
                to = hi
        return length if to >= self._fails.get(key, 1 << 62) else to

    def bucket(self, length: int) -> int:
        """The length a batch of ``length`` tokens is padded to."""
        to = bucket_length(length)
        return min(to, self._max) if self._max is not None and length <= self._max else to

    # ------------------------------------------------------------------ the check
    def _checked(self, batch: Mapping[str, Any], plan: Layout, to: int, train: bool) -> Verdict:
        """The layout's eager check (3.), or its verdict from an earlier run: kept in the
        graph cache under the model's code and the padded batch's signature, as the
        graphs are (a verdict here holds for every later batch of the layout anyway)."""
        cache = self._cache
        what = f"padding-check/{'train' if train else 'eval'}/{plan.side}"
        padded = plan.apply(batch, to)
        kept = cache.recall(what, padded) if cache is not None else None
        if kept is not None:
            exact, reason, axes = kept[0]
            return Verdict(bool(exact), str(reason), {str(k): tuple(v) for k, v in axes.items()})
        verdict = self._check(batch, plan, to, train)
        if cache is not None and not verdict.reason.startswith((CHECK_FAILED, EAGER_FAILS)):
            cache.remember(what, padded, (verdict.exact, verdict.reason, dict(verdict.seq_axes)))
        return verdict

    def _check(self, batch: Mapping[str, Any], plan: Layout, to: int, train: bool) -> Verdict:
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad and train]
        params = [p for _, p in named]
        try:
            # a training layout in training mode (batch statistics see the padding), dropout
            # off on both runs; the buffers a training forward updates are put back
            with self._looking(train, params):
                batch = _on(batch, _device(self.module))
                stage = EAGER_FAILS
                real = self._run(batch, params)
                stage = CHECK_FAILED
                padded = self._run(plan.apply(batch, to), params)
        except Exception as exc:  # the unpadded step will raise its own error, if any
            why = f"{type(exc).__name__}: {first_line(exc)}"
            return Verdict(False, f"{stage} ({why})")
        return compare(real, padded, plan.length, to, [n for n, _ in named])

    @contextlib.contextmanager
    def _looking(self, train: bool, params: Sequence[torch.Tensor]) -> Iterator[None]:
        """Eager runs of the module that leave no trace: the trainer's weights in it, its
        mode as a step (``train``) runs it, no dropout, its random state, buffers, Python
        attributes put back, the user's hooks on ``params`` not called."""
        if self._sync is not None:
            self._sync()
        module = self.module
        devices = sorted({p.device.index or 0 for p in module.parameters() if p.is_cuda})
        from ortrain.core.own_hooks import users_hooks_paused
        from ortrain.python_state import kept
        from ortrain.verify import in_mode, no_dropout, restoring

        with (
            in_mode(module, train),
            torch.random.fork_rng(devices=devices),
            torch.set_grad_enabled(train),
            no_dropout(),
            restoring(list(module.buffers())),
            kept(module, self.loss_fn),  # a buffer assigned anew, Python attributes
            users_hooks_paused(params),  # a look, not a step: a hook that logs sees none
        ):
            yield

    def _learned(
        self, key: tuple, batch: Mapping[str, Any], plan: Layout, train: bool
    ) -> dict[str, Pad] | None:
        """The padding of the layout's tensors whose names say nothing: followed through
        one eager forward and loss (``padding_roles.py``) the first time, kept in the
        graph cache as the check's verdict is; None where eager fails on the batch."""
        found = self.learned.get(key)
        if found is not None:
            return found
        what = f"padding-values/{'train' if train else 'eval'}/{plan.side}"
        signed = plan.apply(batch, self.bucket(plan.length))  # the bucket's signature
        kept = self._cache.recall(what, signed) if self._cache is not None else None
        if kept is not None:
            found = dict(kept[0])
        else:

            def run(b: Mapping[str, Any]) -> None:
                self._forward(b, train)

            try:
                found = padding_values(
                    run, _on(batch, _device(self.module)), list(plan.learn), self._pad_id
                )
            except Exception:  # the step on this batch raises eager's error itself
                return None
            if self._cache is not None:
                self._cache.remember(what, signed, found)
        self.learned[key] = found
        return found

    def _run(
        self, batch: Mapping[str, Any], params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]], list[torch.Tensor | None]]:
        batch = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        args, kwargs = call_arguments(self.module, batch)  # (copies: a look, not a step)
        outputs = self.module(*args, **kwargs)
        loss = step_loss(outputs, batch, self.loss_fn)
        others = [(k, v.detach()) for k, v in other_outputs(outputs)]
        grads: list[torch.Tensor | None] = []
        if params:
            grads = list(torch.autograd.grad(loss, params, allow_unused=True))
        return loss.detach(), others, grads


Run = tuple[torch.Tensor, list[tuple[str, torch.Tensor]], list[torch.Tensor | None]]


def _close(a: torch.Tensor, b: torch.Tensor, scale: float) -> bool:
    return bool(((a.double() - b.double()).abs() <= CHECK_RTOL * scale).all())


def compare(real: Run, padded: Run, length: int, to: int, names: Sequence[str] = ()) -> Verdict:
    """Whether the padded run gave the real run's loss, gradients (of the parameters
    ``names``) and outputs."""
    loss_a, outs_a, grads_a = real
    loss_b, outs_b, grads_b = padded
    if loss_a.shape != loss_b.shape or not _close(loss_a, loss_b, float(loss_a.abs().max())):
        return Verdict(False, f"padding changed the loss ({loss_a.tolist()} -> {loss_b.tolist()})")
    scale = max((float(g.abs().max()) for g in grads_a if g is not None and g.numel()), default=0)
    for name, ga, gb in zip(names, grads_a, grads_b, strict=True):
        ga = ga if ga is not None else torch.zeros(())
        gb = gb if gb is not None else torch.zeros(())
        if ga.shape != gb.shape and ga.ndim and gb.ndim:
            return Verdict(False, f"padding changed the shape of {name}'s gradient")
        if not _close(ga, gb, scale):
            return Verdict(False, f"padding changed the gradient of {name}")
    axes: dict[str, tuple[int, ...]] = {}
    if [k for k, _ in outs_a] != [k for k, _ in outs_b]:
        return Verdict(False, "padding changed which outputs the model returns")
    for (key, a), (_, b) in zip(outs_a, outs_b, strict=True):
        if a.ndim != b.ndim:
            return Verdict(False, f"padding changed the rank of output '{key}'")
        grown = tuple(i for i in range(a.ndim) if a.shape[i] != b.shape[i])
        if any(a.shape[i] != length or b.shape[i] != to for i in grown):
            return Verdict(False, f"output '{key}' {list(a.shape)} grew other than its length")
        for i in grown:
            b = b.narrow(i, 0, length)
        if a.is_floating_point():
            ok = _close(a, b, float(a.abs().max()) if a.numel() else 0.0)
        else:
            ok = torch.equal(a, b)
        if not ok:
            return Verdict(False, f"padding changed output '{key}'")
        if grown:
            axes[key] = grown
    return Verdict(True, seq_axes=axes)
