"""Trainer state in ordinary PyTorch formats.

``state_dict()`` is ``{"model": module.state_dict(), "optimizer": <torch optimizer
state_dict format>}``, so it loads into eager PyTorch too (and an eager optimizer's
state dict loads here). Checkpoint files add a header and are written atomically.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from graph_passes.interface import state_key
from ortrain.errors import CheckpointError

if TYPE_CHECKING:
    from ortrain.trainer import ORTTrainer

FORMAT = "ortrain.checkpoint/1"


def index_names(trainer: ORTTrainer) -> list[str]:
    """Parameter names in torch's optimizer-state index order."""
    by_id = {id(p): n for n, p in trainer.module.named_parameters()}
    return [by_id[id(p)] for g in trainer.optimizer.param_groups for p in g["params"]]


def trainer_state_dict(
    trainer: ORTTrainer, opt_state: Mapping[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """``opt_state``: full per-parameter optimizer state, where the trainer's is not
    (ZeRO-1 gathers its shards); default ``trainer.opt_state``."""
    opt_state = trainer.opt_state if opt_state is None else opt_state
    trainer.sync_to_module()
    model = {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}
    names = index_names(trainer)
    state: dict[int, dict[str, torch.Tensor]] = {}
    group_of = {n: g for g in trainer.spec.groups for n in g.params}
    for idx, name in enumerate(names):
        group = group_of.get(name)
        if group is None or trainer.step == 0:
            continue  # frozen, or no update yet: torch has no state either
        tensors = {
            s: opt_state[state_key(s, name)].clone()
            for s in trainer.spec.state_names(group)
            if state_key(s, name) in opt_state
        }
        if not tensors:
            continue
        if trainer.spec.kind != "sgd":
            tensors["step"] = torch.tensor(float(trainer.step))
        state[idx] = tensors
    groups = []
    start = 0
    for g in trainer.optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    extra: dict[str, Any] = {"step": trainer.step, "micro_step": trainer.micro_step}
    if trainer.scaler is not None:
        extra["loss_scaler"] = trainer.scaler.state_dict()
    return {
        "model": model,
        "optimizer": {"state": state, "param_groups": groups},
        "ortrain": extra,
    }


def _check_model(trainer: ORTTrainer, model: Mapping[str, torch.Tensor]) -> None:
    own = trainer.module.state_dict()
    missing = sorted(set(own) - set(model))
    extra = sorted(set(model) - set(own))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint does not match {type(trainer.module).__name__}: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    for k, v in own.items():
        if tuple(model[k].shape) != tuple(v.shape):
            raise CheckpointError(
                f"checkpoint tensor '{k}' has shape {tuple(model[k].shape)}, the model expects "
                f"{tuple(v.shape)}"
            )


def load_trainer_state_dict(
    trainer: ORTTrainer,
    state: Mapping[str, Any],
    *,
    opt_state: MutableMapping[str, torch.Tensor] | None = None,
) -> None:
    """``opt_state``: where the full per-parameter optimizer state goes (ZeRO-1 passes an
    empty dict and keeps its shard of it); default ``trainer.opt_state``."""
    opt_state = trainer.opt_state if opt_state is None else opt_state
    if "model" not in state or "optimizer" not in state:
        raise CheckpointError("state dict needs 'model' and 'optimizer' entries")
    _check_model(trainer, state["model"])
    opt = state["optimizer"]
    names = index_names(trainer)
    if len(opt["param_groups"]) != len(trainer.optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint has {len(opt['param_groups'])} param groups, the optimizer has "
            f"{len(trainer.optimizer.param_groups)}"
        )
    for idx, entry in opt["state"].items():
        idx = int(idx)
        if idx >= len(names):
            raise CheckpointError(f"optimizer state index {idx} has no parameter")
        for s, t in entry.items():
            if s != "step" and tuple(t.shape) != tuple(trainer.params[names[idx]].shape):
                raise CheckpointError(f"optimizer state '{s}' of {names[idx]} has wrong shape")
    # Validated: now change things.
    with torch.no_grad():
        trainer.module.load_state_dict(state["model"])
        for n, b in trainer.module.named_buffers():
            trainer.buffers[n].copy_(b)
        steps = [0.0]
        for idx, entry in opt["state"].items():
            name = names[int(idx)]
            for s, t in entry.items():
                if s == "step":
                    steps.append(float(t))
                    continue
                key = state_key(s, name)
                if key in opt_state:
                    opt_state[key].copy_(t)
                else:
                    opt_state[key] = t.detach().to(torch.float32).clone().contiguous()
        step = int(state.get("ortrain", {}).get("step", max(steps)))
        trainer.step_tensor.fill_(float(step))
        trainer.micro_step = int(state.get("ortrain", {}).get("micro_step", 0))
        scaler_state = state.get("ortrain", {}).get("loss_scaler")
        if trainer.scaler is not None and scaler_state is not None:
            trainer.scaler.load_state_dict(scaler_state)
        for g, saved in zip(trainer.optimizer.param_groups, opt["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})


def save(trainer: ORTTrainer, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "model_class": type(trainer.module).__name__,
        "optimizer_kind": trainer.spec.kind,
        "state": trainer_state_dict(trainer),
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)  # atomic: a crash never leaves a half-written checkpoint


def read(trainer: ORTTrainer, path: str | os.PathLike) -> dict[str, Any]:
    """The state dict in checkpoint ``path``, checked against ``trainer``'s optimizer."""
    from ortrain.distributed import sharded_checkpoint  # (imports this module)

    path = Path(path)
    if sharded_checkpoint.is_sharded(path):
        return sharded_checkpoint.read_consolidated(trainer, path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an ortrain checkpoint ({FORMAT})")
    if payload["optimizer_kind"] != trainer.spec.kind:
        raise CheckpointError(
            f"{path} holds {payload['optimizer_kind']} optimizer state, this trainer uses "
            f"{trainer.spec.kind}"
        )
    return payload["state"]


def load(trainer: ORTTrainer, path: str | os.PathLike) -> None:
    load_trainer_state_dict(trainer, read(trainer, path))
