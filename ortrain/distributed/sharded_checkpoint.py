"""Sharded checkpoints (ZeRO-1): a directory holding every rank's shard and a manifest.

    <dir>/manifest.json               written last, atomically, by rank 0
    <dir>/<id>.model.pt               rank 0: module state dict, param groups, step
    <dir>/<id>.rank<r>-of-<n>.pt      rank r: its shard of each optimizer-state buffer

``<id>`` is new for every save and the manifest names the files of its own save, so a
crash in the middle of a save leaves the previous checkpoint whole; the next complete
save removes files that no manifest names. Loading with the same world size and layout
reads only the rank's own shard; any other world size (one process included, through
``ortrain.checkpoint.load``) rebuilds the ordinary full state dict from all the shards.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ortrain import checkpoint
from ortrain.distributed.layout import FlatLayout
from ortrain.errors import CheckpointError

if TYPE_CHECKING:
    from ortrain.distributed.sharded_state import ShardedState
    from ortrain.trainer import ORTTrainer

FORMAT = "ortrain.sharded-checkpoint/1"
MANIFEST = "manifest.json"
_OWN_FILE = re.compile(r"^[0-9a-f]{12}\.(model|rank\d+-of-\d+)\.pt(\.tmp)?$")


def is_sharded(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST).is_file()


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _load(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"sharded checkpoint file {path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc


def save(trainer: ORTTrainer, sharded: ShardedState, path: str | os.PathLike) -> None:
    """Collective: every rank writes its shard, then rank 0 the manifest."""
    comm, cfg = sharded.comm, sharded.config
    path = Path(path)
    n = comm.world_size
    save_id = comm.broadcast_object(uuid.uuid4().hex[:12] if comm.rank == 0 else None)
    shards = [f"{save_id}.rank{r:05d}-of-{n:05d}.pt" for r in range(n)]
    model = f"{save_id}.model.pt"
    error: Exception | None = None
    try:
        path.mkdir(parents=True, exist_ok=True)
        _atomic_save({"rank": cfg.rank, "state": dict(sharded.state)}, path / shards[cfg.rank])
        if comm.rank == 0:
            _atomic_save(checkpoint.trainer_state_dict(trainer, opt_state={}), path / model)
    except OSError as exc:
        error = exc
    if comm.any(error is not None):
        raise CheckpointError(f"a rank could not write its part of {path}: {error}") from error
    if comm.rank == 0:
        try:
            manifest = _manifest(trainer, sharded, model, shards)
            tmp = path / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, path / MANIFEST)  # the commit point of the save
            keep = {model, *shards}
            for f in path.iterdir():
                if _OWN_FILE.match(f.name) and f.name not in keep:
                    f.unlink()
        except OSError as exc:
            error = exc
    if comm.any(error is not None):  # also the barrier: nobody returns before the commit
        raise CheckpointError(f"rank 0 could not write the manifest of {path}: {error}")


def _manifest(trainer: ORTTrainer, sharded: ShardedState, model: str, shards: list[str]) -> dict:
    spec, stateful = trainer.spec, sharded.stateful
    state_of = {}
    if trainer.step > 0:  # torch keeps no state before the first step either
        for g in spec.groups:
            state_of.update({p: list(spec.state_names(g)) for p in g.params if p in stateful})
    return {
        "format": FORMAT,
        "model_class": type(trainer.module).__name__,
        "optimizer_kind": spec.kind,
        "world_size": sharded.world_size,
        "step": trainer.step,
        "layout": sharded.config.layout.to_json(),
        "state_names": list(sharded.config.state_names),
        "index_names": checkpoint.index_names(trainer),
        "state_of": state_of,
        "model": model,
        "shards": shards,
    }


def read_manifest(trainer: ORTTrainer, path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable sharded checkpoint: {exc}") from exc
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an ortrain sharded checkpoint ({FORMAT})")
    if manifest["optimizer_kind"] != trainer.spec.kind:
        raise CheckpointError(
            f"{path} holds {manifest['optimizer_kind']} optimizer state, this trainer uses "
            f"{trainer.spec.kind}"
        )
    return manifest


def consolidate(path: str | os.PathLike, manifest: dict[str, Any]) -> dict[str, Any]:
    """The ordinary full state dict (torch formats) rebuilt from all the shards."""
    path = Path(path)
    state = _load(path / manifest["model"])
    layout = FlatLayout.from_json(manifest["layout"])
    parts = [_load(path / f)["state"] for f in manifest["shards"]]
    views = {s: layout.views(torch.cat([p[s] for p in parts])) for s in manifest["state_names"]}
    step = torch.tensor(float(manifest["step"]))
    opt: dict[int, dict[str, torch.Tensor]] = {}
    for idx, name in enumerate(manifest["index_names"]):
        names = manifest["state_of"].get(name)
        if names:
            opt[idx] = {s: views[s][name].clone() for s in names}
            if manifest["optimizer_kind"] != "sgd":  # as torch's Adam-type state
                opt[idx]["step"] = step.clone()
    state["optimizer"]["state"] = opt
    return state


def read_consolidated(trainer: ORTTrainer, path: str | os.PathLike) -> dict[str, Any]:
    return consolidate(path, read_manifest(trainer, path))


def load(trainer: ORTTrainer, sharded: ShardedState, path: str | os.PathLike) -> None:
    """Load a sharded checkpoint (own shard only when the layout matches) or an ordinary
    checkpoint file (re-sharded)."""
    path = Path(path)
    if not is_sharded(path):
        sharded.load_state_dict(trainer, checkpoint.read(trainer, path))
        return
    manifest = read_manifest(trainer, path)
    if FlatLayout.from_json(manifest["layout"]) != sharded.config.layout:
        sharded.load_state_dict(trainer, consolidate(path, manifest))  # other world size
        return
    shard = _load(path / manifest["shards"][sharded.config.rank])
    n = sharded.config.layout.shard_numel
    for s in sharded.config.state_names:
        if s not in shard["state"] or shard["state"][s].numel() != n:
            raise CheckpointError(f"{manifest['shards'][sharded.config.rank]}: no {n}-element {s}")
    base = _load(path / manifest["model"])
    sharded.load_shards(trainer, base, shard["state"], set(manifest["state_of"]))
