"""A zoo of models users bring, each built from code or a config (nothing downloaded).

Every entry builds a fresh ``nn.Module`` whose forward returns the loss (or an output
with ``.loss``) and draws batches of one fixed shape. ``tests/test_model_zoo.py`` trains
each through ortrain against eager; ``benchmarks/bench_zoo.py`` times them side by side.

Categories: ``functional`` (small modules of torch.nn.functional ops, the kind ONNX
Runtime's ORTModule tests use), ``cnn`` (normalizations and pooling), ``rnn``,
``embedding_bag``, ``hf`` (transformers families not in tests/test_model_families.py),
``moe`` (transformers' mixture-of-experts), ``ssm`` (state-space / recurrent LMs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Batch = dict[str, torch.Tensor]
V, H, S, B = 128, 32, 16, 4  # vocabulary, width, sequence length, batch


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    category: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    slow: bool = False  # export + build over ~20 s on a 2-core machine


ZOO: dict[str, Entry] = {}


def entry(
    name: str,
    category: str,
    batch: Callable[[torch.Generator], Batch],
    slow: bool = False,
):
    def deco(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        ZOO[name] = Entry(name, category, build, batch, slow)
        return build

    return deco


# --- batches ----------------------------------------------------------------------------


def features(g: torch.Generator, width: int = H) -> Batch:
    return {"x": torch.randn(B, width, generator=g), "y": torch.randint(0, 5, (B,), generator=g)}


def sequence(g: torch.Generator) -> Batch:
    return {"x": torch.randn(B, S, H, generator=g), "y": torch.randint(0, 5, (B,), generator=g)}


def tokens(g: torch.Generator) -> Batch:
    ids = torch.randint(0, V, (B, S), generator=g)
    return {"ids": ids, "y": torch.randint(0, V, (B, S), generator=g)}


def images(g: torch.Generator, size: int = 16, channels: int = 3) -> Batch:
    return {
        "x": torch.randn(B, channels, size, size, generator=g),
        "y": torch.randint(0, 5, (B,), generator=g),
    }


def lm(g: torch.Generator) -> Batch:
    ids = torch.randint(3, V, (B, S), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def mlm(g: torch.Generator) -> Batch:
    ids = torch.randint(3, V, (B, S), generator=g)
    labels = torch.full_like(ids, -100)
    pick = torch.rand(B, S, generator=g) < 0.3
    pick[:, 1] = True
    labels[pick] = ids[pick]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def pixels(g: torch.Generator, size: int = 32) -> Batch:
    return {
        "pixel_values": torch.randn(B, 3, size, size, generator=g),
        "labels": torch.randint(0, 5, (B,), generator=g),
    }


# --- functional: small modules of torch.nn.functional ops --------------------------------


class _Head(nn.Module):
    """A trunk (subclass ``body``) then a 5-class linear head and cross-entropy."""

    def __init__(self, width: int = H):
        super().__init__()
        self.head = nn.Linear(width, 5)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.body(x)), y)


@entry("mlp_relu", "functional", features)
class MlpRelu(_Head):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def body(self, x):
        return self.fc2(F.relu(self.fc1(x)))


@entry("mlp_activations", "functional", features)
class MlpActivations(_Head):
    """One layer per activation users reach for."""

    ACTS = (F.elu, F.leaky_relu, F.hardswish, F.mish, F.softplus, F.silu, F.gelu, F.selu,
            F.relu6, F.hardtanh, F.softsign, F.logsigmoid, torch.sin)  # fmt: skip

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(H, H) for _ in self.ACTS)

    def body(self, x):
        for layer, act in zip(self.layers, self.ACTS, strict=True):
            x = act(layer(x))
        return x


@entry("prelu_celu", "functional", features)
class PreluCelu(_Head):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(H, H), nn.PReLU(H), nn.Linear(H, H)

    def body(self, x):
        return F.celu(self.fc2(self.act(self.fc1(x))), alpha=0.7)


def _pairs(g: torch.Generator) -> Batch:
    return dict(features(g), z=torch.randn(B, H, generator=g))


@entry("normalize_cosine", "functional", _pairs)
class NormalizeCosine(nn.Module):
    """F.normalize (ReduceL2, clamp_min) and cosine_embedding_loss."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x, y, z):
        u, v = F.normalize(self.a(x), dim=-1), self.b(z)
        target = (y % 2) * 2 - 1
        return F.cosine_embedding_loss(u, v, target) + (u * v).sum(-1).pow(2).mean()


@entry("clamp_abs", "functional", features)
class ClampAbs(_Head):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)
        self.lo = nn.Parameter(torch.full((H,), -0.5))
        self.register_buffer("hi", torch.full((H,), 0.8))

    def body(self, x):
        h = self.fc(x)
        return torch.clamp(h, min=self.lo, max=self.hi) + h.clamp(-1.0, 1.0).abs()


@entry("slice_assign", "functional", features)
class SliceAssign(_Head):
    """``h[:, :4] = 0`` and ``h[:, -4:] = g``: ScatterND in the export."""

    def __init__(self):
        super().__init__()
        self.fc, self.gate = nn.Linear(H, H), nn.Linear(H, 4)

    def body(self, x):
        h = self.fc(x)
        h = h.clone()
        h[:, :4] = 0
        h[:, -4:] = torch.tanh(self.gate(x))
        return h


@entry("index_ops", "functional", features)
class IndexOps(_Head):
    """index_add, gather, scatter_add with repeated indices."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)
        self.register_buffer("idx", torch.tensor([0, 3, 3, 7, 1, 0, 5, 2]))

    def body(self, x):
        h = self.fc(x)
        added = h.index_add(1, self.idx, h[:, :8])
        picked = torch.gather(added, 1, self.idx.expand(x.shape[0], -1).remainder(H))
        rows = self.idx.expand(x.shape[0], -1)
        return added + F.pad(picked, (0, H - 8)).scatter_add(1, rows, picked)


@entry("topk_router", "functional", sequence)
class TopkRouter(nn.Module):
    """A mixture-of-experts layer written by hand: softmax router, top-2, weighted experts."""

    def __init__(self, experts: int = 4):
        super().__init__()
        self.router = nn.Linear(H, experts)
        self.experts = nn.ModuleList(nn.Linear(H, H) for _ in range(experts))
        self.head = nn.Linear(H, 5)

    def forward(self, x, y):
        probs = F.softmax(self.router(x), dim=-1)
        weights, chosen = torch.topk(probs, 2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            w = (weights * (chosen == e)).sum(-1, keepdim=True)
            out = out + w * expert(x)
        return F.cross_entropy(self.head(out.mean(1)), y)


@entry("cumsum_einsum", "functional", sequence)
class CumsumEinsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.head = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, 5)

    def forward(self, x, y):
        scores = torch.einsum("bqd,bkd->bqk", self.q(x), self.k(x)) / H**0.5
        mixed = torch.einsum("bqk,bkd->bqd", scores.softmax(-1), x)
        running = torch.cumsum(mixed, dim=1) / torch.arange(1, x.shape[1] + 1).view(1, -1, 1)
        return F.cross_entropy(self.head(running[:, -1]), y)


@entry("amax_logsumexp", "functional", sequence)
class AmaxLogsumexp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(H, H), nn.Linear(2 * H, 5)

    def forward(self, x, y):
        h = self.fc(x)
        pooled = torch.cat([h.amax(dim=1), torch.logsumexp(h, dim=1)], dim=-1)
        return F.cross_entropy(self.head(pooled), y)


@entry("sinusoid_tagger", "functional", tokens)
class SinusoidTagger(nn.Module):
    """Token tagger with computed sin/cos positions and a tied output layer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.freq = nn.Parameter(torch.linspace(0.1, 1.0, H // 2))
        self.norm = nn.LayerNorm(H)

    def forward(self, ids, y):
        pos = torch.arange(ids.shape[1], dtype=torch.float32).unsqueeze(-1) * self.freq
        h = self.norm(self.emb(ids) + torch.cat([torch.sin(pos), torch.cos(pos)], dim=-1))
        return F.cross_entropy((h @ self.emb.weight.T).flatten(0, 1), y.flatten())


@entry("torch_transformer", "functional", sequence)
class TorchTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(H, 4, 2 * H, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(H, 5)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.encoder(x).mean(1)), y)


@entry("star_args", "functional", features)
class StarArgs(nn.Module):
    """A wrapper whose forward takes ``*args`` (ORTModule's tests have these)."""

    def __init__(self):
        super().__init__()
        self.inner = MlpRelu()

    def forward(self, *args):
        return self.inner(*args)


# --- cnn -------------------------------------------------------------------------------------


class _ImageHead(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.head = nn.Linear(channels, 5)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x, y):
        h = self.trunk(x)
        return F.cross_entropy(self.head(F.adaptive_avg_pool2d(h, 1).flatten(1)), y)


@entry("cnn_batchnorm", "cnn", images)
class CnnBatchNorm(_ImageHead):
    def __init__(self):
        super().__init__(16)
        # no conv bias before a BatchNorm (it subtracts it again: a zero gradient)
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 16, 3, stride=2, bias=False)
        self.b2 = nn.BatchNorm2d(16, momentum=None)

    def trunk(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


@entry("resnet_block", "cnn", images)
class ResnetBlock(_ImageHead):
    def __init__(self):
        super().__init__(8)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
        )  # fmt: skip

    def trunk(self, x):
        h = F.relu(self.stem(x))
        return F.max_pool2d(F.relu(h + self.block(h)), 2)


@entry("mlp_batchnorm1d", "cnn", features)
class MlpBatchNorm1d(_Head):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(H, H, bias=False), nn.BatchNorm1d(H, affine=False)

    def body(self, x):
        return F.relu(self.bn(self.fc(x)))


@entry("cnn_groupnorm", "cnn", images)
class CnnGroupNorm(_ImageHead):
    def __init__(self):
        super().__init__(16)
        self.c1, self.n1 = nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16)
        self.c2, self.n2 = nn.Conv2d(16, 16, 3, padding=1), nn.InstanceNorm2d(16, affine=True)

    def trunk(self, x):
        return F.silu(self.n2(self.c2(F.silu(self.n1(self.c1(x))))))


@entry("cnn_pooling", "cnn", images)
class CnnPooling(_ImageHead):
    def __init__(self):
        super().__init__(8)
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def trunk(self, x):
        h = F.max_pool2d(F.relu(self.c1(x)), 3, stride=2, padding=1)
        h = F.avg_pool2d(F.relu(self.c2(h)), 2, ceil_mode=True, count_include_pad=False)
        return F.adaptive_max_pool2d(h, 2)


@entry("unet_tiny", "cnn", images)
class UnetTiny(_ImageHead):
    def __init__(self):
        super().__init__(8)
        self.down = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.mix = nn.Conv2d(11, 8, 3, padding=1)

    def trunk(self, x):
        d = F.relu(self.down(x))
        u = self.up(d) + F.interpolate(d, scale_factor=2.0, mode="nearest")
        return self.mix(torch.cat([u, x], dim=1))


# --- rnn -------------------------------------------------------------------------------------


@entry("lstm_lm", "rnn", tokens)
class LstmLm(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn = nn.Embedding(V, H), nn.LSTM(H, H, num_layers=2, batch_first=True)
        self.out = nn.Linear(H, V)

    def forward(self, ids, y):
        h, _ = self.rnn(self.emb(ids))
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


@entry("gru_classifier", "rnn", sequence)
class GruClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(H, H, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * H, 5)

    def forward(self, x, y):
        h, last = self.rnn(x)
        return F.cross_entropy(self.head(h[:, -1]), y) + last.pow(2).mean()


def _with_state(g: torch.Generator) -> Batch:
    return dict(sequence(g), h0=torch.randn(2, B, H, generator=g))


@entry("rnn_relu_seq_first", "rnn", _with_state)
class RnnReluSeqFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(H, H, num_layers=2, nonlinearity="relu")
        self.head = nn.Linear(H, 5)

    def forward(self, x, y, h0):
        h, _ = self.rnn(x.transpose(0, 1), h0)
        return F.cross_entropy(self.head(h[-1]), y)


# --- embedding bags -------------------------------------------------------------------------


def _bags(g: torch.Generator) -> Batch:
    return {
        "ids": torch.randint(0, V, (B, 6), generator=g),
        "w": torch.rand(B, 6, generator=g),
        "y": torch.randint(0, 5, (B,), generator=g),
    }


class _Bag(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, H, mode=mode)
        self.head = nn.Linear(H, 5)
        self.mode = mode

    def forward(self, ids, w, y):
        weights = w if self.mode == "sum" else None
        return F.cross_entropy(self.head(self.bag(ids, per_sample_weights=weights)), y)


for _mode in ("sum", "mean", "max"):
    entry(f"embedding_bag_{_mode}", "embedding_bag", _bags)(lambda mode=_mode: _Bag(mode))


# --- transformers ---------------------------------------------------------------------------


def _hf(model: str, config: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers
        from transformers.utils import logging

        logging.set_verbosity_error()
        cfg = getattr(transformers, config)(**kw)
        return getattr(transformers, model)(cfg)

    return build


DEC = dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=2 * H, max_position_embeddings=2 * S)  # fmt: skip
ENC = dict(DEC, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
EAGER = dict(attn_implementation="eager")

HF = {
    "mistral": ("MistralForCausalLM", "MistralConfig",
                dict(DEC, num_key_value_heads=2, **EAGER), lm),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               dict(DEC, num_key_value_heads=2, head_dim=8, **EAGER), lm),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig",
                 dict(DEC, hidden_dropout=0.0, attention_dropout=0.0, **EAGER), lm),
    "falcon": ("FalconForCausalLM", "FalconConfig",
               dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                    hidden_dropout=0.0, attention_dropout=0.0, **EAGER), lm),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig",
                 dict(DEC, num_key_value_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                      **EAGER), lm),
    "mpt": ("MptForCausalLM", "MptConfig",
            dict(vocab_size=V, d_model=H, n_layers=2, n_heads=4, max_seq_len=2 * S,
                 attn_config={"attn_pdrop": 0}, resid_pdrop=0.0, emb_pdrop=0.0), lm),
    "mobilebert": ("MobileBertForMaskedLM", "MobileBertConfig",
                   dict(ENC, embedding_size=16, intra_bottleneck_size=16,
                        num_feedforward_networks=2, true_hidden_size=16, **EAGER), mlm),
    "xlm_roberta": ("XLMRobertaForMaskedLM", "XLMRobertaConfig", dict(ENC, **EAGER), mlm),
    "gpt2_classifier": ("GPT2ForSequenceClassification", "GPT2Config",
                        dict(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=2 * S,
                             num_labels=5, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                             attn_pdrop=0.0, **EAGER), None),
    "swin": ("SwinForImageClassification", "SwinConfig",
             dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                  window_size=4, num_labels=5, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, drop_path_rate=0.0), pixels),
    "convnext": ("ConvNextForImageClassification", "ConvNextConfig",
                 dict(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5,
                      drop_path_rate=0.0, image_size=32), pixels),
    "resnet": ("ResNetForImageClassification", "ResNetConfig",
               dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5,
                    layer_type="basic"), pixels),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(DEC, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     **EAGER), lm),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(DEC, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=H, shared_expert_intermediate_size=H, **EAGER), lm),
    "mamba": ("MambaForCausalLM", "MambaConfig",
              dict(vocab_size=V, hidden_size=H, state_size=8, num_hidden_layers=2,
                   use_mambapy=False), lm),
    "rwkv": ("RwkvForCausalLM", "RwkvConfig",
             dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, attention_hidden_size=H,
                  intermediate_size=2 * H, context_length=2 * S), lm),
}  # fmt: skip
_CATEGORY = {"mixtral": "moe", "qwen2_moe": "moe", "mamba": "ssm", "rwkv": "ssm"}


def _classify(g: torch.Generator) -> Batch:
    ids = torch.randint(3, V, (B, S), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.randint(0, 5, (B,), generator=g)}  # fmt: skip


for _name, (_model, _config, _kw, _batch) in HF.items():
    entry(_name, _CATEGORY.get(_name, "hf"), _batch or _classify)(_hf(_model, _config, **_kw))


def _clip_batch(g: torch.Generator) -> Batch:
    ids = torch.randint(3, V, (B, 8), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(B, 3, 16, 16, generator=g)}  # fmt: skip


@entry("clip", "hf", _clip_batch)
def clip() -> nn.Module:
    import transformers

    text = dict(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=S,
        attention_dropout=0.0,
    )
    vision = dict(
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
        attention_dropout=0.0,
    )
    cfg = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    return _ReturnLoss(transformers.CLIPModel(cfg))  # fmt: skip


class _ReturnLoss(nn.Module):
    """CLIP computes its contrastive loss only when asked."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, pixel_values):
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
            return_loss=True,
        ).loss  # fmt: skip


def _audio(g: torch.Generator) -> Batch:
    return {"input_values": torch.randn(B, 400, generator=g),
            "labels": torch.randint(0, 5, (B,), generator=g)}  # fmt: skip


@entry("wav2vec2", "hf", _audio)
def wav2vec2() -> nn.Module:
    import transformers

    cfg = transformers.Wav2Vec2Config(
        hidden_size=H, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * H,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, num_labels=5, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0,
        apply_spec_augment=False, **EAGER,
    )  # fmt: skip
    return transformers.Wav2Vec2ForSequenceClassification(cfg)


@entry("nanogpt", "hf", tokens)
class NanoGpt(nn.Module):
    """nanoGPT's shape: pre-LN blocks, causal self-attention by hand, tied head."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, H), nn.Embedding(S, H)
        self.blocks = nn.ModuleList(_Block() for _ in range(layers))
        self.norm = nn.LayerNorm(H)

    def forward(self, ids, y):
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            h = block(h)
        logits = self.norm(h) @ self.tok.weight.T
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc, self.out = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(H, dim=-1)
        q, k, v = (z.view(b, t, 4, H // 4).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (H // 4) ** 0.5
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, H)
        h = h + self.proj(y)
        return h + self.out(F.gelu(self.fc(self.ln2(h)), approximate="tanh"))
