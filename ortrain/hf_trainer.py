"""``ORTHFTrainer``: a drop-in ``transformers.Trainer`` whose steps run through ORTTrainer.

    from ortrain.hf_trainer import ORTHFTrainer  # or ortrain.ORTHFTrainer

    trainer = ORTHFTrainer(model=model, args=TrainingArguments(...), train_dataset=train,
                           eval_dataset=test, compute_metrics=metrics)
    trainer.train()

Trainer keeps everything around the step: data loading and sharding, the optimizer and LR
scheduler it creates (or that are passed in), logging, callbacks, the evaluation loop and
``compute_metrics``, checkpoint folders, ``resume_from_checkpoint``. What runs differently:

1. ``training_step`` is ``ORTTrainer.train_step``: forward, backward and, at the end of an
   accumulation window, clipping and the optimizer update, in ONNX Runtime. Trainer's own
   ``optimizer.step()`` is a no-op (the update has run) and its gradient clipping returns
   ortrain's gradient norm (``ORTTrainer.last_grad_norm``).
2. Losses and gradients are weighted as Trainer weights them: ``num_items_in_batch`` goes to
   the model, the loss is divided by the window's micro-batches unless it was normalised over
   them, multiplied by the process count with ``average_tokens_across_devices``; the update
   takes the sum of the weighted gradients (``ORTTrainer.grad_multiplier``) and an epoch's
   short last window updates with the micro-batches it has (``ORTTrainer.apply_update``).
3. ``prediction_step`` is ``ORTTrainer.eval_step`` (no dropout, no update). A batch without
   labels predicts the model's outputs without a loss, as Trainer does (its graph's loss
   output is a constant, dropped: ``_loss_or_none``).
4. A checkpoint folder holds what Trainer writes, with ``optimizer.pt`` in torch's optimizer
   format (``ORTTrainer.state_dict``) and ``ortrain_state.pt`` (optimizer step, micro-step,
   loss scaler); resuming loads both, so a Trainer run's checkpoint resumes here too.
5. ``TrainingArguments`` set the ``TrainerOptions`` they share: ``gradient_accumulation_steps``,
   ``max_grad_norm`` (0: no clipping, the norm is still logged), ``seed``, ``fp16``/``bf16``
   (ortrain's mixed precision instead of accelerate's autocast) and the device. The rest
   (``zero_stage=1`` under torchrun, ``update_engine``, ...) come from ``ortrain_options``.

6. A loss Trainer computes itself (``label_smoothing_factor``, ``compute_loss_func``) is the
   graph's loss: the labels go to it under ``LOSS_LABELS``, a key the forward does not take
   (Trainer pops them before the forward), the count of items under ``LOSS_ITEMS``; it
   compiles with the model, or runs in eager around the segments where it cannot.
7. ``activation_checkpointing`` (``gradient_checkpointing``) turns on the model's
   checkpointed layers as in Trainer: the same math, traced through; what the backward
   keeps or recomputes is ortrain's memory plan (``TrainerOptions.memory_plan``).

Trainer features that ortrain cannot honour raise ``ValueError`` at construction, one line
naming the feature (``unsupported_features``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import Trainer

from ortrain.checkpoint import naming
from ortrain.core.names import LOSS_LABELS
from ortrain.export import LossFn, find_loss
from ortrain.options import TrainerOptions
from ortrain.trainer import ORTTrainer

__all__ = ["ORTHFTrainer", "trainer_options", "unsupported_features"]

OPTIMIZER_NAME = "optimizer.pt"  # Trainer's file names (transformers/trainer.py)
SCHEDULER_NAME = "scheduler.pt"
ORTRAIN_STATE_NAME = "ortrain_state.pt"
# The TrainerOptions fields TrainingArguments set, and the argument that sets each.
FROM_ARGS = {
    "device": "use_cpu / the device",
    "grad_accumulation_steps": "gradient_accumulation_steps",
    "max_grad_norm": "max_grad_norm",
    "seed": "seed",
    "mixed_precision": "fp16 / bf16",
    "broadcast_buffers": "ddp_broadcast_buffers",
}


def trainer_options(args: Any, base: TrainerOptions | None = None) -> TrainerOptions:
    """``base`` with the fields ``TrainingArguments`` own set from ``args`` (a field set in
    ``base`` to something else is an error: one setting, one place)."""
    base = base or TrainerOptions()
    device = torch.device(args.device)
    mixed = "fp16" if args.fp16 else "bf16" if args.bf16 else None
    derived = {
        "device": "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}",
        "grad_accumulation_steps": args.gradient_accumulation_steps,
        # Unclipped Trainer still logs the norm: an infinite bound reports it, scales by 1.
        "max_grad_norm": args.max_grad_norm if args.max_grad_norm > 0 else math.inf,
        "seed": args.seed,
        "mixed_precision": mixed,
    }
    if getattr(args, "ddp_broadcast_buffers", None) is not None:  # None: DDP's default
        derived["broadcast_buffers"] = args.ddp_broadcast_buffers
    default = TrainerOptions()
    for field, value in derived.items():
        own = getattr(base, field)
        if own != getattr(default, field) and own != value:
            raise ValueError(
                f"ORTHFTrainer: ortrain_options.{field}={own!r} disagrees with TrainingArguments; "
                f"set it there ({FROM_ARGS[field]})"
            )
    try:
        return dataclasses.replace(base, **derived)
    except ValueError as exc:  # bf16 on CPU, a device ortrain does not run on
        flag = f"{mixed}=True: " if mixed else ""
        raise ValueError(f"ORTHFTrainer: {flag}{exc}") from None


def _overridden(trainer: Trainer, name: str) -> bool:
    return getattr(type(trainer), name) is not getattr(ORTHFTrainer, name)


def unsupported_features(trainer: Trainer) -> list[str]:
    """What ``trainer`` (its arguments, model, callables) asks for that ortrain cannot do,
    one phrase each."""
    args = trainer.args
    why = []
    if trainer.is_deepspeed_enabled:
        why.append("DeepSpeed (ortrain runs the model, its update and ZeRO-1 itself)")
    if trainer.is_fsdp_enabled or args.fsdp:
        why.append("FSDP (ortrain shards optimizer state only: TrainerOptions(zero_stage=1))")
    if args.n_gpu > 1:
        why.append(f"torch DataParallel over {args.n_gpu} GPUs (run one process per device)")
    if args.world_size > 1 and torch.device(args.device).type != "cpu":
        why.append("distributed training on CUDA (ortrain's collectives run on gloo: use_cpu)")
    if args.parallelism_config is not None or getattr(trainer.model, "tp_size", 1) not in (1, None):
        why.append("tensor/context/sequence parallelism")
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        why.append("a model sharded at load time")
    if _overridden(trainer, "compute_loss"):  # never called: the graph computes the loss
        why.append(
            "a subclass's compute_loss (pass compute_loss_func=(outputs, labels, "
            "num_items_in_batch) -> loss instead: it runs in the graph, or in eager around it)"
        )
    if args.torch_compile:
        why.append("torch_compile (ortrain compiles the model to ONNX Runtime graphs)")
    if args.use_liger_kernel:
        why.append("use_liger_kernel")
    if args.auto_find_batch_size:
        why.append("auto_find_batch_size")
    if args.fp16_full_eval or args.bf16_full_eval:
        why.append("fp16_full_eval / bf16_full_eval (evaluation runs as training does)")
    # parameters other than float32: ORTTrainer trains the model in eager (or refuses it
    # with fp16/bf16, torch.distributed or fallback="off": ``param_dtypes.py``)
    return why


class _UpdatedByOrtrain(torch.optim.Optimizer):
    """What Trainer steps: ortrain applied the update inside ``train_step``, so ``step()``
    does nothing; the rest is the wrapped optimizer's (a scheduler sets the lr of its
    param groups, which ortrain reads at every update). A view, like accelerate's
    ``AcceleratedOptimizer``: no ``Optimizer.__init__``."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError("ORTHFTrainer: the optimizer's parameters are fixed once ortrain holds it")

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("ORTHFTrainer: optimizer.step(closure) cannot re-run the graph")


class _TrainedByOrtrain(torch.nn.Module):
    """What Trainer's training loop holds instead of accelerate's DDP wrapper: ortrain
    averages gradients over ranks itself, and DDP would give the module parameters of its
    own, no longer the memory ortrain updates (ZeRO-1's flat buffer)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ORTHFTrainer runs the model through ORTTrainer, not this wrapper")


# Batch keys for Trainer's own loss (label smoothing, compute_loss_func): the forward does
# not take them, so ORTTrainer hands them to the loss function only, as Trainer pops
# ``labels`` before the forward (LOSS_LABELS, from core.names: bucketing pads it).
LOSS_ITEMS = "loss_num_items"


def _trainers_loss(
    module: torch.nn.Module,
    label_names: Sequence[str],
    label_smoother: Any,
    compute_loss_func: Any,
    shift_labels: bool,
) -> LossFn:
    """ORTTrainer's ``loss_fn`` where Trainer computes the loss itself (``compute_loss``):
    ``compute_loss_func(outputs, labels, num_items_in_batch=...)``, else the label smoother
    (labels shifted for a causal LM), over the outputs of a forward that got no labels;
    a batch without them takes the model's own loss (``_loss_or_none``)."""
    plain = _loss_or_none(module, label_names)

    def loss_fn(outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        labels, items = batch.get(LOSS_LABELS), batch.get(LOSS_ITEMS)
        if compute_loss_func is not None and (labels is not None or module.training):
            return compute_loss_func(outputs, labels, num_items_in_batch=items)
        if labels is None:
            return plain(outputs, batch)
        return label_smoother(outputs, labels, shift_labels=shift_labels, num_items_in_batch=items)

    return loss_fn


def _causal_lm(model: torch.nn.Module) -> bool:
    """Trainer's test for shifting the labels of the label smoother."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.trainer import _is_peft_model

    inner = model.base_model.model if _is_peft_model(model) else model
    return inner._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def _loss_or_none(module: torch.nn.Module, label_names: Sequence[str]) -> LossFn:
    """ORTTrainer's ``loss_fn``: the model's loss, as without one (``find_loss``, its errors
    included: training without labels still says what to pass); only in evaluation, for a
    batch holding none of ``label_names`` whose outputs carry no loss, a constant 0 in the
    loss's place. ortrain's graphs have a loss output; Trainer predicts unlabelled data
    without one, and ``prediction_step`` drops it."""
    names = tuple(label_names)

    def loss_fn(outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        unlabelled = all(batch.get(k) is None for k in names)
        no_loss = isinstance(outputs, Mapping) and outputs.get("loss") is None
        tensors = [v for v in outputs.values() if isinstance(v, torch.Tensor)] if no_loss else []
        if not module.training and unlabelled and tensors:
            return tensors[0].new_zeros((), dtype=torch.float32)
        return find_loss(outputs)

    return loss_fn


def _unwrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's and our wrappers."""
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, (AcceleratedOptimizer, _UpdatedByOrtrain)):
        optimizer = optimizer.optimizer
    return optimizer


class ORTHFTrainer(Trainer):
    """``transformers.Trainer`` training through ortrain (see the module docstring).

    ``ortrain_options``: the ``TrainerOptions`` that ``TrainingArguments`` do not set
    (``zero_stage``, ``update_engine``, ``cpu_gemm``, ...). ``trainer.ortrainer`` is the
    ``ORTTrainer`` once the optimizer exists.
    """

    def __init__(self, *args: Any, ortrain_options: TrainerOptions | None = None, **kwargs: Any):
        self.ortrainer: ORTTrainer | None = None
        super().__init__(*args, **kwargs)
        why = unsupported_features(self)
        if why:
            raise ValueError(f"ORTHFTrainer does not support {why[0]}")
        self.ortrain_options = trainer_options(self.args, ortrain_options)
        self._last_grad_norm: float | None = None

    # ------------------------------------------------------------------ setup
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # fp16/bf16 are ortrain's mixed precision; accelerate's autocast would patch the
        # module's forward, which the ONNX export traces.
        return {**super()._build_accelerator_args(**kwargs), "mixed_precision": "no"}

    def _wrap_model(
        self, model: torch.nn.Module, training: bool = True, dataloader: Any = None
    ) -> torch.nn.Module:
        if not training:
            return super()._wrap_model(model, training, dataloader)
        # Not the module itself: Trainer then gives accelerate the optimizer only.
        return model if isinstance(model, _TrainedByOrtrain) else _TrainedByOrtrain(model)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        inner = _unwrap(optimizer)
        ort = self.ortrainer
        if ort is not None and ort.optimizer is inner and ort.module is self.model:
            return optimizer
        if self._own_loss():
            loss_fn = _trainers_loss(
                self.model,
                self.label_names,
                self.label_smoother,
                self.compute_loss_func,
                _causal_lm(self.model),
            )
        else:
            loss_fn = _loss_or_none(self.model, self.label_names)
        self.ortrainer = ORTTrainer(self.model, inner, self.ortrain_options, loss_fn=loss_fn)
        self.optimizer = _UpdatedByOrtrain(inner)
        return self.optimizer

    def _ort(self) -> ORTTrainer:
        if self.ortrainer is None:  # evaluate() before train(): the optimizer comes first
            self.create_optimizer()
        assert self.ortrainer is not None
        return self.ortrainer

    # ------------------------------------------------------------------ steps
    def _own_loss(self) -> bool:
        """Trainer computes the loss itself (``compute_loss``), not the model."""
        return self.label_smoother is not None or self.compute_loss_func is not None

    def _loss_inputs(
        self, inputs: dict[str, Any], num_items: Any, window: int | None
    ) -> tuple[dict[str, Any], float]:
        """The batch the graph takes and the weight Trainer's ``compute_loss`` and
        ``training_step`` give the model's loss (``window``: micro-batches of the
        accumulation window; None in evaluation)."""
        batch = dict(inputs)
        weight = 1.0
        # a float32 tensor: one graph input whatever the count (a Python int would be a
        # constant of the graph, and a build per value)
        count = (
            None
            if num_items is None
            else torch.as_tensor(num_items, dtype=torch.float32, device=self.args.device)
        )
        counted = self.model_accepts_loss_kwargs and count is not None
        if counted:
            batch["num_items_in_batch"] = count
        if self._own_loss():
            if "labels" in batch:  # Trainer pops them: the forward computes no loss
                batch[LOSS_LABELS] = batch.pop("labels")
            if count is not None:
                batch[LOSS_ITEMS] = count
        if (
            self.args.average_tokens_across_devices
            and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)
            and count is not None
        ):
            weight *= self.accelerator.num_processes // self.get_tp_size()
        scaled_for_ga = self.loss_is_scaled_for_ga
        if scaled_for_ga is None:
            scaled_for_ga = counted or self.compute_loss_func is not None
        if window is not None and not scaled_for_ga:
            weight /= window
        return batch, weight

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        ort = self._ort()
        model.train()
        inputs = self._prepare_inputs(inputs)
        window = self.current_gradient_accumulation_steps
        batch, weight = self._loss_inputs(inputs, num_items_in_batch, window)
        # Trainer sums the weighted losses' gradients over the window (DDP averages ranks);
        # ortrain divides the window's sum by grad_accumulation_steps (and ranks).
        ort.grad_multiplier = weight * ort.options.grad_accumulation_steps
        skipped = ort.skipped_steps
        loss = ort.train_step(**batch)
        if ort.micro_step == window:  # an epoch's last window, shorter than the others
            ort.apply_update()
        if ort.micro_step == 0:
            self._updated(ort, skipped)
        return loss * weight

    def _updated(self, ort: ORTTrainer, skipped: int) -> None:
        from accelerate.optimizer import AcceleratedOptimizer

        self._last_grad_norm = ort.last_grad_norm
        if isinstance(self.optimizer, AcceleratedOptimizer):
            # a loss-scaled step skipped on overflow: Trainer then leaves the scheduler alone
            self.optimizer._is_overflow = ort.skipped_steps > skipped

    def _clip_grad_norm(self, model: torch.nn.Module) -> float | None:
        return self._last_grad_norm  # ortrain clipped inside the update

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> float | None:
        return self._last_grad_norm if grad_norm is None else grad_norm

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        ort = self._ort()
        has_labels = bool(self.label_names) and all(
            inputs.get(k) is not None for k in self.label_names
        )
        return_loss = inputs.get("return_loss")
        if return_loss is None:
            return_loss = self.can_return_loss
        with_loss = has_labels or (not self.label_names and return_loss)
        inputs = self._prepare_inputs(inputs)
        if ignore_keys is None:
            config = getattr(self.model, "config", None)
            ignore_keys = getattr(config, "keys_to_ignore_at_inference", ["cache"]) or []
        labels = None
        if with_loss:
            labels = tuple(inputs.get(name) for name in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
            num_items = self._get_num_items_in_batch([inputs], self.args.device)
            batch, weight = self._loss_inputs(inputs, num_items, None)
        else:
            batch, weight = dict(inputs), 1.0
        # copies: eval_step's tensors are views of output buffers the next call overwrites,
        # and Trainer keeps every batch's logits
        outputs = {k: v.clone() for k, v in ort.eval_step(**batch).items()}
        loss = outputs["loss"].mean() * weight if with_loss and "loss" in outputs else None
        if prediction_loss_only:
            return loss, None, None
        # without labels the graph's "loss" is _loss_or_none's constant (a model that
        # computes a loss without labels and is not marked can_return_loss loses it here)
        drop = [*ignore_keys, "loss"]
        logits = tuple(v for k, v in _nested(outputs).items() if k not in drop)
        return loss, logits[0] if len(logits) == 1 else logits, labels

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.ortrainer is None:
            return super().save_model(output_dir, _internal_call)
        # ZeRO-3 keeps a shard of each parameter: whole while Trainer saves (every rank
        # calls save_model; the gather is a collective)
        with self.ortrainer.whole_parameters():
            super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        state = self._ort().state_dict()  # every rank: ZeRO-1 gathers its shards to rank 0
        if not self.args.should_save:
            return
        torch.save(state["optimizer"], os.path.join(output_dir, OPTIMIZER_NAME))
        torch.save(state["ortrain"], os.path.join(output_dir, ORTRAIN_STATE_NAME))
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        files = [os.path.join(checkpoint, n) for n in (OPTIMIZER_NAME, SCHEDULER_NAME)]
        if not all(os.path.isfile(f) for f in files):
            return  # as Trainer: a weights-only checkpoint starts the optimizer afresh
        optimizer = torch.load(files[0], map_location="cpu", weights_only=True)
        extra_file = os.path.join(checkpoint, ORTRAIN_STATE_NAME)
        extra = {}
        if os.path.isfile(extra_file):  # absent in a Trainer run's checkpoint
            extra = torch.load(extra_file, map_location="cpu", weights_only=True)
        # Trainer loaded the weights into the module already (its memory is ortrain's).
        state = {"model": self.model.state_dict(), "optimizer": optimizer, "ortrain": extra}
        with naming(files[0]):  # checked against the optimizer (ortrain/optim/state_check.py)
            self._ort().load_state_dict(state)
        self.lr_scheduler.load_state_dict(torch.load(files[1], weights_only=True))


def _nested(outputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``eval_step``'s keys by path (``hidden_states.3``) back into the model's nesting
    (``hidden_states``: a tuple), as Trainer's own ``prediction_step`` sees outputs."""
    tree: dict[str, Any] = {}
    for key, value in outputs.items():
        *path, last = key.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return {k: _as_tuples(v) for k, v in tree.items()}


def _as_tuples(node: Any) -> Any:
    """A level whose keys are all indices becomes a tuple in index order."""
    if not isinstance(node, dict):
        return node
    items = {k: _as_tuples(v) for k, v in node.items()}
    if items and all(k.isdigit() for k in items):
        return tuple(items[k] for k in sorted(items, key=int))
    return items
