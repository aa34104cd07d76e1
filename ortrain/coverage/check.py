"""Train one spec through ``ORTTrainer`` and in eager PyTorch, and name the outcome.

Two SGD steps on both sides from equal harnesses (``spec.Harness``), on the same two
batches; SGD makes the weights after a step a function of that step's gradients, so
comparing the weights compares the gradients, element by element. The trainer runs with
its default options (first step verified against eager, ``fallback="auto"``; the build
progress lines off).

Outcomes:

1. ``compiled``: the whole model is one training graph (``trainer.segments is None``);
2. ``fallback``: it trains as compiled segments inside torch autograd with eager for the
   rest; the cause is the whole model's and each module left in eager;
3. ``refused``: ``train_step`` raised; the cause is the exception's type and first line;
4. ``WRONG``: it trained, and a loss, a parameter or a buffer differs from eager's
   (per-step losses rtol 1e-5; parameters and buffers rtol 1e-5, atol 1e-6). A bug, never
   an expected outcome.

A ``random`` spec (dropout, RReLU) draws other numbers than eager does: it is not compared
step by step; ortrain's own first-step check (randomness off on both sides, element by
element) is what stands for it, and its losses must be finite.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
import warnings

import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import first_line
from ortrain.coverage.spec import Harness, Spec

STEPS = 2
LR = 0.5  # large enough that a gradient error shows in the weights above the tolerance
LOSS_RTOL = 1e-5
PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-6
OPTIONS = TrainerOptions(build_progress=False)  # the defaults; the progress lines only print

COMPILED, FALLBACK, REFUSED, WRONG = "compiled", "fallback", "refused", "WRONG"


@dataclasses.dataclass(frozen=True)
class Outcome:
    spec: str  # Spec.id
    kind: str  # COMPILED | FALLBACK | REFUSED | WRONG
    cause: str = ""  # shortened: the op and why
    detail: str = ""  # the causes as the trainer gave them (fallbacks, refusal, differences)
    seconds: float = 0.0
    compared: bool = True  # False: a random spec (module docstring)


def _differences(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float, atol: float
) -> list[str]:
    """The tensors that differ anywhere beyond ``atol + rtol * |want|``, each with its
    largest difference (NaN where eager has NaN agrees)."""
    out = []
    for name in sorted(set(got) | set(want)):
        g, w = got.get(name), want.get(name)
        if g is None or w is None:
            out.append(f"{name}: only on one side")
            continue
        g, w = g.detach().cpu(), w.detach().cpu()
        if g.shape != w.shape or g.dtype != w.dtype:
            out.append(f"{name}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}")
            continue
        if not g.is_floating_point():
            if not torch.equal(g, w):
                out.append(f"{name}: integer values differ")
            continue
        close = torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
        if not bool(close.all()):
            diff = (g - w).abs().nan_to_num(nan=float("inf"))
            k = int(diff.argmax())
            out.append(
                f"{name}: {int((~close).sum())} of {g.numel()} elements differ, largest "
                f"{float(diff.flatten()[k]):.3g} (ortrain {float(g.flatten()[k]):.6g}, "
                f"eager {float(w.flatten()[k]):.6g})"
            )
    return out


# ----------------------------------------------------------------------------- causes
_SHORTER = [
    # (pattern, replacement), in order: the op and why, from the trainer's and exporter's
    # messages, without node names, module paths and hints
    (r"^its first step disagrees with eager: \w+'s training graph disagrees with eager "
     r"PyTorch on its first step: ", "first step disagrees with eager: "),
    (r"^its first step disagrees with eager \((.*)\)$", r"first step disagrees with eager: \1"),
    (r" \(module '[^']*'\)", ""),
    (r"(first step disagrees with eager: [^:]+: largest difference \S+) against a scale of "
     r"([\d.e+-]+\d).*", r"\1 against \2"),
    (r"^ExportError: torch\.onnx\.export failed for \w+: ", "export: "),
    (r" \(the exporter: .*$", ""),  # after the cause ortrain knows (export_ops.known_cause)
    (r" \(unhinted: (?:[^()]|\([^()]*\))*\)(\.)? *(\(Size-like symbols: [^)]*\))?", r"\1"),
    (r"\w+: No ONNX function found for <OpOverload\(op='([\w.]+)'.*", r"no ONNX function for \1"),
    (r"^GradientError: ", ""),
    (r" \(node '[^']*' in module '[^']*'\)", ""),
    (r"no gradient rule for op (\w+) lies between .*", r"no gradient rule for \1"),
    (r"gradient rule failed for op (\w+): ", r"the gradient rule of \1 refuses "),
    (r"(tracks running statistics in training through its own code), .*", r"\1"),
]  # fmt: skip


def shorten(cause: str, limit: int = 150) -> str:
    """A cause as the table shows it: the op and why, at most ``limit`` characters."""
    text = " ".join(cause.split())
    for pattern, repl in _SHORTER:
        text = re.sub(pattern, repl, text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _fallback_cause(trainer: ORTTrainer) -> tuple[str, str]:
    """(shortened, in full): why the whole model is not one graph, then each module left
    in eager whose cause is another."""
    seg = trainer.segments
    assert seg is not None
    detail = "; ".join(
        [f"whole model: {seg.cause}"]
        + [f"{p.name} ({p.status}): {p.cause}" for p in seg.model.fallbacks]
    )
    short = [shorten(seg.cause)]
    seen = {_unnamed(short[0])}
    for p in seg.model.fallbacks:
        cause = shorten(p.cause)
        if _unnamed(cause) not in seen:
            seen.add(_unnamed(cause))
            short.append(f"{p.name}: {cause}")
    return "; ".join(short), detail


def _unnamed(cause: str) -> str:
    """A cause without the names a module's own build gives its values (the unit as
    ``InstanceNorm1d 'unit'`` in the whole model, ``'InstanceNorm1d'`` alone)."""
    return re.sub(r"'[^']*'", "''", re.sub(r"\b\w+ '", "'", cause))


# ----------------------------------------------------------------------------- training
def train_against_eager(spec: Spec) -> Outcome:
    """Both sides' two steps, compared; the outcome (module docstring)."""
    start = time.perf_counter()
    batches = spec.batches(STEPS)
    model, ref = Harness(spec, batches[0]), Harness(spec, batches[0])
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    eager_losses, losses = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=LR), OPTIONS)
            for batch in batches:
                losses.append(trainer.train_step(*batch).detach().clone())
            trainer.sync_to_module()
        except Exception as exc:
            cause = f"{type(exc).__name__}: {first_line(exc)}"
            seconds = time.perf_counter() - start
            return Outcome(spec.id, REFUSED, shorten(cause), cause, seconds, not spec.random)
        for batch in batches:
            opt_ref.zero_grad()
            loss = ref(*batch)
            loss.backward()
            opt_ref.step()
            eager_losses.append(loss.detach().clone())
    seconds = time.perf_counter() - start
    if trainer.segments is None:
        kind, cause, detail = COMPILED, "", ""
    else:
        kind, (cause, detail) = FALLBACK, _fallback_cause(trainer)
    if spec.random:
        if not all(math.isfinite(float(v)) for v in losses):
            bad = f"non-finite losses {[float(v) for v in losses]}"
            return Outcome(spec.id, WRONG, bad, f"{detail}; {bad}", seconds, False)
        return Outcome(spec.id, kind, cause, detail, seconds, compared=False)
    wrong = _differences(
        {f"loss at step {i}": v for i, v in enumerate(losses)},
        {f"loss at step {i}": v for i, v in enumerate(eager_losses)},
        LOSS_RTOL,
        0.0,
    )
    wrong += _differences(
        dict(model.named_parameters()), dict(ref.named_parameters()), PARAM_RTOL, PARAM_ATOL
    )
    wrong += _differences(
        dict(model.named_buffers()), dict(ref.named_buffers()), PARAM_RTOL, PARAM_ATOL
    )
    if wrong:
        how = f"{kind}{f' ({cause})' if cause else ''} but disagrees with eager: "
        return Outcome(spec.id, WRONG, how + "; ".join(wrong[:3]), how + "; ".join(wrong), seconds)
    return Outcome(spec.id, kind, cause, detail, seconds)
