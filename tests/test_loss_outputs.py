"""Where the loss is in a model's output (``ortrain.export.find_loss``): a tensor, ``.loss``,
a tuple's first item, or a tuple's one 0-dim float tensor (``(logits, loss)``, nanoGPT's
shape); anything ambiguous is an error naming the ``loss_fn`` to pass. A nanoGPT-style
model (its ``model.py``, written out here) trains without a ``loss_fn`` like eager: every
step's loss, every parameter element (``tests/adam_noise.py``), one build."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTTrainer
from ortrain.core.errors import BatchError, ExportError, LossShapeError
from ortrain.export import find_loss
from ortrain.options import TrainerOptions
from tests.adam_noise import AdamDrift, TrainerGradients, assert_params_close

LOSS, LOGITS = torch.tensor(2.5), torch.zeros(2, 8, 16)


# ------------------------------------------------------------------------ find_loss
@pytest.mark.parametrize(
    "outputs",
    [
        LOSS,
        (LOSS, LOGITS),
        (LOGITS, LOSS),
        [LOGITS, LOSS],
        (LOGITS, torch.tensor(7), LOSS),  # a 0-dim integer (a count) is no loss
        (None, LOSS, LOGITS),
        {"loss": LOSS, "logits": LOGITS},
        (LOSS, LOGITS, torch.tensor(0.1)),  # first and 0-dim: the loss, as before
    ],
    ids=["tensor", "first", "second", "list", "int-scalar", "after-none", "dict", "first-of-2"],
)
def test_the_loss_is_found(outputs) -> None:
    assert find_loss(outputs) is LOSS


def test_several_scalars_name_each_loss_fn_to_pass() -> None:
    with pytest.raises(ExportError) as err:
        find_loss((LOGITS, LOSS, torch.tensor(0.1)))
    msg = str(err.value)
    assert "tuple (Tensor[2, 8, 16] float32, Tensor[] float32, Tensor[] float32)" in msg
    assert "loss_fn=lambda out, batch: out[1] or loss_fn=lambda out, batch: out[2]" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("outputs", [(LOGITS, None), (LOGITS,), [LOGITS, torch.tensor(3)]])
def test_no_scalar_says_to_pass_targets_or_a_loss_fn(outputs) -> None:
    with pytest.raises(ExportError, match=r"no loss .*targets.*loss_fn=lambda out, batch"):
        find_loss(outputs)


# ------------------------------------------------------------------------ nanoGPT
# nanoGPT's model.py (github.com/karpathy/nanoGPT), as users bring it: flash attention
# through scaled_dot_product_attention, tied head, and forward(idx, targets=None)
# returning (logits, loss), or the last position's logits and None without targets.
@dataclasses.dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 96
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        _, t = idx.size()
        assert t <= self.config.block_size, f"sequence {t} > block size {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        nodecay = [p for p in params.values() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": nodecay, "weight_decay": 0.0},
        ]
        extra = (
            {"fused": False} if "fused" in inspect.signature(torch.optim.AdamW).parameters else {}
        )
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)


def _batches(n: int, cfg: GPTConfig, batch: int = 4, seq: int = 32) -> list[dict]:
    """nanoGPT's get_batch: x and y, y shifted by one; a few targets ignored (-1)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        y = data[:, 1:].clone()
        y[0, :3] = -1
        out.append({"idx": data[:, :-1], "targets": y})
    return out


@pytest.mark.slow
def test_nanogpt_returning_logits_and_loss_trains_like_eager_without_a_loss_fn() -> None:
    lr, steps = 1e-3, 6
    cfg = GPTConfig()
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    opt_ref = ref.configure_optimizers(0.1, lr, (0.9, 0.95))
    trainer = ORTTrainer(model, model.configure_optimizers(0.1, lr, (0.9, 0.95)))
    drift, read = AdamDrift(lr, betas=(0.9, 0.95)), TrainerGradients(trainer)
    for step, batch in enumerate(_batches(steps, cfg)):
        opt_ref.zero_grad(set_to_none=True)
        _, want = ref(**batch)
        want.backward()
        opt_ref.step()
        got = trainer.train_step(**batch)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {step}")
        grads = {n: p.grad for n, p in ref.named_parameters()}
        drift.observe(grads, read(grads))
    assert trainer.build_count == 1
    trainer.sync_to_module()
    assert_params_close(
        dict(model.named_parameters()),
        dict(ref.named_parameters()),
        rtol=1e-4,
        atol=1e-5,
        drift=drift,
    )
    # without targets the model returns (logits, None): the error says what to pass
    with pytest.raises(ExportError, match=r"no loss .*targets=") as err:
        trainer.train_step(idx=_batches(1, cfg)[0]["idx"])
    assert "\n" not in str(err.value)


# ------------------------------------------------------------ a loss of one element
class _OneElementLoss(torch.nn.Module):
    """A loss of shape ``shape`` (one element: eager's backward() takes it as a scalar);
    ``det``: a part no graph differentiates (Det has no gradient rule), so the model
    trains as segments with that part in eager."""

    def __init__(self, shape: tuple[int, ...], det: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
        self.shape, self.det = shape, det

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        loss = F.smooth_l1_loss(h, y, reduction="sum", beta=0.5) / x.shape[0]
        if self.det:
            loss = loss + 0.01 * torch.linalg.det(h.reshape(-1, 2, 2)).abs().mean()
        return loss.reshape(self.shape)


@pytest.mark.parametrize("det", [False, True], ids=["one-graph", "segments"])
@pytest.mark.parametrize("shape", [(1,), (1, 1)], ids=["[1]", "[1,1]"])
def test_a_loss_of_one_element_trains_like_eager(shape: tuple[int, ...], det: bool) -> None:
    """Eager's ``loss.backward()`` takes a loss of any shape with one element; so does
    a step (its loss returned 0-dim), on one graph and as segments, with Adam: every
    step's loss and every parameter element, and the evaluation's loss."""
    model, ref = _OneElementLoss(shape, det), _OneElementLoss(shape, det)
    trainer = ORTTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for step in range(4):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
        want = ref(x, y)
        assert want.shape == shape
        opt.zero_grad()
        want.backward()
        opt.step()
        got = trainer.train_step(x=x, y=y)
        assert got.shape == ()
        torch.testing.assert_close(got, want.detach().reshape(()), msg=f"step {step}")
    assert (trainer.segments is not None) == det
    if not det:
        assert len(trainer.train_graphs) == 1
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        want_eval = ref.eval()(x, y)
    torch.testing.assert_close(
        torch.as_tensor(trainer.eval_step(x=x, y=y)["loss"]).reshape(()), want_eval.reshape(())
    )


@pytest.mark.parametrize("segments", ["auto", "blocks"], ids=["one-graph", "segments"])
def test_a_loss_of_several_elements_is_refused_as_eager_refuses_it(segments: str) -> None:
    """Two elements: eager's backward() raises (no implicit gradient), and so does the
    step, naming the shape, before anything changes: the same error on one graph and as
    segments (where the loss is taken in eager)."""
    model = _OneElementLoss((2,), det=False)
    model.forward = lambda x, y: F.mse_loss(model.body(x), y, reduction="none").mean(0)[:2]
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    with pytest.raises(RuntimeError, match="only for scalar outputs"):
        model(x, y).backward()
    before = copy.deepcopy(model.state_dict())
    options = TrainerOptions(segments=segments)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback announced: nothing would train it
        with pytest.raises(LossShapeError, match=r"one element.*\[2\]") as err:
            trainer.train_step(x=x, y=y)
    assert isinstance(err.value, BatchError)  # a batch's error: the trainer stays usable
    assert (trainer.segments is not None) == (segments == "blocks")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
