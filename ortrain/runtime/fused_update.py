"""The optimizer update with the fused kernels of ``cuda_kernels/`` (no update graph).

Chosen by ``TrainerOptions(update_engine=...)``: "auto" uses it on CUDA when the kernel
library is built, "kernels" everywhere (on CPU that is the single-threaded CPU reference
library). The semantics are the update graph's: gradients are sums that the update
scales by ``1 / (accumulation * world * loss_scale)``, global-norm clipping with
``clip_grad_norm_`` semantics, and on overflow nothing changes, bit for bit.

Per update, with no host synchronisation on CUDA except reading the step:
1. one ``all_finite_sq_norm`` read of the flat gradients (with clipping or loss scaling);
2. the clipping coefficient as device tensor arithmetic, folded into the kernels'
   ``grad_scale``;
3. per param group one Adam/AdamW kernel over its flat range, or LAMB's two phases with
   one segment per tensor (alignment padding is zeros and joins the previous segment:
   it adds nothing to the norms and stays zero).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ortrain.core.errors import UnsupportedOptimizerError
from ortrain.core.names import state_key
from ortrain.runtime import kernels
from ortrain.runtime.flat_update import FlatUpdate

if TYPE_CHECKING:
    from ortrain.runtime.training_state import TrainingState

KERNEL_KINDS = ("adam", "adamw", "lamb")


def kernels_available(device: torch.device) -> bool:
    try:
        kernels.library(device.type)
    except kernels.KernelLibraryError:
        return False
    return True


def check_supported(kind: str) -> None:
    if kind not in KERNEL_KINDS:
        raise UnsupportedOptimizerError(
            f"update_engine='kernels' supports {', '.join(KERNEL_KINDS)}, not {kind}; use "
            "update_engine='graph'"
        )


class FusedUpdate:
    """Runs one optimizer update over the state's flat parameter/gradient/state buffers."""

    def __init__(self, state: TrainingState, flat: FlatUpdate, segments: dict[str, list[int]]):
        check_supported(state.spec.kind)
        self.state = state
        self.flat = flat
        dev = state.device
        self.offsets = {p: kernels.segment_offsets(lens, dev) for p, lens in segments.items()}
        self.scratch = {
            p: torch.empty_like(t) for p, t in flat.params.items() if state.spec.kind == "lamb"
        }
        self.sq_norm = torch.zeros((), dtype=torch.float32, device=dev)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=dev)
        self.check = state.checks_gradients

    def run(self, values: list[dict[str, float]], grad_scale: float) -> None:
        st, spec = self.state, self.flat.spec
        grads = [self.flat.grads[p] for g in spec.groups for p in g.params]
        scale: float | torch.Tensor = grad_scale
        self.found_inf.zero_()
        if self.check and grads:
            kernels.all_finite_sq_norm(grads, sq_norm=self.sq_norm, found_inf=self.found_inf)
            if st.max_grad_norm is not None:
                norm = self.sq_norm.sqrt() * grad_scale  # ||s g|| = s ||g||
                st.record_grad_norm(norm)
                coef = torch.clamp(st.max_grad_norm / (norm + 1e-6), max=1.0)
                scale = (coef * grad_scale).reshape(1)
        step = float(st.step_tensor) + 1.0  # the kernels' bias corrections need t on the host
        for gi, group in enumerate(spec.groups):
            hp = values[gi]
            for p in group.params:
                m = self.flat.states[state_key("exp_avg", p)]
                v = self.flat.states[state_key("exp_avg_sq", p)]
                common = {
                    "beta1": hp["beta1"],
                    "beta2": hp["beta2"],
                    "eps": hp["eps"],
                    "weight_decay": hp["weight_decay"],
                    "step": step,
                    "grad_scale": scale,
                    "found_inf": self.found_inf,
                }
                if spec.kind == "lamb":
                    kernels.lamb_(
                        self.flat.params[p],
                        self.flat.grads[p],
                        m,
                        v,
                        self.offsets[p],
                        lr=hp["lr"],
                        bias_correction=group.bias_correction,
                        update=self.scratch[p],
                        **common,
                    )
                else:
                    kernels.adamw_(
                        self.flat.params[p],
                        self.flat.grads[p],
                        m,
                        v,
                        lr=hp["lr"],
                        decoupled=spec.kind == "adamw",
                        **common,
                    )
        st.record_update(self.found_inf == 0)
