"""Optimizer state in torch's format, checked against the optimizer it is loaded into.

A state dict (``{"state": {index: {name: tensor}}, "param_groups": [...]}``, plus ortrain's
counters) reaches a trainer through ``ORTTrainer.load_state_dict``, checkpoint files and
``ORTHFTrainer``'s resume; ``ortrain/checkpoint.py`` runs these checks before it changes
anything. Each refusal is one ``CheckpointError`` (a ValueError, like torch's) naming what
and where, expected against found:

1. param groups of another count, or a group of another size (torch refuses both too);
2. another optimizer's groups: a hyperparameter this optimizer's update reads is missing
   (SGD's groups have no ``betas``) or one only another optimizer has is there
   (``bias_correction`` is Lamb's); whose they look like is said;
3. a flag ortrain refuses at construction (``maximize``, ``amsgrad``, nesterov with
   dampening: ``from_torch.group_spec``, the same rule), or a flag that would change the
   graph already built (``nesterov``, momentum zero or not, ``bias_correction``, Adam's
   ``decoupled_weight_decay``): the graph would go on with the flag it was built for;
4. per-parameter state: an index that names no parameter, state names other than this
   optimizer's (``momentum_buffer`` in AdamW), tensors not floating or of another shape;
5. a step (per parameter, or the trainer's) that is not a whole number >= 0, a micro-step
   outside the accumulation window, a loss scaler's state that is not one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ortrain.core.errors import CheckpointError, UnsupportedOptimizerError
from ortrain.core.optimizer_spec import EAGER, SHARDED_EAGER, OptimizerSpec
from ortrain.optim.from_torch import group_spec

_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "lamb": "Lamb"}
# the param_groups keys (besides lr and weight_decay) each kind's update reads
_GROUP_KEYS = {
    "sgd": ("momentum", "dampening", "nesterov"),
    "adam": ("betas", "eps"),
    "adamw": ("betas", "eps"),
    "lamb": ("betas", "eps", "bias_correction"),
}
_FLAGS = ("nesterov", "momentum", "bias_correction")  # GroupSpec's: the graph is built on them
WHERE = "optimizer state dict"


def _fail(what: str) -> CheckpointError:
    return CheckpointError(f"{WHERE}: {what}")


def _whose(group: Mapping[str, Any]) -> str:
    """Which torch optimizer a param group's keys look like."""
    if "bias_correction" in group:
        return "Lamb"
    if "betas" in group:
        decoupled = group.get("decoupled_weight_decay")
        return "Adam/AdamW" if decoupled is None else ("AdamW" if decoupled else "Adam")
    if "momentum" in group:
        return "SGD"
    return "another optimizer"


def whole_number(value: Any) -> int | None:
    """``value`` (a number, or a one-element tensor) as an int when it is a whole number
    >= 0; None otherwise (negative, fractional, NaN, a bool, not a number)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    v = float(value)
    return int(v) if math.isfinite(v) and v >= 0 and v == int(v) else None


def _check_group(kind: str, gi: int, saved: Any, ours: Mapping[str, Any], spec_flags: Any) -> None:
    if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), Sequence):
        raise _fail(f"param group {gi} is not a dict with a 'params' list")
    name = _NAMES[kind]
    if len(saved["params"]) != len(ours["params"]):
        raise _fail(
            f"param group {gi} holds {len(saved['params'])} parameters, the optimizer's holds "
            f"{len(ours['params'])}"
        )
    keys = _GROUP_KEYS[kind]
    missing = [k for k in keys if k not in saved]
    if missing:
        raise _fail(
            f"param group {gi} has no {', '.join(missing)}: expected {name}'s "
            f"{', '.join(keys)}; it has {', '.join(k for k in _group_keys(saved))}: "
            f"{_whose(saved)}'s"
        )
    others = {k for other, ks in _GROUP_KEYS.items() if other != kind for k in ks}
    foreign = sorted(k for k in saved if k in others and k not in keys and k not in ours)
    if foreign:
        raise _fail(
            f"param group {gi} has {', '.join(foreign)}: {_whose(saved)}'s, not {name}'s "
            f"(expected {', '.join(keys)})"
        )
    if kind in ("adam", "adamw") and saved.get("decoupled_weight_decay") is not None:
        decoupled = bool(saved["decoupled_weight_decay"])
        if decoupled != (kind == "adamw"):
            raise _fail(
                f"param group {gi}: decoupled_weight_decay={decoupled} ({_whose(saved)}'s "
                f"weight decay), this trainer's optimizer is {name}"
            )
    try:
        loaded = group_spec(kind, saved)
    except UnsupportedOptimizerError as exc:
        raise _fail(f"param group {gi}: {exc} (as at construction)") from None
    except (TypeError, ValueError):
        raise _fail(
            f"param group {gi}: momentum={saved.get('momentum')!r} is not a number"
        ) from None
    for flag in _FLAGS:
        built, got = getattr(spec_flags, flag), getattr(loaded, flag)
        if built != got:
            shown = saved.get(flag)
            if flag == "momentum":
                built = "a non-zero momentum (a momentum buffer)" if built else "momentum 0"
            raise _fail(
                f"param group {gi}: {flag}={shown}, the training graph was built for {built}"
            )
    for k in ("lr", "weight_decay", *(k for k in keys if k not in _FLAGS)):
        values = saved.get(k, 0.0)
        values = values if k == "betas" and isinstance(values, Sequence) else [values]
        if k == "betas" and len(values) != 2:
            raise _fail(f"param group {gi}: betas={saved[k]!r}, expected two numbers")
        if not all(_is_number(v) for v in values):
            raise _fail(f"param group {gi}: {k}={saved[k]!r} is not a number")


def _is_number(v: Any) -> bool:
    """A real number, or a one-element real tensor (torch takes a tensor ``lr``)."""
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and not v.is_complex()
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _group_keys(group: Mapping[str, Any]) -> list[str]:
    known = {k for ks in _GROUP_KEYS.values() for k in ks}
    return [k for k in group if k in known] or ["none of them"]


def check_optimizer_state(
    spec: OptimizerSpec,
    optimizer: torch.optim.Optimizer,
    names: Sequence[str],
    shapes: Mapping[str, torch.Size],
    opt: Any,
) -> None:
    """Raise ``CheckpointError`` unless ``opt`` is a torch state dict of ``optimizer``
    (whose parameters are ``names`` in index order, trained ones of ``shapes``)."""
    if not isinstance(opt, Mapping) or not {"state", "param_groups"} <= set(opt):
        raise CheckpointError(
            "the state dict's 'optimizer' needs torch's 'state' and 'param_groups' entries"
        )
    saved_groups, state = opt["param_groups"], opt["state"]
    if not isinstance(saved_groups, Sequence) or not isinstance(state, Mapping):
        raise _fail("'param_groups' must be a list and 'state' a dict")
    ours = optimizer.param_groups
    if len(saved_groups) != len(ours):
        raise _fail(f"{len(saved_groups)} param groups, the optimizer has {len(ours)}")
    own = spec.kind in (EAGER, SHARDED_EAGER)  # torch's own step reads its groups
    if own:
        for gi, (saved, group) in enumerate(zip(saved_groups, ours, strict=True)):
            n = len(saved.get("params", ())) if isinstance(saved, Mapping) else None
            if n != len(group["params"]):
                raise _fail(
                    f"param group {gi} holds {n} parameters, the optimizer's {len(group['params'])}"
                )
    if spec.kind == EAGER:  # its own state dict: torch's load_state_dict checks the rest
        return
    group_of: list[int] = []  # index -> its group
    for gi, (saved, group) in enumerate(zip(saved_groups, ours, strict=True)):
        if not own:
            _check_group(spec.kind, gi, saved, group, spec.groups[gi])
        group_of += [gi] * len(group["params"])
    for idx, entry in state.items():
        i = idx if isinstance(idx, int) and not isinstance(idx, bool) else None
        if isinstance(idx, str) and idx.isdigit():
            i = int(idx)
        if i is None or not 0 <= i < len(names):
            raise _fail(
                f"optimizer state index {idx!r} names no parameter (expected 0 to "
                f"{len(names) - 1}, in param group order)"
            )
        _check_entry(spec, spec.groups[group_of[i]], names[i], i, entry, shapes)


def _check_entry(
    spec: OptimizerSpec,
    group: Any,
    name: str,
    index: int,
    entry: Any,
    shapes: Mapping[str, torch.Size],
) -> None:
    where = f"optimizer state of parameter {name} (index {index})"
    if not isinstance(entry, Mapping):
        raise _fail(f"{where} is a {type(entry).__name__}, not a dict")
    steps = ("step",) if spec.counts_steps else ()
    expected = [*steps, *spec.state_names(group), *spec.scalars]
    if set(entry) != set(expected):
        whose = _NAMES.get(spec.kind, spec.source.rsplit(".", 1)[-1])
        raise _fail(
            f"{where}: expected {', '.join(expected) or 'none'} ({whose}'s), got "
            f"{', '.join(sorted(map(str, entry))) or 'none'}"
        )
    for s, t in entry.items():
        if s == "step":
            if whole_number(t) is None:
                shown = float(t) if isinstance(t, torch.Tensor) and t.numel() == 1 else t
                raise _fail(f"{where}: step must be a whole number >= 0, got {shown}")
            continue
        if s in spec.scalars:  # a number per parameter (NAdam's mu_product)
            if not isinstance(t, torch.Tensor) or t.numel() != 1 or not t.is_floating_point():
                raise _fail(f"{where}: '{s}' is not a one-element floating-point tensor")
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise _fail(f"{where}: '{s}' is not a floating-point tensor")
        if name in shapes and tuple(t.shape) != tuple(shapes[name]):
            raise _fail(
                f"{where}: '{s}' has shape {tuple(t.shape)}, the parameter {tuple(shapes[name])}"
            )


def check_counters(extra: Any, accumulation: int, has_scaler: bool) -> None:
    """ortrain's own entry of a state dict: the step, the micro-step, the loss scaler."""
    where = "the state dict's 'ortrain' entry"
    if not isinstance(extra, Mapping):
        raise CheckpointError(f"{where} is a {type(extra).__name__}, not a dict")
    if "step" in extra and whole_number(extra["step"]) is None:
        raise CheckpointError(f"{where}: step must be a whole number >= 0, got {extra['step']}")
    if "micro_step" in extra:
        micro = whole_number(extra["micro_step"])
        if micro is None or micro >= accumulation:
            raise CheckpointError(
                f"{where}: micro_step must be in [0, {accumulation}) (grad_accumulation_steps), "
                f"got {extra['micro_step']}"
            )
    scaler = extra.get("loss_scaler")
    if has_scaler and scaler is not None:
        counts = ("good_steps", "overflows_left", "skipped_steps")
        is_dict = isinstance(scaler, Mapping)
        ok = is_dict and all(whole_number(scaler.get(k)) is not None for k in counts)
        scale = scaler.get("scale") if is_dict else None
        if not ok or not isinstance(scale, numbers.Real) or not 0 < scale < math.inf:
            raise CheckpointError(
                f"{where}: loss_scaler must hold a finite scale > 0 and whole numbers "
                f"{', '.join(counts)}, got {scaler!r}"
            )
