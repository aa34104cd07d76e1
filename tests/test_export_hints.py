"""Models passing attention masks to ``nn.TransformerEncoder`` / ``nn.Transformer`` export
and train compiled (``ortrain/export_hints.py``): their causal-mask detection, a boolean
of the mask's values, is read as "not given" during the export only."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.modules.transformer as transformer

from ortrain import ORTTrainer, TrainerOptions
from ortrain.export_hints import without_value_hints


class _CausalEncoder(torch.nn.Module):
    """A language model over an encoder stack with a causal mask, a padding mask too."""

    def __init__(self, padding: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 16)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, 20)
        self.padding = padding

    def forward(self, ids, labels):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        pad = (ids == 0) if self.padding else None
        h = self.encoder(self.embed(ids), mask=mask, src_key_padding_mask=pad)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class _Seq2Seq(torch.nn.Module):
    """``nn.Transformer`` with a causal target mask, the hint given (``tgt_is_causal``)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, src, tgt, y):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        out = self.model(src, tgt, tgt_mask=mask, tgt_is_causal=True)
        return torch.nn.functional.cross_entropy(self.head(out).flatten(0, 1), y.flatten())


def _batches(kind: str, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        if kind == "seq2seq":
            out.append({
                "src": torch.randn(2, 6, 16, generator=g),
                "tgt": torch.randn(2, 4, 16, generator=g),
                "y": torch.randint(0, 3, (2, 4), generator=g),
            })  # fmt: skip
        else:
            ids = torch.randint(1, 20, (3, 7), generator=g)
            ids[0, 5:] = 0  # padding at the end of one row
            out.append({"ids": ids, "labels": torch.randint(0, 20, (3, 7), generator=g)})
    return out


@pytest.mark.parametrize("kind", ["causal", "causal+padding", "seq2seq"])
def test_masked_transformers_train_compiled_like_eager(kind: str) -> None:
    torch.manual_seed(0)
    model = _Seq2Seq() if kind == "seq2seq" else _CausalEncoder(padding="padding" in kind)
    ref = copy.deepcopy(model)
    # SGD: an attention's key bias has a zero gradient up to float noise, which Adam
    # would turn into lr-sized steps (tests/adam_noise.py)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    trainer = ORTTrainer(model, opt, TrainerOptions(fallback="off"))
    for i, batch in enumerate(_batches(kind, 4)):
        loss = float(trainer.train_step(**batch))
        opt_ref.zero_grad()
        expected = ref(**batch)
        expected.backward()
        opt_ref.step()
        assert loss == pytest.approx(float(expected.detach()), rel=1e-5), i
    assert trainer.segments is None and trainer.build_count == 1
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_eager_detection_is_untouched_outside_the_export() -> None:
    """Inside, the caller's hint is the answer; outside (and after an error inside), torch's
    own detection of a causal mask from its values."""
    mask = torch.nn.Transformer.generate_square_subsequent_mask(4)
    detect = transformer._detect_is_causal_mask
    assert detect(mask, None, 4) is True
    with without_value_hints():
        assert transformer._detect_is_causal_mask(mask, None, 4) is False
        assert transformer._detect_is_causal_mask(mask, True, 4) is True
    with pytest.raises(RuntimeError), without_value_hints():
        raise RuntimeError("an export that fails")
    assert transformer._detect_is_causal_mask is detect
