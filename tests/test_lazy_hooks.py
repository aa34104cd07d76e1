"""Hooks a model's own forward installs as it first runs (transformers' output capturing,
installed on the first call that asks for hidden states or attentions) are the model's,
not a change of the user's: no graph is built again for them
(``ProgramContext.forward_ran``), and the model's own eager calls find them once."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F

from ortrain import ORTTrainer


class _Recording(torch.nn.Module):
    """Installs a forward hook on its inner layer at its first call, as transformers'
    ``maybe_install_capturing_hooks`` does (an attribute set then says so), and reads what
    the hook recorded."""

    def __init__(self, det: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)
        self.det = det  # a determinant has no gradient rule: the model trains as segments
        self.recorded: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "_hooks_installed", False):
            self.inner.register_forward_hook(lambda m, a, out: self.recorded.append(out))
            self._hooks_installed = True
        self.recorded.clear()
        h = torch.tanh(self.inner(x))
        logits = self.head(h + 0.1 * self.recorded[0])
        if self.det:
            logits = logits + 0.01 * torch.linalg.det(logits.reshape(-1, 2, 2)).unsqueeze(-1)
        return F.cross_entropy(logits, y)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(n)
    ]


def _train(det: bool, evaluate: bool) -> None:
    model = _Recording(det)
    ref = copy.deepcopy(model)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    builds = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(_batches(4)):
            want = ref(x, y)
            want.backward()
            opt.step()
            opt.zero_grad()
            got = trainer.train_step(x, y)
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
            if evaluate:
                trainer.eval_step(x, y)
            if i == 0:
                builds = trainer.build_count
    changed = [w for w in caught if "modules or hooks changed" in str(w.message)]
    assert not changed, str(changed[0].message)
    assert trainer.build_count == builds  # nothing built again after the first step
    assert (trainer.segments is not None) == det
    # installed once, by whichever forward ran first in this process (a look of ortrain's
    # own included: what it installs stays, with the attribute that says so)
    assert len(model.inner._forward_hooks) == int(getattr(model, "_hooks_installed", False))
    model(*_batches(1)[0])  # the user's own call after: one hook, one record
    assert len(model.inner._forward_hooks) == 1 and len(model.recorded) == 1
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_hook_the_forward_installs_in_a_segmented_step_builds_nothing_again() -> None:
    _train(det=True, evaluate=False)


def test_a_hook_the_forward_installs_in_an_evaluation_builds_nothing_again() -> None:
    _train(det=False, evaluate=True)
