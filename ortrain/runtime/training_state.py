"""Everything a training run owns between steps, in one object.

``ORTTrainer`` builds the graphs, binds them to these tensors and steps; the update
engines (``update_engines.py``), the distributed reducers (``ortrain/distributed``) and the
checkpoints (``ortrain/checkpoint.py``) take this object (never the trainer) and read and
change the state through it:

1. parameters and buffers: the module's own memory on CPU (updates are visible in
   place); ``move_params`` re-homes trainable parameters into views of a flat buffer and
   the module's parameters follow;
2. gradients (``grads``, per trained parameter; ``grad_params`` lists the parameters the
   loss reaches, known after the first gradient graph) and optimizer state
   (``opt_state``, keyed ``state_key(state, param)``);
3. counters: ``micro_step`` on the host, the optimizer step as a device scalar
   (``step_tensor``) that the update graph increments in place;
4. device scalars the graphs read or write: the loss, the loss scale, the gradient norm,
   whether the last update's gradients were finite, the update's ``grad_scale`` and
   ``max_grad_norm``;
5. the loss scaler and the host hyperparameters: ``max_grad_norm``, accumulation steps,
   ``grad_multiplier``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch.nn.parameter import is_lazy

from ortrain.core.errors import DeviceError, TrainableChangedError
from ortrain.core.optimizer_spec import OptimizerSpec
from ortrain.loss_scaler import LossScaler


def _scalar(device: torch.device, value: float = 0.0, dtype: torch.dtype = torch.float32):
    return torch.full((), value, dtype=dtype, device=device)


def _refuse_meta(module: torch.nn.Module) -> None:
    """Meta tensors have a shape and no data: bound to ONNX Runtime they are null pointers
    (a step would crash the process). Say which, and how to get real ones."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    meta = [n for n, t in tensors if t.is_meta]
    if meta:
        shown = ", ".join(meta[:4]) + (f" and {len(meta) - 4} more" if len(meta) > 4 else "")
        raise DeviceError(
            f"{type(module).__name__}: {shown} {'is' if len(meta) == 1 else 'are'} on the meta "
            "device (a shape, no data: a model "
            "made under torch.device('meta') or init_empty_weights); give it real tensors "
            "first, e.g. module.to_empty(device='cpu') then load_state_dict(...), or "
            "from_pretrained without a meta device_map"
        )


def refuse_lazy(module: torch.nn.Module) -> None:
    """Lazy modules (``nn.LazyLinear``) have no shapes until their first call, and the
    state, the graphs and the optimizer's layout are made from the shapes. Eager makes
    them in the first step; here one forward before the trainer does (a dry run)."""
    lazy = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if is_lazy(t)]
    if lazy:
        owners = sorted({n.rpartition(".")[0] or "<root>" for n in lazy})
        raise TypeError(
            f"{type(module).__name__}: {', '.join(owners[:4])} "
            f"{'is a lazy module' if len(owners) == 1 else 'are lazy modules'} whose "
            f"parameters have no shape yet ({', '.join(lazy[:4])}); run the model once on a "
            "batch (model(**batch), under torch.no_grad()) before making the ORTTrainer: "
            "the optimizer may be made before, its parameters are filled in place"
        )


@dataclasses.dataclass(eq=False)
class TrainingState:
    module: torch.nn.Module
    spec: OptimizerSpec
    device: torch.device
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    # torch's optimizer: its param_groups hold the hyperparameters each update reads and a
    # checkpoint saves (``spec`` is what ortrain compiled from it)
    optimizer: torch.optim.Optimizer | None = None
    scaler: LossScaler | None = None
    max_grad_norm: float | None = None
    accumulation: int = 1  # micro-steps per optimizer step
    # The update also scales the accumulated gradients by this: a driver's loss weighting
    # (ortrain/hf_trainer.py matches transformers.Trainer's). The in-backward update,
    # which has no gradient buffers to scale, ignores it.
    grad_multiplier: float = 1.0
    grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    opt_state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    grad_params: list[str] | None = None  # trainable params reached by the loss
    # of those, the ones this accumulation window did not reach (a model whose steps reach
    # different parameters: a layer skipped at random); the eager update skips them
    unreached: frozenset[str] = frozenset()
    # moves the update to the optimizer's own step (ProgramContext.update_in_eager): what a
    # checkpoint whose parameters took different numbers of steps loads into
    update_in_eager: Callable[[str], None] | None = None
    # gradient sums kept other than per parameter (ZeRO-2: this rank's shard of them)
    shard_grads: list[torch.Tensor] = dataclasses.field(default_factory=list)
    # ids of gradient tensors still zero as made (``zero_pages.lazy_zeros``): the first
    # window's zeroing leaves them alone, so their pages are not taken before the backward
    pristine_grads: set[int] = dataclasses.field(default_factory=set)
    # parameters kept other than whole (ZeRO-3: this rank's stretch of them)
    shard_params: list[torch.Tensor] = dataclasses.field(default_factory=list)
    micro_step: int = 0
    # a loaded checkpoint's open accumulation window: its gradient sums so far, added to
    # this process's at the end of the micro-step that follows (``take_window_grads``)
    window_grads: dict[str, torch.Tensor] | None = None
    # buffers a whole-model graph's session is bound to (``binder.py``): one the module
    # replaces by another shape cannot follow it there
    graph_buffers: set[str] = dataclasses.field(default_factory=set)
    # device scalars (created in __post_init__ on ``device``)
    step_tensor: torch.Tensor = dataclasses.field(init=False)
    loss: torch.Tensor = dataclasses.field(init=False)
    loss_scale: torch.Tensor = dataclasses.field(init=False)
    grad_norm: torch.Tensor = dataclasses.field(init=False)
    grads_finite: torch.Tensor = dataclasses.field(init=False)
    # the update graph's scalar inputs: "grad_scale", "max_grad_norm"
    scalars: dict[str, torch.Tensor] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        dev = self.device
        self.step_tensor = _scalar(dev)
        self.loss = _scalar(dev)
        self.loss_scale = _scalar(dev, 1.0)
        self.grad_norm = _scalar(dev)
        self.grads_finite = _scalar(dev, True, torch.bool)
        self.scalars = {"grad_scale": _scalar(dev, 1.0), "max_grad_norm": _scalar(dev)}

    @classmethod
    def of_module(
        cls,
        module: torch.nn.Module,
        spec: OptimizerSpec,
        device: torch.device,
        any_dtype: bool = False,
        **kwargs,
    ) -> TrainingState:
        """The module's parameters (float32, made contiguous; ``any_dtype``: as they are,
        for a model that trains in eager) and buffers, shared."""
        _refuse_meta(module)
        params: dict[str, torch.Tensor] = {}
        for n, p in module.named_parameters():
            if p.dtype != torch.float32 and not any_dtype:
                raise TypeError(f"parameter {n} is {p.dtype}; ortrain trains float32 parameters")
            if not p.data.is_contiguous():
                p.data = p.data.contiguous()
            params[n] = p.data
        buffers: dict[str, torch.Tensor] = {}
        for n, b in module.named_buffers():
            if not b.is_contiguous():
                b.data = b.data.contiguous()
            buffers[n] = b.data
        return cls(module, spec, device, params, buffers, **kwargs)

    # ------------------------------------------------------------------ reading
    @property
    def trainable(self) -> list[str]:
        """Parameters the optimizer trains, in param-group order."""
        return [n for g in self.spec.groups for n in g.params]

    @property
    def step(self) -> int:
        """Optimizer updates applied so far."""
        return int(self.step_tensor)

    @property
    def checks_gradients(self) -> bool:
        """Whether an update reads the global gradient norm (clipping, overflow check)."""
        return self.max_grad_norm is not None or self.scaler is not None

    def grad_scale(self, world_size: int = 1) -> float:
        """What the update multiplies the gradient sums by: they are sums over micro-steps
        (and ranks) of the loss-scaled gradients; the update wants their unscaled mean."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        return self.grad_multiplier / (self.accumulation * world_size * scale)

    # ------------------------------------------------------------------ layout
    def move_params(self, views: Mapping[str, torch.Tensor]) -> None:
        """Copy each named parameter into its view (of a flat buffer) and re-home it there:
        the module's parameter and ``params`` become the view. Views are made by the caller
        with grad mode on: views made under no_grad may not be written in place later
        (users do write parameters in place)."""
        modules = dict(self.module.named_parameters())
        for name, view in views.items():
            with torch.no_grad():
                view.copy_(self.params[name])
            modules[name].data = view
            self.params[name] = view

    def adopt_rebound(self) -> list[str]:
        """Parameters and buffers whose module tensor was replaced since they were bound
        (``p.data = p.data.clamp(...)`` between steps, MoCo's ``k.data = k.data * m + ...``
        in its forward, a buffer assigned anew): the module's values go into the state's
        tensor, which the module then holds again. Eager's optimizer steps the parameter
        object whatever its data is; without this the graphs and the update went on with
        the old tensor and the module's change was lost (or overwritten by
        ``sync_to_module``). Returns their names."""
        moved = []
        owners = dict(self.module.named_modules())
        for kind, own, tensors in (
            ("parameter", self.module.named_parameters(), self.params),
            ("buffer", self.module.named_buffers(), self.buffers),
        ):
            for name, t in own:
                held = tensors.get(name)
                if held is None or t.data_ptr() == held.data_ptr():
                    continue
                reshaped = t.shape != held.shape or t.dtype != held.dtype
                if reshaped and kind == "buffer" and name not in self.graph_buffers:
                    # eager code's own buffer (a QAT observer's ``min_val`` made per
                    # channel): the segments read it from the module, the state follows
                    tensors[name] = t
                    moved.append(name)
                    continue
                if reshaped:
                    raise TrainableChangedError(
                        f"{kind} {name} was replaced by a tensor of another shape or type "
                        f"({list(held.shape)} {held.dtype} -> {list(t.shape)} {t.dtype}) after "
                        "the ORTTrainer was made; its graphs and optimizer state are laid out "
                        "for the old one: call trainer.sync_to_module() before the change and "
                        "make a new ORTTrainer after it"
                    )
                with torch.no_grad():
                    held.copy_(t)
                if kind == "parameter":
                    t.data = held
                else:
                    owner, _, attr = name.rpartition(".")
                    owners[owner]._buffers[attr] = held
                moved.append(name)
        return moved

    def adopt_grads(self, views: Mapping[str, torch.Tensor]) -> None:
        """Gradients of these parameters live in these tensors (views of a flat buffer)."""
        self.grads.update(views)

    def take_window_grads(self) -> None:
        """A loaded checkpoint's open window: its gradient sums added to this micro-step's
        (then laid out, whatever the program or engine), before the window's update."""
        saved, self.window_grads = self.window_grads, None
        if not saved:
            return
        with torch.no_grad():
            for name, g in self.grads.items():
                if name in saved:
                    g.add_(saved[name].to(g.device, g.dtype))

    def adopt_opt_state(self, states: dict[str, torch.Tensor], *, replace: bool = False) -> None:
        """Optimizer state tensors by ``state_key``; ``replace``: these are all of it (ZeRO-1:
        this rank's shard pieces)."""
        if replace:
            self.opt_state = states
        else:
            self.opt_state.update(states)

    def zero_grads(self) -> None:
        for g in [*self.grads.values(), *self.shard_grads]:
            if id(g) not in self.pristine_grads:
                g.zero_()
        self.pristine_grads.clear()

    # ------------------------------------------------------------------ updates
    def record_grad_norm(self, norm: torch.Tensor) -> None:
        """The global gradient norm (before clipping) of this update."""
        self.grad_norm.copy_(norm)

    def record_update(self, finite: torch.Tensor) -> None:
        """An update ran over gradients that were all finite (``finite``, a device bool) or
        changed nothing; only an applied update counts as a step."""
        self.grads_finite.copy_(finite)
        self.step_tensor.add_(finite.to(torch.float32))

    def finish_update(self) -> None:
        """After an update (any engine): the loss scale moves by whether it was applied."""
        if self.scaler is not None:
            self.scaler.update(bool(self.grads_finite))

    def sync_to_module(self) -> torch.nn.Module:
        """Copy the trained weights into the module (a no-op where memory is shared)."""
        self.adopt_rebound()  # what user code put in the module since the last step is newer
        with torch.no_grad():
            for n, p in self.module.named_parameters():
                if p.data.data_ptr() != self.params[n].data_ptr():
                    p.data.copy_(self.params[n])
            for n, b in self.module.named_buffers():
                if b.data_ptr() != self.buffers[n].data_ptr():
                    b.copy_(self.buffers[n])
        return self.module

    def set_counters(self, step: int, micro_step: int) -> None:
        """Where training resumes (a loaded checkpoint)."""
        self.step_tensor.fill_(float(step))
        self.micro_step = micro_step
