"""Training steps in eager PyTorch over the trainer's own state: ``EagerSteps``.

While a training graph builds in the background (``TrainerOptions.background_build``,
``ortrain/background_build.py``) the steps run here: the module's forward and torch's
backward, the global-norm clipping the options ask for, and the user's own torch optimizer
stepping the module's parameter tensors, which are the trainer's. Nothing is copied to
switch between these steps and the graphs': the optimizer's state tensors are made the
trainer's (``TrainingState.opt_state``) before each step and adopted by it after, and the
step count is the trainer's, so a graph picks up exactly where eager left off (and a
checkpoint taken in between holds both).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ortrain.checkpoint import index_names
from ortrain.core.errors import NonFiniteLossError
from ortrain.core.names import state_key
from ortrain.core.optimizer_spec import EAGER
from ortrain.optimizer_resets import drop_state
from ortrain.python_state import kept
from ortrain.runtime.outside_steps import own_step
from ortrain.verify import restoring

if TYPE_CHECKING:
    from ortrain.program_context import ProgramContext

# optimizers whose state ortrain keeps under torch's own names (``STATE_NAMES``), and
# those that keep their own (EAGER: their step runs in eager anyway)
KINDS = ("adam", "adamw", "sgd", EAGER)


def unsupported(ctx: ProgramContext) -> str:
    """Why steps cannot run in eager over the trainer's state ("" where they can)."""
    opts, st = ctx.options, ctx.state
    if ctx.reducer is not None:
        return "it trains on one process only (torch.distributed is on)"
    if ctx.device.type != "cpu":
        return "it runs on CPU only (builds in a forked child; no fork once CUDA started)"
    if opts.grad_accumulation_steps != 1:
        return "it needs grad_accumulation_steps=1"
    if opts.mixed_precision is not None or st.scaler is not None:
        return "it needs full precision without loss scaling (eager steps run in float32)"
    if ctx.spec.kind not in KINDS:
        return f"torch's optimizer for {ctx.spec.kind!r} keeps its state otherwise"
    return ""


class EagerSteps:
    """Steps of ``ctx``'s module in eager PyTorch, updating the trainer's state."""

    def __init__(self, ctx: ProgramContext):
        self.ctx = ctx
        self.count = 0  # steps run here

    def step(self, batch: dict[str, Any]) -> torch.Tensor:
        ctx, st = self.ctx, self.ctx.state
        module, optimizer = ctx.module, ctx.optimizer
        params = [p for g in optimizer.param_groups for p in g["params"]]
        held = {p: p.grad for p in module.parameters()}  # an engine's gradient views stay
        for p in held:
            p.grad = None
        try:
            loss = ctx.eager.loss_of(batch, module, look=False)
            ctx.forward_ran()
            if ctx.options.check_finite and not math.isfinite(float(loss.detach())):
                raise NonFiniteLossError(
                    f"loss is {float(loss)} at optimizer step {st.step}; the update was not "
                    "applied and parameters/optimizer state are unchanged"
                )
            loss.backward()
            with torch.no_grad():
                if st.max_grad_norm is not None:
                    reached = [p for p in params if p.grad is not None]
                    st.record_grad_norm(torch.nn.utils.clip_grad_norm_(reached, st.max_grad_norm))
                self._lend_state(params)
                with own_step():
                    optimizer.step()
                self._adopt_state(params)
                st.record_update(torch.ones((), dtype=torch.bool))
        finally:
            for p, grad in held.items():
                p.grad = grad
        self.count += 1
        return loss.detach().to(torch.float32)

    def look(self, batch: dict[str, Any]) -> None:
        """Eager's forward of ``batch`` without gradients, as a step's would run, with what
        it changes put back (buffers, Python attributes, the random generator)."""
        module = self.ctx.module
        with (
            torch.random.fork_rng(devices=[]),
            restoring(list(module.buffers())),
            kept(module),
            torch.no_grad(),
        ):
            self.ctx.eager.loss_of(batch, module)
        self.ctx.forward_ran()

    def _states(self, params: list[torch.nn.Parameter]):
        """(parameter, its state's name, the trainer's key) for every state tensor."""
        st = self.ctx.state
        group_of = {n: g for g in st.spec.groups for n in g.params}
        for name, p in zip(index_names(st), params):
            group = group_of.get(name)
            if group is not None:
                for s in st.spec.state_names(group):
                    yield p, s, state_key(s, name)

    def _lend_state(self, params: list[torch.nn.Parameter]) -> None:
        """The optimizer's state becomes the trainer's tensors (once the trainer has
        taken a step: before it, torch makes its own at its first step, as eager does)."""
        st, optimizer = self.ctx.state, self.ctx.optimizer
        if st.spec.kind == EAGER:  # its state is its own
            return
        if st.step == 0:  # (a checkpoint of step 0 loaded since: no state either)
            for p in params:
                drop_state(optimizer, p)
            return
        step = float(st.step)
        for p, s, key in self._states(params):
            held = st.opt_state.get(key)
            if held is None:
                continue
            state = optimizer.state[p]
            state[s] = held
            if "step" in state or st.spec.kind != "sgd":
                state["step"] = torch.tensor(step, dtype=torch.float32)

    def _adopt_state(self, params: list[torch.nn.Parameter]) -> None:
        """What the optimizer's step wrote becomes (or is copied into) the trainer's."""
        st, optimizer = self.ctx.state, self.ctx.optimizer
        for p, s, key in self._states(params):
            new = optimizer.state.get(p, {}).get(s)
            if new is None:
                continue
            held = st.opt_state.get(key)
            if held is None:
                st.opt_state[key] = new
            elif held is not new:
                held.copy_(new)
                optimizer.state[p][s] = held
        if st.spec.kind != EAGER:  # torch's own is empty while the trainer steps (lent
            for p in params:  # anew at each eager step), or it would be taken for eager's
                drop_state(optimizer, p)
