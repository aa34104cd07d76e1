"""Trainer state in ordinary PyTorch formats.

``state_dict()`` is ``{"model": module.state_dict(), "optimizer": <torch optimizer
state_dict format>}``, so it loads into eager PyTorch too (and an eager optimizer's
state dict loads here). Tensors that share memory in the module (tied weights) share it in
the state dict too, so ``torch.save`` stores them once.

Checkpoint files (``write_file``/``read_file``, also used by the sharded checkpoints):
1. carry a CRC-32 of every tensor's bytes and a SHA-256 of everything else (names,
   shapes, dtypes, settings), checked on load: a damaged file raises ``CheckpointError``
   naming the damaged tensor; files written before checksums load with a warning;
2. are written to a new temporary file of a random name beside the target (never a fixed
   ``<name>.tmp``: a symlink planted there is not followed; ``ortrain/safe_files.py``),
   synced, then renamed: a failed or interrupted write never touches the previous
   checkpoint, and the partial file is removed;
3. are refused before writing anything when the filesystem has less space free than
   their tensors need.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import warnings
import zlib
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ortrain.core.errors import CheckpointError, first_line
from ortrain.core.names import state_key
from ortrain.core.optimizer_spec import EAGER, SHARDED_EAGER
from ortrain.optim.state_check import check_counters, check_optimizer_state
from ortrain.safe_files import atomic_write

if TYPE_CHECKING:
    from ortrain.runtime.training_state import TrainingState

FORMAT = "ortrain.checkpoint/1"
PAYLOAD_KEYS = frozenset({"format", "model_class", "optimizer_kind", "state"})
CHECKSUMS = "checksums"  # top-level key of every file write_file makes
# Bytes a file needs at least beyond its tensors' (zip headers, the pickle): an estimate on
# the low side, so that the space check never refuses a checkpoint that would fit.
_OVERHEAD_PER_TENSOR = 256
_OVERHEAD = 16 << 10


def index_names(training: TrainingState) -> list[str]:
    """Parameter names in torch's optimizer-state index order."""
    by_id = {id(p): n for n, p in training.module.named_parameters()}
    return [by_id[id(p)] for g in training.optimizer.param_groups for p in g["params"]]


def _view_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _clone_model_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` cloned, tensors that are one tensor in the module (tied
    weights) cloned once: both keys hold the same tensor, stored once by torch.save."""
    clones: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, v in module.state_dict().items():
        key = _view_key(v)
        if key not in clones:
            clones[key] = v.detach().clone()
        out[k] = clones[key]
    return out


def trainer_state_dict(
    training: TrainingState,
    opt_state: Mapping[str, torch.Tensor] | None = None,
    *,
    saved: bool = True,
    window: bool = False,
) -> dict[str, Any]:
    """``opt_state``: full per-parameter optimizer state, where ``training``'s is not
    (ZeRO-1 gathers its shards); default ``training.opt_state``. ``saved``: the state
    leaves the trainer (a checkpoint, ``state_dict()``), not only its optimizer;
    ``window``: with an open accumulation window's gradients (one process: they are all
    here), else the window is not kept (see ``_window_start``)."""
    st = training
    opt_state = st.opt_state if opt_state is None else opt_state
    st.sync_to_module()
    model = _clone_model_state(training.module)
    extra: dict[str, Any] = {"step": st.step}
    if window and st.micro_step and st.grads:
        extra["micro_step"] = st.micro_step
        extra["window_grads"] = {n: g.detach().clone() for n, g in st.grads.items()}
    else:
        extra["micro_step"] = _window_start(st, saved)
    if st.scaler is not None:
        extra["loss_scaler"] = st.scaler.state_dict()
    if training.spec.kind == EAGER:  # the optimizer keeps its state: its own state dict
        own = _cloned(training.optimizer.state_dict())
        return {"model": model, "optimizer": own, "ortrain": extra}
    return {
        "model": model,
        "optimizer": optimizer_state_dict(training, opt_state),
        "ortrain": extra,
    }


def _window_start(training: TrainingState, saved: bool) -> int:
    """The micro-step a state saved without its window's gradients resumes at: 0.
    Mid-window the parameters are still the window's start; resuming at the saved
    micro-step would end the window on fewer micro-batches' gradients (divided by the
    whole window's count). As in eager, where ``.grad`` is in no state dict, the resumed
    run starts a window, and this warns that those micro-batches are not in it (ranks
    hold their own partial sums: a distributed state is saved so)."""
    st = training
    window = st.accumulation
    if saved and st.micro_step:
        warnings.warn(
            f"ortrain: state saved at micro-step {st.micro_step} of a {window}-micro-step "
            "accumulation window: its gradients so far are not saved, so a run resumed "
            "from it starts a new window without those micro-batches; save after a "
            "window's last micro-step (trainer.micro_step == 0) or after "
            "trainer.apply_update()",
            stacklevel=4,
        )
    return 0


def optimizer_state_dict(
    training: TrainingState, opt_state: Mapping[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """The optimizer's state in torch's format (what ``optimizer.state_dict()`` gives in
    eager), from ortrain's state of a compiled update."""
    st = training
    opt_state = st.opt_state if opt_state is None else opt_state
    names = index_names(training)
    state: dict[int, dict[str, torch.Tensor]] = {}
    group_of = {n: g for g in training.spec.groups for n in g.params}
    for idx, name in enumerate(names):
        group = group_of.get(name)
        if group is None or st.step == 0:
            continue  # frozen, or no update yet: torch has no state either
        tensors = {
            s: opt_state[state_key(s, name)].clone()
            for s in (*training.spec.state_names(group), *training.spec.scalars)
            if state_key(s, name) in opt_state
        }
        if not tensors:
            continue
        if training.spec.counts_steps:
            tensors["step"] = torch.tensor(float(st.step))
        state[idx] = tensors
    groups = []
    start = 0
    for g in training.optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return {"state": state, "param_groups": groups}


def uneven_steps(state: Mapping[str, Any]) -> str:
    """ "" where every parameter of a torch-format state dict took the same number of
    steps (or it has none); else the counts seen ("3 and 5"): a model whose steps reach
    different parameters, trained with the optimizer's own step."""
    opt = state.get("optimizer") if isinstance(state, Mapping) else None
    entries = opt.get("state") if isinstance(opt, Mapping) else None
    if not isinstance(entries, Mapping):
        return ""
    counts = {
        float(e["step"])
        for e in entries.values()
        if isinstance(e, Mapping) and isinstance(e.get("step"), torch.Tensor | int | float)
    }
    return " and ".join(f"{c:g}" for c in sorted(counts)) if len(counts) > 1 else ""


def _cloned(obj: Any) -> Any:
    """``obj`` with every tensor in it cloned (a torch optimizer's state dict refers to its
    live state)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, Mapping):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cloned(v) for v in obj)
    return obj


def _check_model(training: TrainingState, model: Any) -> None:
    if not isinstance(model, Mapping):
        raise CheckpointError(f"the state dict's 'model' is a {type(model).__name__}, not a dict")
    own = training.module.state_dict()
    missing = sorted(set(own) - set(model))
    extra = sorted(set(model) - set(own))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint does not match {type(training.module).__name__}: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    for k, v in own.items():
        if not isinstance(model[k], torch.Tensor):
            raise CheckpointError(f"checkpoint entry '{k}' is not a tensor")
        if tuple(model[k].shape) != tuple(v.shape):
            raise CheckpointError(
                f"checkpoint tensor '{k}' has shape {tuple(model[k].shape)}, the model expects "
                f"{tuple(v.shape)}"
            )


def _check_optimizer(training: TrainingState, state: Mapping[str, Any]) -> None:
    """The optimizer's state and ortrain's counters, against the trainer's optimizer
    (``ortrain/optim/state_check.py``)."""
    shapes = {n: p.shape for n, p in training.params.items()}
    check_optimizer_state(
        training.spec, training.optimizer, index_names(training), shapes, state["optimizer"]
    )
    st = training
    check_counters(state.get("ortrain", {}), st.accumulation, st.scaler is not None)


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """A ``CheckpointError`` raised inside names the checkpoint ``path`` it came from."""
    try:
        yield
    except CheckpointError as exc:
        if str(path) in str(exc):
            raise
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc


def load_trainer_state_dict(
    training: TrainingState,
    state: Mapping[str, Any],
    *,
    opt_state: MutableMapping[str, torch.Tensor] | None = None,
    window: bool = False,
) -> None:
    """``opt_state``: where the full per-parameter optimizer state goes (ZeRO-1 passes an
    empty dict and keeps its shard of it); default the trainer's state's. ``window``: an
    open accumulation window saved with its gradients resumes (one process; ranks would
    each add them), else it starts anew."""
    st = training
    opt_state = st.opt_state if opt_state is None else opt_state
    if not isinstance(state, Mapping) or "model" not in state or "optimizer" not in state:
        raise CheckpointError("state dict needs 'model' and 'optimizer' entries")
    _check_model(training, state["model"])
    _check_optimizer(training, state)
    opt = state["optimizer"]
    if training.spec.kind != EAGER and (counts := uneven_steps(state)):
        # saved after the update moved to the optimizer's own step: it goes there again
        if training.update_in_eager is None:
            raise CheckpointError(f"its parameters took {counts} optimizer steps")
        training.update_in_eager(f"the checkpoint's parameters took {counts} steps")
    # Validated: now change things.
    with torch.no_grad():
        training.module.load_state_dict(state["model"])
        for n, b in training.module.named_buffers():
            st.buffers[n].copy_(b)
        if training.spec.kind == EAGER:  # its own state dict, into the optimizer itself
            try:
                training.optimizer.load_state_dict(_cloned(opt))
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"the optimizer's state: {exc}") from exc
            ours = state.get("ortrain", {})
            st.set_counters(int(ours.get("step", 0)), _load_window(training, ours, window))
            scaler_state = ours.get("loss_scaler")
            if st.scaler is not None and scaler_state is not None:
                st.scaler.load_state_dict(scaler_state)
            return
        _load_moments(training, opt, opt_state)
        step = int(state.get("ortrain", {}).get("step", max(_steps(opt))))
        st.set_counters(step, _load_window(training, state.get("ortrain", {}), window))
        scaler_state = state.get("ortrain", {}).get("loss_scaler")
        if st.scaler is not None and scaler_state is not None:
            st.scaler.load_state_dict(scaler_state)
        for g, saved in zip(training.optimizer.param_groups, opt["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})


def _load_window(training: TrainingState, ours: Mapping[str, Any], window: bool) -> int:
    """The micro-step to resume at, the open window's gradients added to the sums when
    that window's micro-step ends (``TrainingState.window_grads``); a window that cannot
    resume (saved without them, another window length, ranks) starts anew, with a
    warning."""
    micro = int(ours.get("micro_step", 0))
    grads = ours.get("window_grads")
    training.window_grads = None
    if not micro:
        return 0
    if grads is None or not window or micro >= training.accumulation:
        why = (
            "without its gradients"
            if grads is None
            else "into ranks that would each add its gradients"
            if not window
            else f"for a window of more than {training.accumulation} micro-steps"
        )
        warnings.warn(
            f"ortrain: the checkpoint was saved at micro-step {micro} of an accumulation "
            f"window; loaded {why}, training resumes at a new window's start",
            stacklevel=5,
        )
        return 0
    training.zero_grads()  # a window this trainer had open is not the checkpoint's
    training.window_grads = dict(grads)
    return micro


def _steps(opt: Mapping[str, Any]) -> list[float]:
    return [0.0, *(float(e["step"]) for e in opt["state"].values() if "step" in e)]


def _load_moments(
    training: TrainingState, opt: Mapping[str, Any], opt_state: MutableMapping[str, torch.Tensor]
) -> None:
    """A torch-format optimizer state's per-parameter tensors into ``opt_state``."""
    names = index_names(training)
    for idx, entry in opt["state"].items():
        name = names[int(idx)]
        for s, t in entry.items():
            if s == "step":
                continue
            key = state_key(s, name)
            if key in opt_state:
                opt_state[key].copy_(t)
            else:
                opt_state[key] = t.detach().to(torch.float32).clone().contiguous()


def load_optimizer_state_dict(training: TrainingState, opt: Mapping[str, Any]) -> None:
    """A torch-format optimizer state dict (``optimizer.load_state_dict`` of a compiled
    update's optimizer) into ortrain's state: the moments, and the step count their bias
    correction reads. A state without entries clears the moments, as torch's would start
    from none. Checked first (``ortrain/optim/state_check.py``)."""
    st = training
    _check_optimizer(training, {"optimizer": opt})
    if counts := uneven_steps({"optimizer": opt}):
        raise CheckpointError(
            f"its parameters took {counts} optimizer steps; ortrain's compiled update counts "
            "one step for all (trainer.load_state_dict takes such a state)"
        )
    if not opt["state"]:
        for t in st.opt_state.values():
            t.zero_()
    else:
        _load_moments(training, opt, st.opt_state)
    steps = _steps(opt)
    # SGD's state counts no steps: "some update happened" is what its moments say
    step = max(st.step, 1) if opt["state"] and len(steps) == 1 else int(max(steps))
    st.set_counters(step, st.micro_step)


# ---------------------------------------------------------------------------------------
# Checksums


def tensor_checksum(t: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (in row-major order, whatever its strides)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy())


def _join(where: str, key: Any) -> str:
    return f"{where}/{key}" if where else str(key)


def _describe(obj: Any, where: str, sums: dict[str, int], memo: dict[tuple, int]) -> str:
    """A canonical text of ``obj`` (tensors as dtype, shape and CRC); fills ``sums`` with
    each tensor's CRC by its path (``state/model/lm_head.weight``)."""
    if isinstance(obj, torch.Tensor):
        key = _view_key(obj)
        if key not in memo:  # a tied tensor is summed once
            memo[key] = tensor_checksum(obj)
        sums[where] = memo[key]
        return f"T({obj.dtype},{tuple(obj.shape)},{memo[key]})"
    if isinstance(obj, Mapping):
        items = (f"{k!r}:{_describe(v, _join(where, k), sums, memo)}" for k, v in obj.items())
        return "{" + ",".join(items) + "}"
    if isinstance(obj, (list, tuple)):
        parts = ",".join(_describe(v, _join(where, i), sums, memo) for i, v in enumerate(obj))
        return f"[{parts}]" if isinstance(obj, list) else f"({parts})"
    return f"{type(obj).__name__}:{obj!r}"


def checksums(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``{"tensors": {path: crc32}, "structure": sha256}`` of ``obj``."""
    sums: dict[str, int] = {}
    text = _describe(obj, "", sums, {})
    return {"tensors": sums, "structure": hashlib.sha256(text.encode()).hexdigest()}


def verify(obj: Mapping[str, Any], expected: Any, path: Path) -> None:
    """Raise CheckpointError naming what in ``obj`` differs from ``expected`` checksums."""
    if not isinstance(expected, Mapping) or not {"tensors", "structure"} <= set(expected):
        raise CheckpointError(f"checkpoint {path} is damaged: its checksum table is unreadable")
    actual = checksums(obj)
    for name, crc in expected["tensors"].items():
        if name in actual["tensors"] and actual["tensors"][name] != crc:
            raise CheckpointError(
                f"checkpoint {path} is damaged: tensor '{name}' does not match its checksum"
            )
    if actual["structure"] != expected["structure"]:
        missing = sorted(set(expected["tensors"]) - set(actual["tensors"]))
        what = f"tensors {missing[:3]} are missing" if missing else "names, shapes or settings"
        raise CheckpointError(
            f"checkpoint {path} is damaged: its contents do not match their checksum ({what})"
        )


# ---------------------------------------------------------------------------------------
# Files


def _needed_bytes(obj: Any) -> int:
    """About how many bytes torch.save writes for ``obj`` (tensor storages counted once)."""
    storages: dict[int, int] = {}
    count = 0

    def walk(o: Any) -> None:
        nonlocal count
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            count += 1
        elif isinstance(o, Mapping):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return sum(storages.values()) + count * _OVERHEAD_PER_TENSOR + _OVERHEAD


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc`` (torch's writer reports a failed write as a RuntimeError
    whose context is the file object's OSError)."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _previous(path: Path) -> str:
    return (
        f"the previous checkpoint at {path} is intact"
        if path.exists()
        else f"nothing was written at {path}"
    )


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable; some filesystems cannot sync a directory (then it is moot)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(obj: Mapping[str, Any], path: str | os.PathLike) -> None:
    """``torch.save(obj + checksums)`` to ``path`` atomically; any failure removes the
    partial file and raises CheckpointError, leaving what was at ``path`` as it was."""
    path = Path(path)
    needed = _needed_bytes(obj)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create the directory of {path}: {exc}") from exc
    free = _free_bytes(path.parent)
    if free is not None and free < needed:
        raise CheckpointError(
            f"not enough space for checkpoint {path}: it needs about {_size(needed)}, "
            f"{_size(free)} are free; {_previous(path)}"
        )
    payload = {**obj, CHECKSUMS: checksums(obj)}
    try:  # atomic: a crash never leaves a half-written checkpoint; the partial file goes
        atomic_write(path, lambda f: torch.save(payload, f))
    except Exception as exc:  # (KeyboardInterrupt & co. pass through, cleaned up)
        os_error = _os_error(exc)
        cause = os_error.strerror if os_error is not None and os_error.strerror else None
        free = _free_bytes(path.parent)
        room = f" ({_size(free)} free, it needs about {_size(needed)})" if free is not None else ""
        raise CheckpointError(
            f"writing checkpoint {path} failed: {cause or first_line(exc)}{room}; the partial "
            f"file was removed and {_previous(path)}"
        ) from exc
    _fsync_dir(path.parent)


def read_file(path: str | os.PathLike, known: frozenset[str] | set[str]) -> dict[str, Any]:
    """A file written by ``write_file`` (or an older, checksum-less one, with a warning),
    its checksums verified and removed. ``known``: the top-level keys such a file holds
    (more in a file without checksums means a damaged one)."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a folder but not a sharded checkpoint (no manifest.json in it): give a "
            "checkpoint file, or the folder a sharded save wrote"
        )
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {first_line(exc)}") from exc
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path} is not an ortrain checkpoint")
    sums = payload.pop(CHECKSUMS, None)
    if sums is not None:
        verify(payload, sums, path)
    elif set(payload) - set(known):
        raise CheckpointError(
            f"{path} is not an ortrain checkpoint, or a damaged one: no checksums, unexpected "
            f"entries {sorted(map(str, set(payload) - set(known)))[:3]}"
        )
    else:
        warnings.warn(
            f"checkpoint {path} has no checksums (written before ortrain kept them): its "
            "contents cannot be verified",
            stacklevel=3,
        )
    return payload


def check_keys(payload: Mapping[str, Any], required: frozenset[str], path: Path) -> None:
    missing = sorted(required - set(payload))
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {', '.join(map(repr, missing))}: not written by ortrain, "
            "or damaged"
        )


def save(training: TrainingState, path: str | os.PathLike, *, window: bool = False) -> None:
    """``window``: with an open accumulation window's gradients (one process)."""
    payload = {
        "format": FORMAT,
        "model_class": type(training.module).__name__,
        "optimizer_kind": training.spec.kind,
        "state": trainer_state_dict(training, window=window),
    }
    write_file(payload, path)


def read(training: TrainingState, path: str | os.PathLike) -> dict[str, Any]:
    """The state dict in checkpoint file ``path``, checked against ``training``'s optimizer
    (a sharded checkpoint's folder: ``distributed.sharded_checkpoint.read_any``)."""
    path = Path(path)
    payload = read_file(path, PAYLOAD_KEYS)
    if payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an ortrain checkpoint ({FORMAT})")
    check_keys(payload, PAYLOAD_KEYS, path)
    saved = payload["optimizer_kind"]
    # saved after the update moved to the optimizer's own step (layers frozen for a
    # while, a LayerDrop): torch's format, checked against this trainer's optimizer when
    # loaded, and the update moves there again where its steps are uneven
    # both in torch's format: an elementwise optimizer's state saved under ZeRO, loaded by
    # one process where its step keeps its own, or the other way
    torch_format = {saved, training.spec.kind} == {EAGER, SHARDED_EAGER}
    if (
        saved != training.spec.kind
        and not (saved == EAGER and training.spec.kind != EAGER)
        and not torch_format
    ):
        raise CheckpointError(
            f"{path} holds {payload['optimizer_kind']} optimizer state, this trainer uses "
            f"{training.spec.kind}"
        )
    return payload["state"]
