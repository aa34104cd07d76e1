"""The two ways to run a training step on the same weights, batches and schedule:
``OrtrainBackend`` (``ORTTrainer``) and ``EagerBackend`` (PyTorch eager, with DDP /
``ZeroRedundancyOptimizer`` under torchrun); ``Backend`` is either, ``make_backend`` picks
one from ``--backend``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ortrain.recipes import RecipeError
from ortrain.recipes.config import TrainConfig
from ortrain.recipes.processes import Env
from ortrain.recipes.task import Batch, Task


def _trainer_options_kwargs(cfg: TrainConfig, rank: int) -> dict[str, Any]:
    return dict(
        device=cfg.device,
        grad_accumulation_steps=cfg.grad_accum,
        max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed + rank,  # independent dropout masks per rank
        intra_op_threads=cfg.threads,
        zero_stage=cfg.zero,
        mixed_precision=cfg.mixed_precision,
    )


class OrtrainBackend:
    """``ORTTrainer``: one ``train_step`` per micro-batch; the update runs inside the last."""

    name = "ortrain"

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig, env: Env
    ):
        from ortrain import OrtrainError, ORTTrainer, TrainerOptions

        try:
            options = TrainerOptions(**_trainer_options_kwargs(cfg, env.rank))
            self.trainer = ORTTrainer(model, optimizer, options)
        except (ValueError, OrtrainError) as exc:
            raise RecipeError(str(exc).splitlines()[0]) from exc
        self.optimizer = optimizer

    def micro_step(self, batch: Batch) -> float:
        return float(self.trainer.train_step(**batch))

    def finish_step(self) -> float | None:
        return self.trainer.last_grad_norm

    def evaluate(self, batch: Batch) -> Mapping[str, torch.Tensor]:
        return self.trainer.eval_step(**batch)

    def save(self, path: Path) -> None:
        self.trainer.save_checkpoint(path)

    def load(self, path: Path) -> None:
        from ortrain import CheckpointError

        try:
            self.trainer.load_checkpoint(path)
        except CheckpointError as exc:
            raise RecipeError(f"cannot resume from {path}: {exc}") from exc


class EagerBackend:
    """The same steps in PyTorch eager: loss / grad_accum backward per micro-batch, then
    clipping and ``optimizer.step()``. Under torchrun: DDP, and with ``--zero 1`` the
    optimizer becomes a ``ZeroRedundancyOptimizer`` of the same class and groups."""

    name = "torch"

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig, env: Env
    ):
        self.device = torch.device(cfg.device)
        self.model = model.to(self.device).train()
        self.cfg, self.env = cfg, env
        self.forward: torch.nn.Module = self.model
        if env.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.forward = DistributedDataParallel(self.model)
            if cfg.zero >= 1:  # torch's sharding of optimizer state (it has no stage 2)
                from torch.distributed.optim import ZeroRedundancyOptimizer

                cls = type(optimizer)
                accepted = inspect.signature(cls.__init__).parameters
                groups = [
                    {k: v for k, v in g.items() if k == "params" or k in accepted}
                    for g in optimizer.param_groups
                ]
                defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
                optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=cls, **defaults)
        self.optimizer = optimizer
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.autocast = (
            torch.autocast(
                self.device.type,
                dtype=getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[cfg.mixed_precision]),
            )
            if cfg.mixed_precision
            else contextlib.nullcontext()
        )
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if cfg.mixed_precision == "fp16" else None
        )
        self.micro = 0

    def micro_step(self, batch: Batch) -> float:
        self.micro += 1
        last = self.micro == self.cfg.grad_accum
        sync = contextlib.nullcontext()
        if isinstance(self.forward, torch.nn.parallel.DistributedDataParallel) and not last:
            sync = self.forward.no_sync()
        with sync:
            with self.autocast:
                loss = self.forward(**{k: v.to(self.device) for k, v in batch.items()}).loss
            scaled = loss / self.cfg.grad_accum
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return float(loss.detach())

    def finish_step(self) -> float | None:
        self.micro = 0
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = None
        if self.cfg.max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> Mapping[str, torch.Tensor]:
        self.model.eval()
        try:
            with self.autocast:
                out = self.model(**{k: v.to(self.device) for k, v in batch.items()})
        finally:
            self.model.train()
        return {k: v.float().cpu() for k, v in out.items() if isinstance(v, torch.Tensor)}

    def _optimizer_state(self) -> dict[str, Any] | None:
        if hasattr(self.optimizer, "consolidate_state_dict"):  # ZeroRedundancyOptimizer
            self.optimizer.consolidate_state_dict(to=0)
        return self.optimizer.state_dict() if self.env.is_main else None

    def save(self, path: Path) -> None:
        state = self._optimizer_state()  # a collective under ZeRO: every rank calls it
        if self.env.is_main:
            payload = {"model": self.model.state_dict(), "optimizer": state}
            if self.scaler is not None:
                payload["grad_scaler"] = self.scaler.state_dict()
            torch.save(payload, path)

    def load(self, path: Path) -> None:
        try:
            payload = torch.load(path, map_location=self.device, weights_only=True)
            self.model.load_state_dict(payload["model"])
            self.optimizer.load_state_dict(payload["optimizer"])
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RecipeError(f"cannot resume from {path}: {first}") from exc
        if self.scaler is not None and "grad_scaler" in payload:
            self.scaler.load_state_dict(payload["grad_scaler"])


Backend = OrtrainBackend | EagerBackend


def make_backend(task: Task, cfg: TrainConfig, env: Env) -> Backend:
    if cfg.backend == "torch":
        return EagerBackend(task.model, task.optimizer, cfg, env)
    return OrtrainBackend(task.model, task.optimizer, cfg, env)  # TrainerOptions checks --device
