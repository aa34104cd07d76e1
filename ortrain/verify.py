"""The first step of every compiled graph, checked against eager PyTorch.

No cache key sees everything a forward reads and no exporter keeps every option's
meaning, so a graph is trusted only after it agreed with eager once: before its first
training step, the graph runs on the step's batch with the step's weights and eager runs
one forward and backward on the same; the loss (or a segment's outputs) and every
gradient must agree within the tolerance of the compute dtype. Randomness is taken out
of both sides: the graph's Dropouts read a switch (``prepare/dropout_switch.py``) that is
off for that run, its other draws take fixed values while it is off
(``prepare/random_switch.py``), and eager runs under ``no_dropout()``, its draws at the
same values (``fixed_draws.py``; a draw with no fixed value leaves the step uncompared).
The check leaves no trace: the tensors the run writes are put back and eager's buffers
(BatchNorm statistics) restored.

1. ``Tolerance``: per compute dtype, a relative bound on the loss and on each gradient,
   the gradient's measured against its own largest element plus a small part of the
   largest gradient element of all (a gradient that is float noise around zero, such as
   an attention key bias's, then compares at the noise level of the others);
2. ``compare``: the mismatches, worst first, each naming the tensor and its module;
   ``confirm`` keeps those a float64 eager step confirms, and ``beyond_kinks`` those
   rounding could not have made by flipping a ReLU or a max at its kink;
3. ``no_dropout()``: eager's dropouts that the export makes an ONNX Dropout (``F.dropout``
   out of place, SDPA's ``dropout_p``, a recurrent layer's) become the identity, and its
   other draws (the other dropouts' masks included) take fixed values; it counts
   the dropout sites eager has, so a graph with fewer (an exporter that dropped one) is
   reported, and names the draws with no fixed value (``Draws``);
4. ``eager_loss_and_grads``: the reference, without touching ``.grad`` or buffers (what a
   custom autograd.Function's backward writes into ``.grad`` itself included).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ortrain.core.errors import VerificationError
from ortrain.eager_grads import grads_of
from ortrain.fixed_draws import FixedDraws
from ortrain.python_state import kept
from ortrain.spill import LoadedOnRead, Spilled, SpillFile

__all__ = [
    "Mismatch",
    "Tolerance",
    "VerificationError",
    "compare",
    "eager_loss_and_grads",
    "eval_children",
    "in_float64_run",
    "no_dropout",
    "restoring",
    "with_written",
    "written_grads",
]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Relative bounds for one compute dtype, on the norm of a difference: a kink (a ReLU
    whose input is within rounding of 0, a max with a near tie) can flip in one
    implementation and not the other, which moves a few elements of a gradient by a
    whole term; their share of the norm is small, a wrong rule's or a dropped option's
    is not."""

    loss: float
    grad: float
    floor: float = 1e-3  # of the largest gradient norm of all, added to each scale

    @classmethod
    def of(cls, precision: str | None) -> Tolerance:
        return _TOLERANCES[precision]


_TOLERANCES = {
    None: Tolerance(loss=1e-4, grad=1e-3),
    "fp16": Tolerance(loss=1e-2, grad=5e-2),
    "bf16": Tolerance(loss=3e-2, grad=1e-1),
}
# A float32 mismatch stands only if the graph is this many times further from a float64
# eager reference than float32 eager is (``confirm``): deep stacks of normalizations and
# ReLUs leave both float32 results about 1e-3 from the exact gradient.
EXACT_FACTOR = 10.0
# A mixed-precision mismatch stands only if the graph is this many times further from
# float32 eager than eager under ``torch.autocast`` in the same dtype is (``confirm``):
# half precision moves some models' gradients beyond the tolerance in eager as much as in
# the graph (attention without a 1/sqrt(d) scale), a wrong rule only the graph's.
HALF_FACTOR = 2.0
# ``beyond_kinks``: each parameter times (1 + KINK_NUDGE * N(0, 1)), about 8 float32 ulps,
# in each of KINK_PROBES float64 steps; the graph's gradients must be KINK_FACTOR times
# further from the exact ones than the farthest nudged step's, or KINK_CEILING of a
# gradient's norm (no flip of rounding's excuses more).
KINK_NUDGE = 2.0**-20
KINK_PROBES = 2
KINK_FACTOR = 3.0
KINK_CEILING = 0.25
# elements a float64 norm converts at a time (``_norm64``): a float64 copy of this many
NORM_PIECE = 1 << 20


@dataclasses.dataclass(frozen=True)
class Mismatch:
    name: str  # the tensor (a parameter, "loss", a segment's output or input gradient)
    error: float  # the difference's norm over the allowed one (> 1: a mismatch)
    difference: float  # the norm of the difference
    scale: float  # what it was measured against (the reference's norm, plus the floor)
    key: str = ""  # the name it was compared under ("": ``name``)

    def describe(self, module: str | None = None) -> str:
        where = f" (module '{module}')" if module else ""
        if not self.scale:
            return f"{self.name}{where}"
        return (
            f"{self.name}{where}: differs by {self.difference / self.scale:.2g} of its norm "
            f"({self.difference:.3g} against {self.scale:.3g})"
        )


def _dense(t: torch.Tensor) -> torch.Tensor:
    """As float64 on the host, dense (a sparse embedding's gradient)."""
    t = t.detach()
    return (t.to_dense() if t.is_sparse else t).to(torch.float64).cpu()


def _norm(t: torch.Tensor) -> float:
    if t.dtype == torch.float32 and not t.is_sparse:
        return _norm64(t)
    return float(torch.linalg.vector_norm(_dense(t))) if t.numel() else 0.0


def _norm64(t: torch.Tensor, minus: torch.Tensor | None = None) -> float:
    """The norm of a float32 tensor (of ``t - minus``), summed in float64 (float32's sum
    loses digits) a piece at a time: a first step's check compares gradients of the
    model's size, and no float64 copy of a whole one (nor a difference) is made."""
    if not t.numel():
        return 0.0
    a = t.detach().reshape(-1)
    b = None if minus is None else minus.detach().reshape(-1)
    squares = torch.zeros((), dtype=torch.float64, device=a.device)
    for start in range(0, a.numel(), NORM_PIECE):
        piece = a[start : start + NORM_PIECE]
        if b is not None:
            piece = piece - b[start : start + NORM_PIECE]
        squares += torch.linalg.vector_norm(piece, dtype=torch.float64).square()
    return math.sqrt(float(squares))


def _plain_float32(g: torch.Tensor, w: torch.Tensor) -> bool:
    """Both dense float32 tensors of one shape on one device."""
    return (
        g.dtype == w.dtype == torch.float32
        and not (g.is_sparse or w.is_sparse)
        and g.shape == w.shape
        and g.device == w.device
        and g.numel() > 0
    )


def compare(
    got: Mapping[str, torch.Tensor | None],
    want: Mapping[str, torch.Tensor | None],
    rtol: float,
    floor: float = 1e-3,
) -> list[Mismatch]:
    """Tensors of ``want`` that ``got`` misses or differs from beyond ``rtol`` (the norm of
    the difference against the reference's norm plus ``floor`` of the largest reference
    norm), worst first. A name missing on both sides (no gradient in eager, none in the
    graph) agrees; a gradient one side has and the other lacks is a mismatch unless it is
    all zeros; non-finite values must be the same on both sides."""
    norms = {name: _norm(t) for name, t in want.items() if t is not None}
    top = max(norms.values(), default=0.0)
    out = []
    for name in sorted(set(got) | set(want)):
        g, w = got.get(name), want.get(name)
        if g is None and w is None:
            continue
        if g is None or w is None:
            present = g if w is None else w
            assert present is not None
            if _norm(present) > 0:
                side = "eager" if g is None else "the graph"
                out.append(Mismatch(f"{name} (only {side} has it)", float("inf"), 0, 0, name))
            continue
        if _plain_float32(g, w):
            # float64 norms of the float32 tensors, no copies: a finite norm means finite
            # values (float32 squares cannot overflow a float64 sum), and a difference of
            # two float32 values is exact where they are close
            ng, diff = _norm64(g), _norm64(g, w)
            if math.isfinite(norms[name]) and math.isfinite(ng) and math.isfinite(diff):
                scale = norms[name] + floor * top
                if diff > rtol * scale:
                    error = diff / (rtol * scale) if rtol * scale else float("inf")
                    out.append(Mismatch(name, error, diff, scale, name))
                continue
        g, w = _dense(g), _dense(w)
        if g.shape != w.shape:
            shapes = f"{name} (shape {list(g.shape)} vs {list(w.shape)})"
            out.append(Mismatch(shapes, float("inf"), 0.0, 0.0, name))
            continue
        if not g.numel():
            continue
        if not w.is_floating_point():
            if not torch.equal(g, w):
                out.append(Mismatch(f"{name} (integers differ)", float("inf"), 0.0, 0.0, name))
            continue
        finite = torch.isfinite(w)
        if bool(finite.all()) and bool(torch.isfinite(g).all()):  # (no masked copies)
            difference, scale = _norm(g - w), norms[name] + floor * top
        else:
            g_off, w_off = g[~finite], w[~finite]  # the same infinities, NaN where NaN
            if not bool(torch.equal(finite, torch.isfinite(g))) or not bool(
                ((g_off == w_off) | (g_off.isnan() & w_off.isnan())).all()
            ):
                out.append(Mismatch(f"{name} (non-finite values differ)", float("inf"), 0, 0, name))
                continue
            difference = _norm((g - w)[finite])
            scale = _norm(w[finite]) + floor * top
        allowed = rtol * scale
        if difference > allowed:
            error = difference / allowed if allowed else float("inf")
            out.append(Mismatch(name, error, difference, scale, name))
    return sorted(out, key=lambda m: -m.error)


def confirm(
    mismatches: Sequence[Mismatch],
    got: Mapping[str, torch.Tensor | None],
    want: Mapping[str, torch.Tensor | None],
    exact: Mapping[str, torch.Tensor | None],
    rtol: float,
    factor: float = EXACT_FACTOR,
) -> list[Mismatch]:
    """The mismatches a float64 reference (``exact``) confirms: the graph is more than
    ``factor`` times further from it than float32 eager (``want``) is, and further than
    ``rtol`` of its norm. Rounding makes both float32 results wander off the exact one
    alike; a wrong rule or a dropped option moves only the graph's."""
    kept = []
    for m in mismatches:
        key = m.key or m.name
        g, w, e = got.get(key), want.get(key), exact.get(key)
        if g is None or w is None or e is None or g.shape != e.shape or not m.scale:
            kept.append(m)
            continue
        e64 = _dense(e)
        finite = torch.isfinite(e64)
        ours = _norm((_dense(g) - e64)[finite])
        theirs = _norm((_dense(w) - e64)[finite])
        if ours > factor * theirs and ours > rtol * _norm(e64[finite]):
            kept.append(m)
    return kept


def _worst(
    grads: Mapping[str, torch.Tensor | None], exact: Mapping[str, torch.Tensor | None], floor: float
) -> float:
    """The largest difference of ``grads`` from ``exact``, each over its tensor's norm plus
    ``floor`` of the largest norm (as ``compare`` scales them); inf where one is missing."""
    norms = {n: _norm(e) for n, e in exact.items() if e is not None}
    top = max(norms.values(), default=0.0)
    for name, g in grads.items():  # a gradient eager does not have
        if exact.get(name) is None and g is not None and _norm(g) != 0:
            return math.inf
    worst = 0.0
    for name, norm in norms.items():
        g, e = grads.get(name), exact[name]
        if g is None or e is None or g.shape != e.shape:
            return math.inf
        e64, g64 = _dense(e), _dense(g)
        finite = torch.isfinite(e64)
        if not torch.equal(finite, torch.isfinite(g64)):
            return math.inf  # a NaN or an infinity where the other has a number
        scale = norm + floor * top
        difference = _norm((g64 - e64)[finite])
        if not math.isfinite(difference):
            return math.inf
        if scale:
            worst = max(worst, difference / scale)
    return worst


def beyond_kinks(
    got: Mapping[str, torch.Tensor | None],
    exact: Mapping[str, torch.Tensor | None],
    nudged: Callable[[int], Mapping[str, torch.Tensor | None] | None],
    floor: float,
) -> bool:
    """Whether the graph's gradients (``got``) are further from the exact ones than
    rounding can move them. A ReLU input or a max within rounding of a tie flips with
    the last bits of what reaches it, and moves the gradients of everything before it by
    a whole term; with few elements per statistic (a small batch of small images through
    BatchNorm and ReLU) that is percents of their norm, in float32 eager as much as in the
    graph, though in different places on each run. ``nudged(i)``: the float64 step's
    gradients with every parameter nudged by rounding's size (``KINK_NUDGE``), for
    ``i < KINK_PROBES`` (None: it could not run). The loss is continuous across such
    kinks and is compared as before; a wrong rule moves the gradients whether or not a
    kink is near, and stays beyond."""
    ours = _worst(got, exact, floor)
    if not ours <= KINK_CEILING:  # NaN and inf included
        return True
    spread = 0.0
    for i in range(KINK_PROBES):
        probe = nudged(i)
        if probe is None:
            return True
        spread = max(spread, _worst(probe, exact, floor))
    return ours > KINK_FACTOR * spread


def nudge(module: torch.nn.Module, seed: int) -> None:
    """Each floating parameter of ``module`` (a float64 copy) times ``1 + KINK_NUDGE *
    N(0, 1)``, from a generator of its own."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.numel():
                noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
                p.mul_(1 + KINK_NUDGE * noise.to(p.device))


# --------------------------------------------------------------------------- eager side
_DROPOUTS = {
    F.dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
    F.alpha_dropout,
    F.feature_alpha_dropout,
    torch.dropout,
    torch.alpha_dropout,
    torch.feature_dropout,
    torch.feature_alpha_dropout,
}


# recurrent layers draw their inter-layer dropout inside one call: (input, hx, params,
# has_biases, num_layers, dropout, train, ...), or packed (data, batch_sizes, hx, ...)
_RNNS = {"lstm", "gru", "rnn_tanh", "rnn_relu"}


def _rnn_without_dropout(args: tuple) -> tuple[tuple, int]:
    """A recurrent call's arguments with its dropout 0, and the sites it would draw."""
    packed = isinstance(args[1], torch.Tensor) and not args[1].is_floating_point()
    at = 6 if packed else 5
    if len(args) <= at + 1:
        return args, 0
    dropout, train, layers = args[at], args[at + 1], args[at - 1]
    if not (train and float(dropout) > 0):
        return args, 0
    return (*args[:at], 0.0, *args[at + 1 :]), int(layers) - 1


@dataclasses.dataclass(frozen=True)
class Draws:
    """What eager drew in a check's run: the dropout sites it skipped, and the random ops
    it drew that have no fixed value (the step cannot be compared)."""

    dropouts: int = 0
    unverified: tuple[str, ...] = ()


def _forward_pass() -> bool:
    """Whether no backward is running: an activation checkpoint's recompute (in the
    backward) replays its forward's dropouts, which eager drew once and the graph draws
    once."""
    return torch._C._current_autograd_node() is None


class _NoDropout(TorchFunctionMode):
    """Eager dropout as the identity; counts the sites that would have drawn. Its
    ``fixed`` mode gives eager's other draws their fixed values."""

    def __init__(self) -> None:
        super().__init__()
        self.sites = 0
        self.fixed = FixedDraws()

    @property
    def draws(self) -> Draws:
        return Draws(self.sites, tuple(sorted(self.fixed.unverified)))

    def call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` without its dropout."""
        if getattr(func, "__name__", "") in _RNNS and not kwargs and len(args) > 6:
            args, sites = _rnn_without_dropout(tuple(args))
            self.sites += sites if _forward_pass() else 0
            return func(*args)
        name = getattr(func, "__name__", "")
        if func in _DROPOUTS or name in _F_DROPOUTS:
            inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
            if name != "dropout" or inplace:
                # exported as draws and arithmetic, not as an ONNX Dropout the switch
                # turns off: it runs, its draws at the fixed values the graph's take
                return func(*args, **kwargs)
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and float(p) > 0 and _forward_pass():
                self.sites += 1
            return args[0] if args else kwargs["input"]
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if float(p) > 0:
                self.sites += _forward_pass()
                if len(args) > 4:
                    args = (*args[:4], 0.0, *args[5:])
                else:
                    kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.call(func, tuple(args), dict(kwargs or {}))


# torch.nn.functional's dropouts and attention, replaced while the check runs: a mode's
# handler runs with the mode off, so a dropout that another function the mode sees calls
# inside (multi_head_attention_forward's) would still draw; torch.nn.functional looks its
# own names up at call time, so the replacements reach those calls too
_F_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
               "feature_alpha_dropout")  # fmt: skip
_F_REPLACED = (*_F_DROPOUTS, "scaled_dot_product_attention")


@contextlib.contextmanager
def no_dropout(fixed: bool = False) -> Iterator[_NoDropout]:
    """Eager PyTorch without dropout inside; ``.sites`` counts the dropouts skipped;
    ``fixed``: its other draws at their fixed values (``eager_run``)."""
    mode = _NoDropout()
    originals = {name: getattr(F, name) for name in _F_REPLACED}

    def replaced(func: Any) -> Any:
        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            return mode.call(func, args, kwargs)

        return call

    for name, func in originals.items():
        setattr(F, name, replaced(func))
    try:
        with mode, mode.fixed if fixed else contextlib.nullcontext():
            yield mode
    finally:
        for name, func in originals.items():
            setattr(F, name, func)


def eval_children(module: torch.nn.Module) -> tuple[str, ...]:
    """The modules a training step runs in evaluation mode, as eager would: those its user
    put there (a frozen BatchNorm; every one, ``""`` the model itself, after
    ``model.eval()``)."""
    return tuple(name for name, m in module.named_modules() if not m.training)


@contextlib.contextmanager
def no_kv_cache(module: torch.nn.Module) -> Iterator[None]:
    """A Hugging Face model's key/value cache off while it trains as segments: its layers
    would otherwise take and fill a cache object (for generation, not for the loss), which
    no compiled graph can take. Every sub-module's config: an encoder-decoder's decoder
    holds a copy of its own (T5)."""
    configs = {id(c): c for m in module.modules() if (c := getattr(m, "config", None)) is not None}
    on = []
    for config in configs.values():
        if getattr(config, "use_cache", False) is True:
            try:
                config.use_cache = False
            except (AttributeError, TypeError, dataclasses.FrozenInstanceError):
                continue  # a user's own read-only config: left as it is
            on.append(config)
    try:
        yield
    finally:
        for config in on:
            config.use_cache = True


@contextlib.contextmanager
def in_mode(module: torch.nn.Module, training: bool) -> Iterator[None]:
    """Inside: ``training``, the modes a training step runs ``module`` in, which are its
    user's (``eval_children``: eager trains a module in evaluation mode in that mode);
    else evaluation mode throughout. Every module's mode as it was after."""
    modes = {m: m.training for m in module.modules()}
    if not training:
        module.eval()
    try:
        yield
    finally:
        for m, was in modes.items():
            m.training = was


@contextlib.contextmanager
def restoring(tensors: Sequence[torch.Tensor], spill: bool = False) -> Iterator[None]:
    """Put these tensors' values back afterwards (a run that must leave no trace).
    ``spill``: large host tensors' copies wait in a file, not in memory (``ortrain/spill.py``:
    a checked run that writes every parameter)."""
    file = SpillFile() if spill else None
    seen: dict[int, tuple[torch.Tensor, torch.Size, torch.Tensor | Spilled | None]] = {}
    try:
        for t in tensors:
            if id(t) not in seen:
                seen[id(t)] = (t, t.shape, snapshot(t, file))
        yield
    finally:
        with torch.no_grad():
            for t, shape, saved in seen.values():
                if t.shape != shape:  # resized in place (an observer's first call)
                    t.resize_(shape)
                if isinstance(saved, Spilled):
                    file.put_back(saved, t)  # type: ignore[union-attr]
                elif saved is not None:
                    t.copy_(saved)
                elif _written(t):
                    t.zero_()
        if file is not None:
            file.close()


def _written(t: torch.Tensor) -> bool:
    """Whether ``t``, all zeros before, holds anything else now: read in pieces, so that
    an untaken zero buffer stays untaken (``runtime/zero_pages.py``) and no temporary of
    its size is made."""
    flat = t.detach().reshape(-1)
    return any(bool(piece.any()) for piece in flat.split(1 << 20))


def snapshot(t: torch.Tensor, file: SpillFile | None = None) -> torch.Tensor | Spilled | None:
    """A copy of ``t`` (in ``file`` where it takes it), or None where it is all zeros (a
    fresh optimizer's moments, zeroed gradients: at a first step most of what a check
    puts back, which would otherwise be copied whole)."""
    if t.numel() and bool(t.detach().any()):
        kept = file.keep(t) if file is not None else None
        return kept if kept is not None else t.detach().clone()
    return None


# eager's loss, its gradients by parameter name, what it drew, seconds
EagerStep = tuple[torch.Tensor, dict[str, torch.Tensor | None], Draws, float]


@contextlib.contextmanager
def written_grads(params: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor | None]]:
    """What a backward inside the block writes into ``params``' ``.grad`` itself, in the
    yielded list once the block ends; their ``.grad`` as it was afterwards. A custom
    autograd.Function may backpropagate inside its own backward (reversible layers that
    run their forward under no_grad): ``torch.autograd.grad`` returns no gradient for
    those parameters, and what ``loss.backward()`` would leave in ``.grad`` is eager's."""
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    written: list[torch.Tensor | None] = []
    try:
        yield written
        written.extend(p.grad for p in params)
    finally:
        for p, g in zip(params, held, strict=True):
            p.grad = g


def with_written(
    grads: Sequence[torch.Tensor | None], written: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """``grads`` plus what ``written_grads`` collected, element by element."""
    return [
        w if g is None else g if w is None else g + w for g, w in zip(grads, written, strict=True)
    ]


def _rng_states() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


R = TypeVar("R")


def eager_run(run: Callable[[bool], R], draws: Callable[[R], Draws]) -> R:
    """``run(fixed)`` (an eager run of a check, under ``no_dropout(fixed)``) without the
    fixed draws; where it drew from torch's generators, again with them (the first run's
    draws were eager's own). ``draws(result)``: what a run drew. A run the fixed draws'
    mode cannot make (``torch.cond``'s kernel refuses a dispatch mode) keeps the first,
    its draws unverified."""
    before = _rng_states()
    out = run(False)
    after = _rng_states()
    if len(after) == len(before) and all(map(torch.equal, before, after)):
        return out
    try:
        return run(True)
    except Exception as exc:
        first = draws(out)
        why = f"draws under {type(exc).__name__}"
        return _with_draws(out, Draws(first.dropouts, (*first.unverified, why)))


def _with_draws(out: Any, draws: Draws) -> Any:
    """``out`` (a tuple holding one ``Draws``) with that one replaced."""
    return tuple(draws if isinstance(x, Draws) else x for x in out)


def eager_loss_and_grads(
    loss_of: Any,
    module: torch.nn.Module,
    names: Sequence[str],
) -> EagerStep:
    """One eager forward (``loss_of()``) and backward without dropout, leaving ``.grad``
    and the module's buffers as they were: (loss, the gradients of the parameters
    ``names``, what it drew, seconds); its draws at their fixed values (``eager_run``)."""
    return eager_run(
        lambda fixed: _eager_loss_and_grads(loss_of, module, names, fixed), lambda s: s[2]
    )


def _eager_loss_and_grads(
    loss_of: Any, module: torch.nn.Module, names: Sequence[str], fixed: bool
) -> EagerStep:
    start = time.perf_counter()
    params = dict(module.named_parameters())
    wrt = [params[n] for n in names]
    with written_grads(list(params.values())) as written:
        with restoring(list(module.buffers())), no_dropout(fixed) as mode, torch.enable_grad():
            loss = loss_of()
            grads = grads_of([loss], wrt) if wrt and loss.requires_grad else (None,) * len(wrt)
    by_name = dict(zip(params, written, strict=True))
    found = dict(zip(names, with_written(grads, [by_name[n] for n in names])))
    return loss.detach(), found, mode.draws, time.perf_counter() - start


def lost_dropout(eager_sites: int, drawn: int) -> Mismatch | None:
    """Where the graph draws dropout at fewer places than eager: the export lost some (the
    check runs with dropout off, where the two agree), and the graph would train without
    them. Named as a mismatch, so the module trains in eager (or the build stops)."""
    if drawn >= eager_sites:
        return None
    why = (
        f"dropout: eager draws it at {eager_sites} place(s), the graph at {drawn} (the "
        "export lost some)"
    )
    return Mismatch(why, math.inf, 0.0, 0.0)


def report(
    what: str,
    mismatches: Sequence[Mismatch],
    module_of: Mapping[str, str] | None = None,
    limit: int = 5,
) -> str:
    """The worst mismatches, each with its module."""
    module_of = module_of or {}
    lines = [m.describe(module_of.get(m.name)) for m in mismatches[:limit]]
    more = f" (and {len(mismatches) - limit} more)" if len(mismatches) > limit else ""
    return f"{what} disagrees with eager PyTorch on its first step: " + "; ".join(lines) + more


def module_of(param: str) -> str:
    """The module that owns a parameter, from its qualified name."""
    return param.rpartition(".")[0] or "(the model)"


def raise_mismatch(what: str, mismatches: Sequence[Mismatch], hint: str) -> None:
    mods = {m.name: module_of(m.name) for m in mismatches}
    raise VerificationError(report(what, mismatches, mods) + f". {hint}")


def in_float64(module: torch.nn.Module) -> torch.nn.Module | None:
    """A float64 copy of ``module`` (the exact reference of ``confirm``); None where the
    model cannot be copied or converted."""
    try:
        return copy.deepcopy(module).double()
    except Exception:
        return None


T = TypeVar("T")


def in_float64_run(run: Callable[[], T]) -> T | None:
    """``run()`` on a float64 copy of the model, or None where it cannot run in float64
    (the copy failed, or the forward mixes dtypes on purpose: an autocast region): the
    mismatches then stand unconfirmed."""
    try:
        return run()
    except Exception:
        return None


def as_float64(value: Any) -> Any:
    """Floating tensors in ``value`` (a batch, a call's arguments) as float64."""
    import torch.utils._pytree as pytree

    def cast(t: Any) -> Any:
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return pytree.tree_map(cast, value)


def in_autocast_run(half: tuple[str, torch.dtype], run: Callable[[], T]) -> T | None:
    """``run()`` inside ``torch.autocast`` on ``half`` (device type, dtype); None where
    autocast cannot run it (no such autocast on that device, an op without its kernel)."""
    try:
        with torch.autocast(half[0], dtype=half[1]):
            return run()
    except Exception:
        return None


def graph_step_mismatches(
    loss_of: Any,
    module: torch.nn.Module,
    run: Any,
    names: Sequence[str],
    read_grads: Any,
    written: Sequence[torch.Tensor],
    dropout_on: torch.Tensor | None,
    tol: Tolerance,
    loss: torch.Tensor,
    exact: bool = True,
    reference: EagerStep | None = None,
    half: tuple[str, torch.dtype] | None = None,
) -> tuple[list[Mismatch], Draws, float]:
    """A whole training graph's first step against eager: ``run()`` runs the graph once
    (its batch bound), after which ``loss`` holds its loss and ``read_grads()`` its
    gradients of the parameters ``names``; every tensor in ``written`` is put back
    afterwards. ``loss_of(module)`` is eager's loss of the step's batch (in the module's
    dtype); ``exact``: a float32 graph's mismatches get a float64 second look
    (``confirm``); ``half``: a mixed-precision graph's get one in eager under autocast
    in that (device type, dtype). ``reference``: eager's step taken already (before the
    graph was built, ``eager_loss_and_grads`` over at least ``names``). Returns
    (mismatches, what eager drew, seconds): where eager drew what has no fixed value, no
    comparison (none)."""
    start = time.perf_counter()
    earlier = 0.0 if reference is None else reference[3]  # its seconds, counted here too
    if reference is None:
        with kept(module):  # a look, not a step: no Python attribute advanced
            reference = eager_loss_and_grads(lambda: loss_of(module), module, names)
    want_loss, every, draws, _ = reference
    if draws.unverified:
        return [], draws, time.perf_counter() - start + earlier
    # (a reference from the check's child reads each gradient from its file when asked)
    want = every.only(names) if isinstance(every, LoadedOnRead) else {n: every[n] for n in names}
    with restoring([*written, loss], spill=True):
        if dropout_on is not None:
            dropout_on.fill_(False)
        try:
            run()
        finally:
            if dropout_on is not None:
                dropout_on.fill_(True)
        got_loss = loss.detach().clone()
        # compared where they are: a copy of every gradient (the model's size) is made
        # only for a second look
        got = dict(read_grads())
        bad_loss = compare({"loss": got_loss}, {"loss": want_loss}, tol.loss)
        bad = compare(got, want, tol.grad, tol.floor)
        second_look = bool(bad_loss or bad) and (exact or half is not None)
        got = {n: g.detach().clone() for n, g in got.items()} if second_look else {}
    if second_look and half is not None:
        with kept(module):
            in_half = in_autocast_run(
                half, lambda: eager_loss_and_grads(lambda: loss_of(module), module, names)
            )
        if in_half is not None:
            loss16, grads16, _, _ = in_half
            bad_loss = confirm(
                bad_loss, {"loss": got_loss}, {"loss": loss16}, {"loss": want_loss}, tol.loss,
                HALF_FACTOR,
            )  # fmt: skip
            bad = confirm(bad, got, grads16, want, tol.grad, HALF_FACTOR)
    elif second_look:
        module64 = in_float64(module)
        exact_step = in_float64_run(
            lambda: eager_loss_and_grads(lambda: loss_of(module64), module64, names)
        )
        if exact_step is not None:
            loss64, exact_grads, _, _ = exact_step
            bad_loss = confirm(
                bad_loss, {"loss": got_loss}, {"loss": want_loss}, {"loss": loss64}, tol.loss
            )
            bad = confirm(bad, got, want, exact_grads, tol.grad)
            # only differences of size: a shape, a NaN, a gradient one side lacks stand
            if bad and not bad_loss and all(m.scale for m in bad):

                def nudged(i: int) -> Mapping[str, torch.Tensor | None] | None:
                    def probe() -> Mapping[str, torch.Tensor | None]:
                        nudge(module64, 1 + i)  # on top of the last: the copy is spent
                        return eager_loss_and_grads(lambda: loss_of(module64), module64, names)[1]

                    return in_float64_run(probe)

                if not beyond_kinks(got, exact_grads, nudged, tol.floor):
                    bad = []
    return bad_loss + bad, draws, time.perf_counter() - start + earlier
