"""Transformer families beyond GPT-2 and BERT, trained through ortrain against eager.

Encoders (RoBERTa, DistilBERT, ALBERT, ELECTRA, DeBERTa-v2), decoders (GPT-Neo with local
attention, OPT, Llama/Qwen2 with grouped-query attention, RMSNorm and rotary embeddings,
Phi, GPT-J, BLOOM with ALiBi, GPTBigCode with multi-query attention) and encoder-decoders
(T5 with relative position buckets, BART), each tiny, with padded batches. Per model:
the first step's gradients element-wise against ``torch.autograd``, the losses of three
AdamW steps, and ``eval_step``'s logits after them against eager's eval forward.

Decoders with ``attn_implementation="sdpa"`` (HF's default) get left-padded batches:
torch's SDPA gives zeros for the pad rows, whose keys are all masked, and the last pad
row's prediction of the first real token is in the loss (``masked_attention_rows.py``).
"""

from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.graph_passes.infra.tags import is_backward

# The families' graphs are built again by tests/test_update_in_backward.py (its reference
# trainer: the same model, batches and options): both take them from the run's graph
# cache, each hit checked against eager at its first step like a build.
pytestmark = pytest.mark.shared_graphs

V, H, L, HEADS, S, B = 320, 64, 2, 4, 24, 4
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5  # atol scaled by the tensor's largest reference value
# plus a floor scaled by the largest gradient of the model: softmax is shift invariant, so
# an attention key bias (without rotary embeddings) has an exact gradient of zero and both
# implementations return float32 noise there (see test_parity.drop_key_bias).
NOISE_FLOOR = 1e-6
LOSS_RTOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Family:
    model: str  # transformers class names
    config: str
    batch: str  # "mlm" | "right" | "left" (padding side of a causal LM) | "seq2seq"
    kwargs: dict
    attn: str | None = "eager"  # None: the config takes no attn_implementation
    rms_norms: int = 0  # RMSNorm chains fused into SimplifiedLayerNormalization

    def build(self) -> torch.nn.Module:
        import transformers

        from tests.conftest import _quiet_transformers

        _quiet_transformers()
        kw = dict(self.kwargs, vocab_size=V)
        if self.attn is not None:
            kw["attn_implementation"] = self.attn
        torch.manual_seed(0)
        return getattr(transformers, self.model)(getattr(transformers, self.config)(**kw))


ENCODER = dict(
    hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, intermediate_size=4 * H,
    max_position_embeddings=S + 4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip
DECODER = dict(
    hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, max_position_embeddings=S
)
FACTORIZED = dict(ENCODER, embedding_size=32)  # ALBERT, ELECTRA: a smaller embedding
RMS = 2 * L + 1  # a decoder's RMSNorms: 2 per block and the final one
GQA = dict(DECODER, num_key_value_heads=2, intermediate_size=3 * H)
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
SEQ2SEQ = dict(
    d_model=H, encoder_layers=L, decoder_layers=L, encoder_attention_heads=HEADS,
    decoder_attention_heads=HEADS, encoder_ffn_dim=4 * H, decoder_ffn_dim=4 * H,
    max_position_embeddings=S, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
)  # fmt: skip

FAMILIES = {
    "roberta": Family("RobertaForMaskedLM", "RobertaConfig", "mlm", ENCODER),
    "distilbert": Family(
        "DistilBertForMaskedLM", "DistilBertConfig", "mlm",
        dict(dim=H, n_layers=L, n_heads=HEADS, hidden_dim=4 * H, dropout=0.0,
             attention_dropout=0.0, max_position_embeddings=S),
        attn=None,
    ),
    "albert": Family("AlbertForMaskedLM", "AlbertConfig", "mlm", FACTORIZED),
    "electra": Family("ElectraForMaskedLM", "ElectraConfig", "mlm", FACTORIZED),
    "deberta-v2": Family("DebertaV2ForMaskedLM", "DebertaV2Config", "mlm", ENCODER, attn=None),
    "gpt-neo": Family(
        "GPTNeoForCausalLM", "GPTNeoConfig", "right",
        dict(hidden_size=H, num_layers=L, num_heads=HEADS, max_position_embeddings=S,
             attention_types=[[["global", "local"], 1]], window_size=8, embed_dropout=0.0,
             attention_dropout=0.0, resid_dropout=0.0),
    ),
    "opt": Family(
        "OPTForCausalLM", "OPTConfig", "left",
        dict(DECODER, ffn_dim=4 * H, word_embed_proj_dim=H, dropout=0.0, attention_dropout=0.0),
        attn="sdpa",
    ),
    "llama": Family("LlamaForCausalLM", "LlamaConfig", "left", GQA, attn="sdpa", rms_norms=RMS),
    "qwen2": Family("Qwen2ForCausalLM", "Qwen2Config", "right", GQA, rms_norms=RMS),
    "phi": Family(
        "PhiForCausalLM", "PhiConfig", "left",
        dict(DECODER, intermediate_size=4 * H, resid_pdrop=0.0, embd_pdrop=0.0),
        attn="sdpa",
    ),
    "gpt-j": Family(
        "GPTJForCausalLM", "GPTJConfig", "right",
        dict(n_embd=H, n_layer=L, n_head=HEADS, rotary_dim=8, n_positions=S, **NO_DROPOUT),
    ),
    "bloom": Family(
        "BloomForCausalLM", "BloomConfig", "right",
        dict(hidden_size=H, n_layer=L, n_head=HEADS, hidden_dropout=0.0, attention_dropout=0.0),
    ),
    # ALiBi slopes times positions computed in bfloat16 (half_in_float.py runs them on CPU)
    "falcon-alibi": Family(
        "FalconForCausalLM", "FalconConfig", "right",
        dict(hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, alibi=True,
             hidden_dropout=0.0, attention_dropout=0.0),
    ),
    "gpt-bigcode": Family(
        "GPTBigCodeForCausalLM", "GPTBigCodeConfig", "right",
        dict(n_embd=H, n_layer=L, n_head=HEADS, n_positions=S, multi_query=True, **NO_DROPOUT),
    ),
    "t5": Family(
        "T5ForConditionalGeneration", "T5Config", "seq2seq",
        dict(d_model=H, d_kv=16, d_ff=4 * H, num_layers=L, num_heads=HEADS, dropout_rate=0.0,
             decoder_start_token_id=0, pad_token_id=0),
        rms_norms=(2 * L + 1) + (3 * L + 1),  # encoder: 2 per block, decoder: 3; final norms
    ),
    "bart": Family("BartForConditionalGeneration", "BartConfig", "seq2seq", SEQ2SEQ),
}  # fmt: skip


def _batch(kind: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, V, (B, S), generator=g)
    mask = torch.ones_like(ids)
    pad = [0, 3, 7, 0]  # per-row padding length; rows 0 and 3 unpadded
    for row, n in enumerate(pad):
        if n:
            if kind == "left":
                mask[row, :n] = 0
            else:
                mask[row, -n:] = 0
    ids = ids.masked_fill(mask == 0, 1)
    if kind == "mlm":
        labels = torch.full_like(ids, -100)
        chosen = (torch.rand(B, S, generator=g) < 0.3) & (mask == 1)
        labels[chosen] = ids[chosen]
    elif kind == "seq2seq":
        labels = torch.randint(5, V, (B, S // 2), generator=g)
        labels[2, -3:] = -100
    else:
        labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_like_eager(family: str) -> None:
    kind = FAMILIES[family].batch
    g = torch.Generator().manual_seed(1)
    trainer = _trains_like_eager(FAMILIES[family].build(), [_batch(kind, g) for _ in range(3)])
    # Squares (RMSNorm, T5's norm) and cubes (tanh-GELU left unfused) run as products;
    # RMSNorm chains are one SimplifiedLayerNormalization each, none left decomposed.
    graph = trainer.train_graphs[0].graph
    forward = collections.Counter(n.op_type for n in graph if not is_backward(n))
    assert forward["Pow"] == 0
    assert forward["SimplifiedLayerNormalization"] == FAMILIES[family].rms_norms
    if FAMILIES[family].rms_norms:
        assert forward["ReduceMean"] == forward["Sqrt"] == forward["Reciprocal"] == 0
    if kind == "left":
        # masked_attention_rows: the rows that mask every key are found by a ReduceMax of
        # the mask (one: the layers share it), not by IsNaN over each layer's
        # probabilities; the loss has two ReduceMax of its own. Read from the graph, which
        # a cache hit has too (its passes' log not).
        assert forward["IsNaN"] == 0 and forward["ReduceMax"] == 1 + 2, forward


# Task heads on top of the encoders and decoders above: each with the loss transformers
# picks for it (cross-entropy over classes or tokens, MSE for one label, BCE-with-logits
# for multi-label, two cross-entropies for span starts and ends, GPT-2's pooling at each
# row's last non-pad token).
def _head_batch(labels: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    batch = _batch("right", g)
    del batch["labels"]
    if labels == "class":
        batch["labels"] = torch.randint(0, 3, (B,), generator=g)
    elif labels == "score":
        batch["labels"] = torch.randn(B, generator=g)
    elif labels == "multi":
        batch["labels"] = (torch.rand(B, 4, generator=g) < 0.5).float()
    elif labels == "token":
        batch["labels"] = torch.randint(0, 5, (B, S), generator=g).masked_fill(
            batch["attention_mask"] == 0, -100
        )
    elif labels == "span":
        batch["start_positions"] = torch.randint(0, S // 2, (B,), generator=g)
        batch["end_positions"] = batch["start_positions"] + 3
    elif labels == "choice":  # B rows as B // 2 questions of 2 choices
        batch = {k: v.view(B // 2, 2, S) for k, v in batch.items()}
        batch["labels"] = torch.randint(0, 2, (B // 2,), generator=g)
    return batch


GPT2_CLS = dict(
    n_embd=H, n_layer=L, n_head=HEADS, n_positions=S, num_labels=3, pad_token_id=1, **NO_DROPOUT
)
TASK_HEADS = {  # (model, the labels its batch carries)
    "bert-sequence-classification": (
        Family("BertForSequenceClassification", "BertConfig", "right", dict(ENCODER, num_labels=3)),
        "class",
    ),
    "bert-regression": (
        Family("BertForSequenceClassification", "BertConfig", "right", dict(ENCODER, num_labels=1)),
        "score",
    ),
    "bert-multi-label": (
        Family("BertForSequenceClassification", "BertConfig", "right",
               dict(ENCODER, num_labels=4, problem_type="multi_label_classification")),
        "multi",
    ),
    "bert-token-classification": (
        Family("BertForTokenClassification", "BertConfig", "right", dict(ENCODER, num_labels=5)),
        "token",
    ),
    "bert-question-answering": (
        Family("BertForQuestionAnswering", "BertConfig", "right", ENCODER), "span"
    ),
    "bert-multiple-choice": (
        Family("BertForMultipleChoice", "BertConfig", "right", ENCODER), "choice"
    ),
    "gpt2-sequence-classification": (
        Family("GPT2ForSequenceClassification", "GPT2Config", "right", GPT2_CLS), "class"
    ),
}  # fmt: skip
HEAD_PREFIXES = ("classifier.", "qa_outputs.", "score.")


@pytest.mark.slow
@pytest.mark.parametrize("head", list(TASK_HEADS))
def test_task_head_trains_like_eager(head: str) -> None:
    family, labels = TASK_HEADS[head]
    g = torch.Generator().manual_seed(1)
    outputs = ("start_logits", "end_logits") if labels == "span" else ("logits",)
    batches = [_head_batch(labels, g) for _ in range(3)]
    trainer = _trains_like_eager(family.build(), batches, outputs)
    # The head's own parameters got gradients (not only the encoder's).
    head_params = [n for n in trainer.grads if n.startswith(HEAD_PREFIXES)]
    assert head_params and all(trainer.grads[n].abs().sum() > 0 for n in head_params)


def _trains_like_eager(
    ref: torch.nn.Module,
    batches: list[dict],
    outputs: tuple[str, ...] = ("logits",),
    options: TrainerOptions | None = None,
) -> ORTTrainer:
    """AdamW steps on ``ref`` (eager) and on a copy through ortrain: the first step's
    gradients element-wise, every loss, then the eval graph's ``outputs`` against eager's
    eval forward on ortrain's own weights. The gradients are read from the trainer's
    buffers, so the update runs after the session ("auto" would run it in the backward,
    keeping none: tests/test_update_in_backward.py checks that against this engine)."""
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    options = options or TrainerOptions()
    if options.update_engine == "auto":
        options = dataclasses.replace(options, update_engine="torch")
    trainer = ORTTrainer(model, opt, options)
    losses_ref, losses = [], []
    for step, batch in enumerate(batches):
        opt_ref.zero_grad()
        loss = ref(**batch).loss
        loss.backward()
        losses_ref.append(loss.item())
        losses.append(trainer.train_step(**batch).item())
        if step == 0:
            _assert_gradients(ref, trainer)
        opt_ref.step()
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(losses_ref), rtol=LOSS_RTOL, atol=0
    )
    trainer.sync_to_module().eval()
    with torch.no_grad():
        out_ref = model(**batches[-1])
    out = trainer.eval_step(**batches[-1])
    for key in outputs:
        _assert_close_scaled(out[key], out_ref[key], f"eval {key}")
    # every family compiles whole: its first step agreed with eager (no segments)
    assert trainer.segments is None, trainer.segments.summary()
    return trainer


def _assert_gradients(ref: torch.nn.Module, trainer: ORTTrainer, minimum: int = 10) -> None:
    scale = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    compared = 0
    for name, p in ref.named_parameters():
        got = trainer.grads.get(name)
        if p.grad is None:
            assert got is None or not got.any(), f"{name}: eager has no gradient"
            continue
        assert got is not None, f"{name}: ortrain computed no gradient"
        _assert_close_scaled(got, p.grad, name, floor=NOISE_FLOOR * scale)
        compared += 1
    assert compared >= minimum


def _assert_close_scaled(
    got: torch.Tensor, ref: torch.Tensor, what: str, floor: float = 0.0
) -> None:
    atol = GRAD_ATOL * ref.abs().max().item() + floor
    torch.testing.assert_close(got, ref, rtol=GRAD_RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.slow
def test_lora_fine_tuning_trains_only_the_adapters() -> None:
    """PEFT LoRA on a Llama: the base weights are frozen (requires_grad=False), so only the
    adapters get gradients, the base stays bit-identical, and every loss equals eager's."""
    peft = pytest.importorskip("peft")

    base = Family("LlamaForCausalLM", "LlamaConfig", "right", GQA, attn="sdpa").build()
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    ref = peft.get_peft_model(base, lora)
    with torch.no_grad():  # B starts at zero: make it non-zero so A gets a gradient too
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    model = copy.deepcopy(ref)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert len(adapters) == 2 * 2 * L  # A and B, on q and v, per layer

    def opt(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)

    opt_ref = opt(ref)
    trainer = ORTTrainer(model, opt(model), TrainerOptions(update_engine="torch"))
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        batch = _batch("right", g)
        opt_ref.zero_grad()
        loss = ref(**batch).loss
        loss.backward()
        assert trainer.train_step(**batch).item() == pytest.approx(loss.item(), rel=LOSS_RTOL)
        if step == 0:
            assert sorted(trainer.grads) == sorted(adapters)
            _assert_gradients(ref, trainer, minimum=len(adapters))
        opt_ref.step()
    trainer.sync_to_module()
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    trained = dict(ref.named_parameters())
    for name in adapters:
        _assert_close_scaled(dict(model.named_parameters())[name], trained[name].detach(), name)


# Convolutional stems: ViT's patch embedding (Conv2d, stride = kernel = patch) and
# Whisper's two Conv1d (the second with stride 2) before transformer layers.
CONV_FAMILIES = {
    "vit": (
        "ViTForImageClassification", "ViTConfig",
        dict(image_size=16, patch_size=4, num_channels=3, hidden_size=H, num_hidden_layers=L,
             num_attention_heads=HEADS, intermediate_size=4 * H, num_labels=5,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        lambda g: dict(pixel_values=torch.randn(B, 3, 16, 16, generator=g),
                       labels=torch.randint(0, 5, (B,), generator=g)),
        1,  # Conv nodes in the forward
    ),
    "whisper": (
        "WhisperForConditionalGeneration", "WhisperConfig",
        dict(vocab_size=V, num_mel_bins=8, d_model=H, encoder_layers=L, decoder_layers=L,
             encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
             encoder_ffn_dim=4 * H, decoder_ffn_dim=4 * H, max_source_positions=8,
             max_target_positions=S, dropout=0.0, attention_dropout=0.0,
             activation_dropout=0.0, attn_implementation="eager", pad_token_id=1,
             bos_token_id=2, eos_token_id=3, decoder_start_token_id=2),
        lambda g: dict(input_features=torch.randn(B, 8, 16, generator=g),
                       labels=torch.randint(5, V, (B, 7), generator=g)),
        2,
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CONV_FAMILIES))
def test_conv_family_trains_like_eager(family: str) -> None:
    """Gradients through Conv (graph_passes/autodiff/rules/conv.py) inside real models:
    first-step gradients element-wise, three AdamW losses, eval logits; the input
    gradient of a conv is computed only where the conv's input is trained (not ViT's
    pixels or Whisper's features: only Whisper's second conv, of stride 2: a
    ConvTranspose), and every weight gradient is a product over patches (no Conv)."""
    import transformers

    from tests.conftest import _quiet_transformers

    _quiet_transformers()
    model_cls, config_cls, kwargs, make_batch, convs = CONV_FAMILIES[family]
    torch.manual_seed(0)
    ref = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    g = torch.Generator().manual_seed(1)
    trainer = _trains_like_eager(ref, [make_batch(g) for _ in range(3)])
    graph = trainer.train_graphs[0].graph
    forward = collections.Counter(n.op_type for n in graph if not is_backward(n))
    backward = collections.Counter(n.op_type for n in graph if is_backward(n))
    assert forward["Conv"] == convs
    assert backward["ConvTranspose"] == convs - 1
    assert backward["Conv"] == 0
    assert backward["MatMul"] >= convs and backward["Gather"] >= convs  # im2col products
