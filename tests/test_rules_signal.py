"""Gradient rules of the Fourier transforms (``graph_passes/autodiff/rules/signal.py``).

1. Each row of ``SPECS`` is one DFT node (opset 20: the axis an input) checked against
   torch.autograd over ``torch.fft`` by ``tests/gradcheck.check_gradients`` (float64
   reference, rtol 1e-5, atol 1e-5 x max|ref|): complex and real signals, forward and
   inverse, one-sided (rfft, irfft of even and odd lengths), on the last and a middle axis.
2. A ``dft_length`` that resizes the signal is refused, naming the op and the node.
3. Models that use ``torch.fft`` (an FNet-style token mixer, a Fourier-neural-operator
   spectral convolution) train through ``ORTTrainer`` as one graph like eager.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.graph_passes.autodiff import GradientError
from tests.gradcheck import Const, Spec, X, case, check_gradients


def _ref(axis: int, inverse: int, onesided: int, n: int | None = None):
    """torch.fft on ONNX's layout: complex values as a trailing pair of reals, a real
    signal as a trailing axis of 1; ``axis`` counts that trailing axis too."""

    def ref(x, *_):
        z = x[..., 0] if x.shape[-1] == 1 else torch.view_as_complex(x.contiguous())
        ax = axis if axis >= 0 else axis + x.ndim
        if onesided and inverse:
            return torch.fft.irfft(z, n=n, dim=ax)[..., None]
        if onesided:
            y = torch.fft.rfft(z, dim=ax)
        else:
            y = torch.fft.ifft(z, dim=ax) if inverse else torch.fft.fft(z, dim=ax)
        return torch.view_as_real(y.resolve_conj())

    return ref


def _dft(id: str, x, axis: int, inverse: int = 0, onesided: int = 0, n: int | None = None):
    length = Const(n) if n is not None else None
    return case(f"DFT-{id}", "DFT", [x, length, Const(axis)], _ref(axis, inverse, onesided, n),
                attrs={"inverse": inverse, "onesided": onesided})  # fmt: skip


SPECS: list[Spec] = [
    _dft("complex-axis1", X(2, 8, 2), 1),
    _dft("complex-inverse-axis-neg2", X(3, 6, 2), -2, inverse=1),
    _dft("complex-middle-axis", X(2, 5, 3, 2), 1),
    _dft("real-full", X(2, 5, 1), 1),
    _dft("real-inverse-full", X(2, 6, 1), 1, inverse=1),
    _dft("rfft-even", X(2, 8, 1), 1, onesided=1),
    _dft("rfft-odd", X(3, 7, 1), 1, onesided=1),
    _dft("rfft-middle-axis", X(2, 6, 3, 1), 1, onesided=1),
    _dft("irfft-even", X(2, 5, 2), 1, inverse=1, onesided=1, n=8),
    _dft("irfft-odd", X(2, 4, 2), 1, inverse=1, onesided=1, n=7),
    _dft("irfft-middle-axis", X(2, 4, 3, 2), 1, inverse=1, onesided=1, n=6),
]


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_gradient_rule(spec: Spec) -> None:
    check_gradients(spec)


def test_a_dft_length_that_resizes_the_signal_is_refused() -> None:
    spec = _dft("padded", X(2, 6, 2), 1, n=8)
    with pytest.raises(GradientError, match=r"DFT.*node_under_test.*dft_length \(8\)"):
        check_gradients(spec)


class _FourierMixer(torch.nn.Module):
    """FNet's token mixing (the real part of a 2-D FFT over sequence and hidden) between
    two linear layers, and a Fourier-neural-operator layer: rfft, a learned complex weight
    per kept mode, irfft."""

    def __init__(self, d: int = 8, length: int = 10, modes: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, d)
        bins = length // 2 + 1
        self.spectral = torch.nn.Parameter(0.3 * torch.randn(bins, d, 2))
        self.register_buffer("kept", (torch.arange(bins) < modes).float()[:, None])
        self.out = torch.nn.Linear(d, 1)

    def forward(self, x, y):
        h = self.inp(x)  # [batch, length, d]
        h = h + torch.fft.fftn(h, dim=(1, 2)).real
        s = torch.view_as_real(torch.fft.rfft(h, dim=1))  # [batch, bins, d, 2]
        w = self.spectral
        re = (s[..., 0] * w[..., 0] - s[..., 1] * w[..., 1]) * self.kept  # the low modes
        im = (s[..., 0] * w[..., 1] + s[..., 1] * w[..., 0]) * self.kept
        spec = torch.view_as_complex(torch.stack([re, im], dim=-1))
        h = torch.nn.functional.gelu(h + torch.fft.irfft(spec, n=x.shape[1], dim=1))
        return torch.nn.functional.mse_loss(self.out(h).squeeze(-1), y)


def test_fourier_models_train_as_one_graph_like_eager() -> None:
    model = _FourierMixer()
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    options = TrainerOptions(fallback="off", build_progress=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), options)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(3, 10, 4, generator=g), torch.randn(3, 10, generator=g)
        opt_ref.zero_grad()
        want = ref(x, y)
        want.backward()
        opt_ref.step()
        torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=1e-7)
    assert trainer.segments is None and trainer.build_count == 1
    ops = [n.op_type for n in trainer.train_graphs[0].graph]
    assert ops.count("DFT") >= 6  # 3 forward transforms (fftn: 2), each with its adjoint
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
