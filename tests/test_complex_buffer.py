"""A complex buffer (Meta's Llama reference code keeps its rotary table as complex64
``freqs_cis``): the exporter gives it to the graph as its real view (a last dimension of
2), and the binding hands ONNX Runtime that view of the buffer's own memory, so the model
trains as one graph like eager. (Binding had raised a TypeError with no fallback, then
sent the modules reading the buffer to eager.)"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from ortrain import ORTTrainer, TrainerOptions


class _ComplexRotary(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2, length: int = 8, vocab: int = 40):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.head = nn.Linear(dim, vocab)
        half = dim // heads
        freqs = 1.0 / (10000 ** (torch.arange(0, half, 2).float() / half))
        angles = torch.outer(torch.arange(length).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        fc = self.freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
        return torch.view_as_real(xc * fc).flatten(3).type_as(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.emb(ids)
        q = self.rotate(self.wq(h).view(b, t, self.heads, -1)).transpose(1, 2)
        k = self.rotate(self.wk(h).view(b, t, self.heads, -1)).transpose(1, 2)
        v = self.wv(h).view(b, t, self.heads, -1).transpose(1, 2)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.head(a.transpose(1, 2).reshape(b, t, -1))
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)
        )


def test_a_complex_buffer_trains_as_one_graph_like_eager():
    torch.manual_seed(0)
    model = _ComplexRotary()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 40, (2, 8), generator=g) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = ORTTrainer(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            TrainerOptions(build_progress=False),
        )
        losses = [trainer.train_step(ids) for ids in batches]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for ids, loss in zip(batches, losses):
        expected = ref(ids)
        expected.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=n)
    said = "\n".join(str(w.message) for w in caught)
    assert "cannot be bound" not in said and trainer.segments is None
    (compiled,) = trainer._graphs.train.values()
    bound = compiled.session.bound_inputs["freqs_cis"]  # the buffer's memory, viewed as real
    assert bound.dtype == torch.float32 and list(bound.shape) == [8, 4, 2]
    assert bound.data_ptr() == model.freqs_cis.data_ptr()
    with torch.no_grad():
        want = ref.eval()(batches[0])
    torch.testing.assert_close(trainer.eval_step(batches[0])["loss"], want, rtol=1e-5, atol=1e-6)
