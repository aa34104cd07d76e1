"""Sharded checkpoints (ZeRO-1): a directory holding every rank's shard and a manifest.

    <dir>/manifest.json               written last, atomically, by rank 0
    <dir>/<id>.model.pt               rank 0: module state dict, param groups, step
    <dir>/<id>.rank<r>-of-<n>.pt      rank r: its shard of each optimizer-state buffer

``<id>`` is new for every save and the manifest names the files of its own save, so a
crash in the middle of a save leaves the previous checkpoint whole; a save that fails on
any rank removes the files it wrote, and the next complete save removes files that no
manifest names. The ``.pt`` files carry checksums (``ortrain.checkpoint.write_file``), the
manifest a SHA-256 of its own contents; both are verified on load. Loading with the same
world size and layout reads only the rank's own shard; any other world size (one process
included, through ``read_any`` / ``load_any``) rebuilds the ordinary full state dict from
all the shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ortrain import checkpoint
from ortrain.core.errors import CheckpointError
from ortrain.core.optimizer_spec import EAGER, SHARDED_EAGER
from ortrain.runtime.flat_layout import FlatLayout
from ortrain.safe_files import atomic_write

if TYPE_CHECKING:
    from ortrain.distributed.comm import Comm
    from ortrain.distributed.shard_config import ShardConfig
    from ortrain.runtime.training_state import TrainingState

FORMAT = "ortrain.sharded-checkpoint/1"
MANIFEST = "manifest.json"
# this module's files, and the temporary files a crash in the middle of writing one left
# (``safe_files.atomic_write``: ".<name>.<random>.tmp")
_OWN_FILE = re.compile(
    r"^(\.)?([0-9a-f]{12}\.(model|rank\d+-of-\d+)\.pt|manifest\.json)(?(1)\.\w+\.tmp)$"
)
MODEL_KEYS = frozenset({"model", "optimizer", "ortrain"})
SHARD_KEYS = frozenset({"rank", "state"})
MANIFEST_KEYS = frozenset(
    {"format", "optimizer_kind", "world_size", "step", "layout", "state_names"}
    | {"index_names", "state_of", "model", "shards"}
)


class ShardedState(Protocol):
    """What a sharded checkpoint reads and loads of a ZeRO reducer
    (``sharded_state.ShardedState`` and its subclasses)."""

    comm: Comm
    config: ShardConfig
    world_size: int
    state: dict[str, torch.Tensor]  # this rank's shard of each optimizer-state buffer
    stateful: set[str]  # parameters with optimizer state

    def load_state_dict(self, training: TrainingState, state: Mapping[str, Any]) -> None: ...

    def load_shards(
        self,
        training: TrainingState,
        base: Mapping[str, Any],
        shard: Mapping,
        stateful: set[str],
        scalars: Mapping[str, Mapping[str, float]],
    ) -> None: ...


def is_sharded(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST).is_file()


def _load(path: Path, keys: frozenset[str]) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"sharded checkpoint file {path} is missing")
    payload = checkpoint.read_file(path, keys)
    checkpoint.check_keys(payload, keys, path)
    return payload


def _digest(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def _remove(files: list[Path]) -> None:
    for f in files:
        try:
            f.unlink(missing_ok=True)
        except OSError:
            pass


def save(training: TrainingState, sharded: ShardedState, path: str | os.PathLike) -> None:
    """Collective: every rank writes its shard, then rank 0 the manifest."""
    comm, cfg = sharded.comm, sharded.config
    path = Path(path)
    n = comm.world_size
    save_id = comm.broadcast_object(uuid.uuid4().hex[:12] if comm.rank == 0 else None)
    shards = [f"{save_id}.rank{r:05d}-of-{n:05d}.pt" for r in range(n)]
    model = f"{save_id}.model.pt"
    error: Exception | None = None
    written = [path / shards[cfg.rank]] + ([path / model] if comm.rank == 0 else [])
    try:  # any exception: a rank that raised alone would leave the others in comm.any
        path.mkdir(parents=True, exist_ok=True)
        checkpoint.write_file({"rank": cfg.rank, "state": dict(sharded.state)}, written[0])
        if comm.rank == 0:
            checkpoint.write_file(checkpoint.trainer_state_dict(training, opt_state={}), written[1])
    except Exception as exc:
        error = exc
    if comm.any(error is not None):
        _remove(written)  # this save's parts; the previous manifest's files are untouched
        raise CheckpointError(
            f"a rank could not write its part of {path}: {error}; the parts of this save were "
            "removed, the previous checkpoint there (if any) is intact"
        ) from error
    committed = False
    if comm.rank == 0:
        try:
            manifest = _manifest(training, sharded, model, shards)
            manifest["sha256"] = _digest(manifest)
            text = json.dumps(manifest, indent=1).encode()
            # the commit point of the save (a new temporary file renamed over the manifest)
            atomic_write(path / MANIFEST, lambda f: f.write(text))
            committed = True
            keep = {model, *shards, MANIFEST}
            for f in path.iterdir():
                if _OWN_FILE.match(f.name) and f.name not in keep:
                    f.unlink()
        except Exception as exc:
            error = exc
    if comm.any(error is not None):  # also the barrier: nobody returns before the commit
        if not comm.broadcast_object(committed if comm.rank == 0 else None):
            _remove(written)  # not committed: this save's parts go
        raise CheckpointError(f"rank 0 could not write the manifest of {path}: {error}")


def _manifest(
    training: TrainingState, sharded: ShardedState, model: str, shards: list[str]
) -> dict:
    spec, stateful = training.spec, sharded.stateful
    state_of = {}
    if training.step > 0:  # torch keeps no state before the first step either
        for g in spec.groups:
            state_of.update({p: list(spec.state_names(g)) for p in g.params if p in stateful})
    return {
        "format": FORMAT,
        "model_class": type(training.module).__name__,
        "optimizer_kind": spec.kind,
        "counts_steps": spec.counts_steps,  # torch's state holds a step per parameter
        "world_size": sharded.world_size,
        "step": training.step,
        "layout": sharded.config.layout.to_json(),
        "state_names": list(sharded.config.state_names),
        "index_names": checkpoint.index_names(training),
        "state_of": state_of,
        # an optimizer's own numbers per parameter (NAdam's mu_product), every rank's alike
        "scalars": sharded.scalars if training.step > 0 else {},
        "model": model,
        "shards": shards,
    }


def read_manifest(training: TrainingState, path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable sharded checkpoint: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an ortrain sharded checkpoint ({FORMAT})")
    digest = manifest.pop("sha256", None)
    if digest is None:
        warnings.warn(
            f"sharded checkpoint {path} has no manifest checksum (written before ortrain kept "
            "them): its manifest cannot be verified",
            stacklevel=3,
        )
    elif digest != _digest(manifest):
        raise CheckpointError(
            f"sharded checkpoint {path} is damaged: {MANIFEST} fails its checksum"
        )
    checkpoint.check_keys(manifest, MANIFEST_KEYS, path / MANIFEST)
    kinds = {manifest["optimizer_kind"], training.spec.kind}
    # (an elementwise optimizer's state saved under ZeRO loads into its own step: torch's
    # format once consolidated)
    if len(kinds) > 1 and kinds != {EAGER, SHARDED_EAGER}:
        raise CheckpointError(
            f"{path} holds {manifest['optimizer_kind']} optimizer state, this trainer uses "
            f"{training.spec.kind}"
        )
    return manifest


def consolidate(path: str | os.PathLike, manifest: dict[str, Any]) -> dict[str, Any]:
    """The ordinary full state dict (torch formats) rebuilt from all the shards."""
    path = Path(path)
    state = _load(path / manifest["model"], MODEL_KEYS)
    layout = FlatLayout.from_json(manifest["layout"])
    parts = [_load(path / f, SHARD_KEYS)["state"] for f in manifest["shards"]]
    views = {s: layout.views(torch.cat([p[s] for p in parts])) for s in manifest["state_names"]}
    step = torch.tensor(float(manifest["step"]))
    counts_steps = manifest.get("counts_steps", manifest["optimizer_kind"] != "sgd")
    opt: dict[int, dict[str, torch.Tensor]] = {}
    for idx, name in enumerate(manifest["index_names"]):
        names = manifest["state_of"].get(name)
        if names:
            opt[idx] = {s: views[s][name].clone() for s in names}
            if counts_steps:  # as torch's Adam-type state
                opt[idx]["step"] = step.clone()
        numbers = manifest.get("scalars", {}).get(name)
        if numbers:
            opt.setdefault(idx, {}).update({s: torch.tensor(v) for s, v in numbers.items()})
    state["optimizer"]["state"] = opt
    return state


def read_consolidated(training: TrainingState, path: str | os.PathLike) -> dict[str, Any]:
    return consolidate(path, read_manifest(training, path))


def read_any(training: TrainingState, path: str | os.PathLike) -> dict[str, Any]:
    """The full state dict in a checkpoint of either kind: a file, or a sharded folder
    (consolidated: any world size, a single process included, reads it)."""
    if is_sharded(Path(path)):
        return read_consolidated(training, path)
    return checkpoint.read(training, path)


def load_any(training: TrainingState, path: str | os.PathLike, *, window: bool = False) -> None:
    """``window``: one process (an open accumulation window resumes)."""
    state = read_any(training, path)
    with checkpoint.naming(path):
        checkpoint.load_trainer_state_dict(training, state, window=window)


def load(training: TrainingState, sharded: ShardedState, path: str | os.PathLike) -> None:
    """Load a sharded checkpoint (own shard only when the layout matches) or an ordinary
    checkpoint file (re-sharded)."""
    path = Path(path)
    if not is_sharded(path):
        state = checkpoint.read(training, path)
        with checkpoint.naming(path):
            sharded.load_state_dict(training, state)
        return
    manifest = read_manifest(training, path)
    if FlatLayout.from_json(manifest["layout"]) != sharded.config.layout:
        state = consolidate(path, manifest)  # another world size
        with checkpoint.naming(path):
            sharded.load_state_dict(training, state)
        return
    shard = _load(path / manifest["shards"][sharded.config.rank], SHARD_KEYS)
    n = sharded.config.layout.shard_numel
    for s in sharded.config.state_names:
        if s not in shard["state"] or shard["state"][s].numel() != n:
            raise CheckpointError(f"{manifest['shards'][sharded.config.rank]}: no {n}-element {s}")
    base = _load(path / manifest["model"], MODEL_KEYS)
    with checkpoint.naming(path):
        scalars = manifest.get("scalars", {})
        sharded.load_shards(training, base, shard["state"], set(manifest["state_of"]), scalars)
