"""Models that cannot be one training graph train as compiled segments inside torch
autograd, with eager PyTorch for the rest (ortrain/segments, TrainerOptions.fallback)."""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import BatchError, ExportError, VerificationError
from ortrain.core.names import GradientError


class _Det(torch.nn.Module):
    """A parameterized score through an op without a gradient rule (Det)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = torch.nn.Linear(dim, 4)

    def forward(self, h):
        return torch.linalg.det(self.proj(h).reshape(-1, 2, 2))


class _Picked(torch.nn.Module):
    """A parameterized module with a data-dependent shape inside (no static graph)."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, h):
        z = self.lin(h)
        return z[z.sum(-1) > 0].sum() * 0.1


class _Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)
        )
        self.scorer = _Det(8)
        self.picked = _Picked(8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        h = self.encoder(x)
        logits = self.head(h) + 0.01 * self.scorer(h).unsqueeze(-1)
        return F.cross_entropy(logits, y) + self.picked(h)


def _batches(n: int, rows: int = 16, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g))
        for _ in range(n)
    ]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_like_eager(
    make: Callable[[], torch.nn.Module],
    batches: list,
    options: TrainerOptions | None = None,
    opt: Callable = _sgd,
    accumulation: int = 1,
    clip: float | None = None,
) -> ORTTrainer:
    """Per-step losses and the final parameters of ortrain and eager, element by element
    (SGD: float noise in the gradients stays noise-sized in the weights)."""
    model, ref = make(), make()
    trainer = ORTTrainer(model, opt(model.parameters()), options or TrainerOptions())
    opt_ref = opt(ref.parameters())
    for i, (x, y) in enumerate(batches):
        want = ref(x, y)
        (want / accumulation).backward()
        if (i + 1) % accumulation == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            opt_ref.step()
            opt_ref.zero_grad()
        got = trainer.train_step(x, y)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    return trainer


def test_a_mixed_model_trains_like_eager_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train_like_eager(_Mixed, _batches(5))
    seg = trainer.segments
    assert seg is not None
    assert sorted(seg.model.compiled) == ["encoder", "head", "picked.lin", "scorer.proj"]
    why = {p.name: (p.status, p.cause) for p in seg.model.fallbacks}
    assert why["scorer"][0] == "split" and "Det" in why["scorer"][1]
    # a data-dependent shape: the export or the gradient builder refuses it
    assert why["picked"][0] == "split"
    assert "no static shape" in why["picked"][1] or "ExportError" in why["picked"][1]
    # each module's own cause: not the whole model's, whose handling its export ran in
    assert "Det" not in why["picked"][1], why["picked"][1]
    fallbacks = [w for w in caught if "does not compile as one graph" in str(w.message)]
    assert len(fallbacks) == 1
    text = str(fallbacks[0].message)
    assert "scorer: split into its children" in text and "in eager" in text
    # the update runs after torch's backward (not inside a graph); gradients in its buffers
    assert trainer.update_engine.name != "backward"
    assert sorted(trainer.grad_params) == sorted(n for n, _ in _Mixed().named_parameters())
    assert "compiled  encoder" in seg.explain()
    program = trainer.program
    assert not program.whole and program.update == trainer.update_engine.name
    kinds = {s.module: s.kind for s in program.segments}
    assert kinds["encoder"] == "compiled" and kinds["scorer"] == "split"
    # one process keeps no outputs' memory between steps (its peak is the forward's end);
    # ZeRO-2/3 do (tests/test_distributed.py)
    assert seg.model.outputs is None


def test_fallback_off_raises_the_cause():
    model = _Mixed()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = ORTTrainer(model, _sgd(model.parameters()), TrainerOptions(fallback="off"))
    with pytest.raises(GradientError, match="Det"):
        trainer.train_step(*_batches(1)[0])
    assert trainer.segments is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class _Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))


class _Deep(torch.nn.Module):
    """Repeated blocks, and glue with an op that has no gradient rule."""

    def __init__(self, blocks: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(_Block(16) for _ in range(blocks))
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        sign = torch.linalg.det(h[:, :4].reshape(-1, 2, 2)).unsqueeze(-1)  # no rule: glue
        return F.cross_entropy(self.out(h) * (1 + 0.01 * sign), y.remainder(4))


@pytest.mark.slow
def test_repeated_blocks_share_one_graph():
    trainer = train_like_eager(_Deep, _batches(4))
    seg = trainer.segments.model
    assert sorted(seg.compiled) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "inp", "out"]
    # one runner (a forward and a backward session) serves the four blocks
    runners = {
        id(r) for n in seg.compiled if n.startswith("blocks") for r in seg.runners[n].values()
    }
    assert len(runners) == 1
    assert seg.builds == 3  # inp, the blocks, out


@pytest.mark.slow
def test_accumulation_clipping_and_the_update_graph():
    train_like_eager(
        _Mixed,
        _batches(6),
        TrainerOptions(grad_accumulation_steps=2, max_grad_norm=0.5, update_engine="graph"),
        accumulation=2,
        clip=0.5,
    )


@pytest.mark.slow
def test_adamw_on_torchs_kernels_and_a_new_batch_shape():
    """AdamW (the CPU default engine for segments: torch's) and a batch of another size,
    which builds and checks that segment's graph for its new call signature at once
    (``eager_if_faster=False``; by default its calls run in eager until a build pays:
    tests/test_segment_signatures.py)."""
    batches = _batches(2) + _batches(2, rows=8, seed=2)

    def adamw(params):
        # eps above the gradients' float noise: AdamW's normalization would make a noise-sized
        # gradient difference an lr-sized step, and this test is about the plumbing
        return torch.optim.AdamW(params, lr=1e-3, eps=1e-3)

    trainer = train_like_eager(_Mixed, batches, TrainerOptions(eager_if_faster=False), opt=adamw)
    assert trainer.update_engine.name == "torch"
    assert len(trainer.segments.model.runners["encoder"]) == 2  # one graph per shape


class _Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.feat = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU()
        )
        self.scorer = _Det(16)

    def forward(self, x, y):
        return (self.scorer(self.feat(x)) - y.float()).pow(2).mean()


@pytest.mark.slow
def test_a_segment_updates_batch_norm_statistics_like_eager_and_evaluates():
    trainer = train_like_eager(_Normed, _batches(3))
    ref = _Normed()
    opt = _sgd(ref.parameters())
    for x, y in _batches(3):
        opt.zero_grad()
        ref(x, y).backward()
        opt.step()
    assert "feat" in trainer.segments.model.compiled
    for (k, b), r in zip(trainer.module.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, r, rtol=1e-5, atol=1e-6, msg=k)
    x, y = _batches(1, seed=9)[0]
    out = trainer.eval_step(x, y)
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(out["loss"], ref(x, y), rtol=1e-5, atol=1e-6)


def test_options_are_checked():
    with pytest.raises(ValueError, match="fallback must be 'auto' or 'off'"):
        TrainerOptions(fallback="eager")
    with pytest.raises(TypeError, match="verify"):
        TrainerOptions(verify="yes")  # type: ignore[arg-type]


def test_a_model_that_compiles_whole_stays_one_graph():
    """No segments, no warning where the whole model compiles (today's path)."""
    model = copy.deepcopy(_Block(8))

    class Whole(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = model

        def forward(self, x, y):
            return F.cross_entropy(self.block(x)[:, :3], y)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = train_like_eager(lambda: copy.deepcopy(Whole()), _batches(2))
    assert trainer.segments is None and len(trainer._graphs.train) == 1


class _InPlaceGlue(torch.nn.Module):
    """Eager glue that changes a segment's output in place, as eager code may when the
    op that made it does not keep it for its backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.scorer = _Det(8)

    def forward(self, x, y):
        h = self.lin(x)
        h.mul_(2.0)
        return F.cross_entropy(h[:, :3], y) + 0.01 * self.scorer(h).mean()


def test_eager_glue_may_change_a_segments_output_in_place():
    trainer = train_like_eager(_InPlaceGlue, _batches(3))
    assert "lin" in trainer.segments.model.compiled


class _MeanScaler(torch.nn.Module):
    """Returns a constant beside its computed outputs (a time-series scaler's ``loc``:
    ``zeros_like``, folded to an initializer that is the graph's output)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        scale = x.abs().mean(-1, keepdim=True) + 1.0
        return self.proj(x / scale), torch.zeros_like(scale), scale


class _ScaledWithDet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scaler = _MeanScaler()
        self.scorer = _Det(8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        h, loc, scale = self.scaler(x)
        logits = self.head(h) * scale + loc + 0.01 * self.scorer(h).unsqueeze(-1)
        return F.cross_entropy(logits, y)


def test_a_segment_that_returns_a_constant_compiles():
    """A segment output with no node behind it (a constant) gets no gradient and its
    seed still binds: the module compiles instead of being split into its children."""
    trainer = train_like_eager(_ScaledWithDet, _batches(3))
    seg = trainer.segments
    assert seg is not None and "scaler" in seg.model.compiled
    assert "scaler" not in {p.name for p in seg.model.fallbacks}


class _PassesThrough(torch.nn.Module):
    """Returns its argument and a parameter as they are (graph inputs as outputs)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.gain = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.proj(x), x, self.gain


class _PassedWithDet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.through = _PassesThrough()
        self.scorer = _Det(8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        h, same, gain = self.through(x)
        logits = self.head(h * gain + same) + 0.01 * self.scorer(h).unsqueeze(-1)
        return F.cross_entropy(logits, y)


def test_a_segment_that_returns_its_input_and_a_parameter_compiles():
    """Its graph's input stays bound by its name (onnx_ir's output fix renamed it, and
    the run stopped: "Missing Input"), the parameter's gradient comes through the
    output that is the parameter itself."""
    trainer = train_like_eager(_PassedWithDet, _batches(3))
    seg = trainer.segments
    assert seg is not None and "through" in seg.model.compiled
    assert "through" not in {p.name for p in seg.model.fallbacks}


class _Holder:
    """A plain object holding tensors: no graph output can be one."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class _ReturnsAnObject(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return _Holder(self.proj(x))


class _ObjectWithDet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wrapped = _ReturnsAnObject()
        self.scorer = _Det(8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        h = self.wrapped(x).h
        return F.cross_entropy(self.head(h) + 0.01 * self.scorer(h).unsqueeze(-1), y)


@dataclasses.dataclass
class _In:
    x: torch.Tensor
    scale: float


@dataclasses.dataclass
class _Out:
    h: torch.Tensor
    norms: tuple[torch.Tensor, ...]
    note: str = "kept"


class _TakesAndGivesDataclasses(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, inp: _In) -> _Out:
        h = self.proj(inp.x) * inp.scale
        return _Out(h, (h.norm(dim=-1),))


class _DataclassesWithDet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = _TakesAndGivesDataclasses()
        self.scorer = _Det(8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        out = self.body(_In(x, 0.5))
        assert isinstance(out, _Out) and out.note == "kept"  # the class, rebuilt
        logits = self.head(out.h) + 0.01 * out.norms[0].unsqueeze(-1)
        return F.cross_entropy(logits + 0.01 * self.scorer(out.h).unsqueeze(-1), y)


def test_a_segment_taking_and_returning_dataclasses_compiles():
    """A hand-written dataclass as argument and as result (pytree takes it as one leaf,
    which no graph input or output can be): opened into its fields, the module compiles
    whole and eager code gets an instance of its class back."""
    trainer = train_like_eager(_DataclassesWithDet, _batches(3))
    seg = trainer.segments
    assert seg is not None and "body" in seg.model.compiled
    assert "body" not in {p.name for p in seg.model.fallbacks}


class _Rotary(torch.nn.Module):
    """Rotates its projection by a complex table it is given (DeepSeek's rotary form)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, h, table):
        z = torch.view_as_complex(self.proj(h).reshape(*h.shape[:-1], -1, 2))
        return torch.view_as_real(z * table).flatten(-2)


class _ToComplex(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, h):
        return torch.view_as_complex(self.proj(h).reshape(*h.shape[:-1], -1, 2))


class _ScalesComplex(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, z):
        return torch.view_as_real(z * self.w).flatten(-2)


class _ComplexWithDet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rotary = _Rotary()
        self.to_complex = _ToComplex()
        self.scale = _ScalesComplex()
        self.scorer = _Det(8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        angles = torch.outer(torch.arange(x.shape[0]).float(), torch.linspace(0.1, 1.0, 4))
        table = torch.polar(torch.ones_like(angles), angles)
        h = self.rotary(x, table)
        z = self.to_complex(h) * table.conj()  # eager glue on the complex output
        h = self.scale(z)  # a complex input that needs its gradient
        return F.cross_entropy(self.head(h) + 0.01 * self.scorer(h).unsqueeze(-1), y)


def test_segments_take_and_give_complex_tensors():
    """The exporter gives a complex value as its real view: a segment's complex input is
    bound as that view, a complex output made complex again, and a complex input's
    gradient comes back complex (each segment compiles, none splits)."""
    trainer = train_like_eager(_ComplexWithDet, _batches(3))
    seg = trainer.segments
    assert seg is not None
    assert {"rotary", "to_complex", "scale"} <= set(seg.model.compiled)
    assert not {"rotary", "to_complex", "scale"} & {p.name for p in seg.model.fallbacks}


def test_a_segments_cause_is_its_own_not_the_whole_models():
    """A sub-module's export runs while the whole model's failure (a Det) is handled; the
    cause given for the sub-module is its own (an output a graph cannot give), not the
    Det's, which the exception chain also reaches."""
    trainer = train_like_eager(_ObjectWithDet, _batches(3))
    why = {p.name: p.cause for p in trainer.segments.model.fallbacks}
    assert "wrapped.proj" in trainer.segments.model.compiled
    assert "_Holder, which a compiled graph cannot take" in why["wrapped"], why["wrapped"]
    assert "Det" not in why["wrapped"], why["wrapped"]


class _MaxNorm(torch.nn.Module):
    """An embedding with ``max_norm``: its forward renormalises, in place, the rows a
    batch reads (under no_grad), a write to a parameter no graph can make."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(40, 8, max_norm=1.0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, y):
        ids = (x.abs() * 10).long().clamp(max=39)
        return F.cross_entropy(self.head(self.encoder(self.embed(ids).mean(1))), y)


def test_an_embedding_with_max_norm_runs_in_eager_with_its_cause_named():
    """The exporter stops at it with an internal assertion that names nothing; the cause
    given is the in-place write of the weight, and the renorm happens as in eager."""
    before = _MaxNorm().embed.weight.norm(dim=-1)
    assert (before > 1.0).sum() > 20  # rows the renorm must shrink
    with pytest.warns(UserWarning, match=r"Embedding 'embed' \(max_norm=1\) renormalises the rows"):
        trainer = train_like_eager(_MaxNorm, _batches(3))
    seg = trainer.segments
    assert "encoder" in seg.model.compiled and "embed" in {p.name for p in seg.model.fallbacks}
    after = trainer.module.embed.weight.norm(dim=-1)
    assert (after <= 1.0 + 1e-6).sum() > (before <= 1.0).sum()  # rows read were renormalised
    options = TrainerOptions(fallback="off", graph_cache=False)
    model = _MaxNorm()
    off = ORTTrainer(model, _sgd(model.parameters()), options)
    said = r"Embedding 'embed' \(max_norm=1\) renormalises the rows"
    with pytest.raises(ExportError, match=said):
        off.train_step(*_batches(1)[0])


@pytest.mark.slow
def test_segments_train_a_model_in_evaluation_mode_in_it_as_eager_does():
    """A model in evaluation mode (after an evaluation, or ``from_pretrained``) trains in
    that mode as eager does: its segments and their checks too, BatchNorm on its running
    statistics, which stay as they were."""

    def make():
        m = _Normed()
        m.eval()
        return m

    model, ref = make(), make()
    before = [b.clone() for b in model.buffers()]
    trainer = ORTTrainer(model, _sgd(model.parameters()))
    opt = _sgd(ref.parameters())
    for x, y in _batches(2):
        want = ref(x, y)
        want.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=0)
    assert trainer.segments is not None and not model.training  # its mode is left as it was
    for (k, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=k)
    for (k, b), r, b0 in zip(model.named_buffers(), ref.buffers(), before):
        torch.testing.assert_close(b, r, rtol=0, atol=0, msg=k)
        if b.is_floating_point():
            torch.testing.assert_close(b, b0, rtol=0, atol=0, msg=k)  # statistics untouched


class _Reversible(torch.autograd.Function):
    """A reversible residual as Reformer's: the forward runs ``f`` under no_grad (no
    activations kept); the backward runs it again with grad and backpropagates through it
    itself, which writes ``f``'s parameters' ``.grad`` directly."""

    @staticmethod
    def forward(ctx, x, f):
        ctx.f = f
        ctx.save_for_backward(x)
        with torch.no_grad():
            return x + f(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            ctx.f(x).backward(grad)
        return grad + x.grad, None


class _RevNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, 16)
        self.f = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.head(_Reversible.apply(self.embed(x), self.f)), y)


def test_gradients_a_custom_backward_writes_itself_are_eagers_too():
    """The export sees ``f`` read under no_grad only, so the whole graph computes no
    gradient for its parameters; eager's backward gives them one (written into ``.grad``
    by the Function's backward). The first-step check counts that gradient: the whole
    graph is refused before it lays out the gradients, and the segments run ``f`` again
    with grad as eager does (a second graph for the call whose input requires grad)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train_like_eager(_RevNet, _batches(4))
    assert len([w for w in caught if "does not compile as one graph" in str(w.message)]) == 1
    seg = trainer.segments
    assert seg is not None and re.search(r"f\.0\.(weight|bias) \(only eager has it\)", seg.cause)
    assert "f" in seg.model.compiled
    assert sorted(trainer.grad_params) == sorted(n for n, _ in _RevNet().named_parameters())
    model = _RevNet()
    trainer = ORTTrainer(model, _sgd(model.parameters()), TrainerOptions(fallback="off"))
    with pytest.raises(VerificationError, match=r"f\.0\.(weight|bias) \(only eager has it\)"):
        trainer.train_step(*_batches(1)[0])


class _Annealed(torch.nn.Module):
    """A temperature annealed per call in a Python attribute of a sub-module, and a list
    the top module appends to: eager computes with new values every call."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
        self.head = _TemperedHead()
        self.seen: list[int] = []

    def forward(self, x, y):
        self.seen.append(len(self.seen))
        scale = 1.0 if len(self.seen) % 2 else 0.5
        return F.cross_entropy(self.head(self.encoder(x)), y) * scale


class _TemperedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 3)
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        return self.lin(h) / (1.0 + 0.25 * self.calls)


def test_python_attributes_a_forward_changes_every_call_run_in_eager():
    """A graph would hold ``calls`` and the list's length at their export-time values and
    train another loss from the second step on, with the first step agreeing with eager.
    The first-step check sees them change on two calls in a row: the owners run in eager
    (the head's linear layer and the encoder compile), and ortrain's own eager runs (the
    check, the recording forward) leave them as they were, so the losses equal eager's
    step by step; with fallback "off" the whole graph is refused, naming them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train_like_eager(_Annealed, _batches(4))
    seg = trainer.segments
    assert seg is not None and "calls (" in seg.cause and "seen (" in seg.cause
    assert sorted(seg.model.compiled) == ["encoder", "head.lin"]
    assert {p.name: p.status for p in seg.model.fallbacks} == {"head": "split"}
    assert len([w for w in caught if "does not compile as one graph" in str(w.message)]) == 1
    # evaluation runs in eager too, and advances the schedule as eager's does
    ref = _Annealed()
    for x, y in _batches(4):  # ref where the trained model is: same weights, same calls
        ref(x, y)
    ref.load_state_dict(trainer.module.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in _batches(2, seed=7):
            got = trainer.eval_step(x, y).loss
            with torch.no_grad():
                want = ref.eval()(x, y)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert trainer.module.head.calls == ref.head.calls == 6
    assert len([w for w in caught if "evaluation runs in eager" in str(w.message)]) == 1
    model = _Annealed()
    trainer = ORTTrainer(model, _sgd(model.parameters()), TrainerOptions(fallback="off"))
    with pytest.raises(VerificationError, match=r"_Annealed\.head: calls \(\d+ -> \d+\)"):
        trainer.train_step(*_batches(1)[0])
    assert model.head.calls == 0 and model.seen == []  # the refusal advanced nothing


def test_a_cache_set_on_the_first_call_only_keeps_the_whole_graph():
    """An attribute a forward sets once (a lazily built cache) is no schedule."""

    class Lazy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 3)
            self.ready = False

        def forward(self, x, y):
            self.ready = True
            return F.cross_entropy(self.lin(x), y)

    trainer = train_like_eager(Lazy, _batches(3))
    assert trainer.segments is None


class _Autocast(torch.nn.Module):
    """A bfloat16 autocast region of the user's own inside the forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.tanh(self.body(x))
        return F.cross_entropy(self.head(h.float()), y)


def test_a_users_autocast_region_runs_in_eager_with_its_casts():
    """The whole graph computes the region in float32 and disagrees with eager's bfloat16
    (the float64 second look cannot run a forward that mixes dtypes on purpose: the
    mismatch stands); as segments, a module called inside the region runs in eager (a
    graph would not make autocast's casts) and the rest compiles."""
    trainer = train_like_eager(_Autocast, _batches(3))
    seg = trainer.segments
    assert seg is not None and seg.model.compiled == ["head"]
    assert "torch.autocast('cpu', torch.bfloat16)" in seg.model.plans["body"].cause


class _Scripted(torch.nn.Module):
    """A TorchScript sub-module (no export, no hooks) before a plain head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()))
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.body(x)), y)


def test_a_torchscript_sub_module_runs_in_eager():
    """The recording forward hooks every sub-module but TorchScript ones (they take no
    hooks: that failure was taken for the model's own, "fails in eager too")."""
    trainer = train_like_eager(_Scripted, _batches(3))
    assert trainer.segments is not None and trainer.segments.model.compiled == ["head"]


class _CompiledInside(torch.nn.Module):
    """A ``torch.compile``'d block in a model that trains as segments (its Det has no
    gradient rule): dynamo traced the segment's runner with fake tensors, which ONNX
    Runtime could not bind."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.body = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()))
        self.det = _Det(16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, y):
        h = self.body(self.inp(x))
        return F.cross_entropy(self.head(h), y) + 0.01 * self.det(h).mean()


def test_a_compiled_sub_module_of_a_segmented_model_trains_like_eager():
    trainer = train_like_eager(_CompiledInside, _batches(3))
    assert trainer.segments is not None
    compiled = trainer.segments.model.compiled
    assert "head" in compiled and "body._orig_mod" in compiled, compiled
    body = next(p for p in trainer.segments.model.fallbacks if p.name == "body")
    assert body.status == "split" and "torch.compile'd module" in body.cause


class _Hooked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (
            torch.nn.Linear(8, 8),
            torch.nn.Linear(8, 8),
            torch.nn.Linear(8, 3),
        )

    def forward(self, x, y):
        return F.cross_entropy(self.c(torch.tanh(self.b(torch.relu(self.a(x))))), y)


def _clip_by_value(model: torch.nn.Module) -> torch.nn.Module:
    for p in model.parameters():
        p.register_hook(lambda g: g.clamp(-0.01, 0.01))
    return model


def _scaled_after_accumulation(model: torch.nn.Module) -> torch.nn.Module:
    def scale(p: torch.Tensor) -> None:
        p.grad.mul_(0.1)

    for p in model.b.parameters():
        p.register_post_accumulate_grad_hook(scale)
    return model


@pytest.mark.parametrize("hooks", [_clip_by_value, _scaled_after_accumulation])
def test_gradient_hooks_on_parameters_run_as_in_eager(hooks):
    """``p.register_hook`` (a clip by value) and ``register_post_accumulate_grad_hook``
    change what the update reads; a graph's gradients would bypass them (they trained as
    if there were none, silently): the model trains as segments inside torch's autograd,
    where they run, and says why."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train_like_eager(lambda: hooks(_Hooked()), _batches(4))
    assert trainer.segments is not None
    said = [str(w.message) for w in caught if "does not compile as one graph" in str(w.message)]
    assert len(said) == 1 and "gradient hooks" in said[0] and "register_hook" in said[0]


def test_a_logging_hook_sees_each_step_once_as_in_eager():
    """A hook that logs (``wandb.watch`` puts such hooks on parameters) runs once per
    parameter and step, as in eager: the padding check of each new length (bucketing's
    two eager looks, ``torch.autograd.grad``) is not a step and runs with it paused."""
    from tests.conftest import gpt2

    seen: dict[str, list[float]] = {"ortrain": [], "eager": []}

    def make(side: str):
        def build() -> torch.nn.Module:
            model = gpt2(layers=1, hidden=32, vocab=64)
            model.transformer.h[0].mlp.c_fc.weight.register_hook(
                lambda g: seen[side].append(float(g.norm()))
            )
            return model

        return build

    g = torch.Generator().manual_seed(3)
    batches = []
    for length in (8, 6, 7, 8):  # each new length below a bucket checks its padding
        ids = torch.randint(1, 64, (2, length), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    model, ref = make("ortrain")(), make("eager")()
    trainer = ORTTrainer(model, _sgd(model.parameters()))
    opt = _sgd(ref.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in batches:
            got = trainer.train_step(**batch)
            loss = ref(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=0)
    assert trainer.segments is not None  # the hook's parameter trains through autograd
    assert trainer.bucketing.verdicts, "no padding check ran"
    assert len(seen["ortrain"]) == len(seen["eager"]) == len(batches)
    torch.testing.assert_close(seen["ortrain"], seen["eager"], rtol=1e-4, atol=0)


def test_gradient_hooks_with_fallback_off_are_refused():
    model = _clip_by_value(_Hooked())
    trainer = ORTTrainer(model, _sgd(model.parameters()), TrainerOptions(fallback="off"))
    with pytest.raises(VerificationError, match=r"a\.weight.*gradient hooks.*fallback='auto'"):
        trainer.train_step(*_batches(1)[0])


def test_ortrains_own_hooks_are_not_taken_for_the_users():
    """Segments and ZeRO hook parameters themselves (a tied gradient's check, the reached
    set); a trainer that tried segments once (a batch without labels) and went back to its
    graph must not take those for the user's and leave the graph for segments."""
    from ortrain.core.own_hooks import own_hook, users_hooks

    p = torch.nn.Parameter(torch.zeros(2))
    p.register_hook(own_hook(lambda g: None))
    p.register_post_accumulate_grad_hook(own_hook(lambda q: None))
    assert not users_hooks(p)
    p.register_post_accumulate_grad_hook(lambda q: None)
    assert users_hooks(p)


class _FullDropout(torch.nn.Module):
    """A branch switched off with Dropout(p=1.0) (eager: zeros, zero gradients)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 16)
        self.branch = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(1.0))
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, y):
        h = torch.tanh(self.body(x))
        return F.cross_entropy(self.head(h + self.branch(h)), y)


def test_a_dropout_of_probability_one_runs_in_eager():
    """ONNX's Dropout takes [0, 1): ONNX Runtime's kernel failed the first step."""
    trainer = train_like_eager(_FullDropout, _batches(3))
    seg = trainer.segments
    assert seg is not None and "probability 1" in seg.cause
    assert seg.model is not None and {"body", "head"} <= set(seg.model.compiled)


class _Repeats(torch.nn.Module):
    """A refinement applied once per value of a batch input (none: ``w`` is not read)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 8)
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 8))

    def forward(self, x, reps):
        out = self.lin(x)
        for r in reps.tolist():
            out = out + r * torch.tanh(out * self.w)
        return (out - 0.3).pow(2).mean()


def test_a_batch_that_reaches_other_parameters_moves_to_segments():
    """The third batch's graph does not reach ``w``: one graph lays out one set of
    gradients, so the model trains as segments from there (before: a BatchError)."""
    g = torch.Generator().manual_seed(5)
    reps = [
        torch.tensor([1.0]),
        torch.tensor([0.5, 2.0, -1.0]),
        torch.tensor([]),
        torch.tensor([1.5]),
    ]
    batches = [(torch.randn(4, 6, generator=g), r) for r in reps]
    model, ref = _Repeats(), _Repeats()
    opt, opt_ref = _sgd(model.parameters()), _sgd(ref.parameters())
    # (each shape built at once, not deferred in eager: the third's graph is the point)
    trainer = ORTTrainer(model, opt, TrainerOptions(eager_if_faster=False))
    for i, (x, r) in enumerate(batches):
        want = ref(x, r)
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        got = trainer.train_step(x, r)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    assert trainer.segments is not None and "different set of parameters" in trainer.segments.cause


class _Detached(torch.nn.Module):
    """A loss that, for ``detach=True`` batches, depends on no parameter (eager's
    ``backward()`` raises); ``det``: a part without a gradient rule (segments)."""

    def __init__(self, det: bool):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.det = det

    def forward(self, x, y, detach):
        h = self.lin(x)
        if self.det:
            h = h * torch.linalg.det(h[:2, :2].reshape(1, 2, 2))
        if detach:
            h = h.detach()
        return ((h.sum(-1) - y) ** 2).mean()


@pytest.mark.parametrize("det", [False, True], ids=["whole graph", "segments"])
def test_a_loss_that_reaches_no_parameter_is_refused_as_eager_refuses_it(det):
    model = _Detached(det)
    trainer = ORTTrainer(model, _sgd(model.parameters()), TrainerOptions())
    x, y = torch.randn(3, 4), torch.randn(3)
    trainer.train_step(x, y, False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="does not require grad"):
        model(x, y, True).backward()  # eager
    with pytest.raises(BatchError, match="depends on no parameter that requires grad"):
        trainer.train_step(x, y, True)
    trainer.sync_to_module()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert (trainer.segments is not None) == det


@pytest.mark.parametrize("off", ["no_grad", "inference_mode", "set_grad_enabled"])
def test_a_step_with_gradients_off_is_refused_as_eager_refuses_its_backward(off):
    """Inside ``torch.no_grad()`` (and the like) eager's backward raises; the graph has
    no such mode and trained on (no_grad) or blamed the loss (inference_mode)."""
    model = _Detached(False)
    trainer = ORTTrainer(model, _sgd(model.parameters()), TrainerOptions())
    x, y = torch.randn(3, 4), torch.randn(3)
    trainer.train_step(x, y, False)
    before = [p.detach().clone() for p in model.parameters()]
    context = {
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
        "set_grad_enabled": lambda: torch.set_grad_enabled(False),
    }[off]
    with context():
        with pytest.raises(RuntimeError, match="does not require grad"):
            model(x, y, False).backward()  # eager
        with pytest.raises(BatchError, match=r"gradients off \(inside torch.no_grad\(\)"):
            trainer.train_step(x, y, False)
    trainer.sync_to_module()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    trainer.train_step(x, y, False)  # outside it again: trains
    assert not torch.equal(next(model.parameters()), before[0])


class _WideOutputPadding(torch.nn.Module):
    """A ConvTranspose2d whose output_padding is past its stride (torch allows it below
    the dilation); ONNX Runtime's kernel refuses to run it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = torch.nn.Linear(4, 4)
        self.up = torch.nn.ConvTranspose2d(
            2, 4, (4, 5), stride=(3, 2), padding=(1, 2), output_padding=(2, 3), groups=2,
            dilation=(4, 4),
        )  # fmt: skip
        self.post = torch.nn.Linear(22, 3)

    def forward(self, x):
        return self.post(self.up(self.pre(x))).pow(2).mean()


def test_a_graph_onnxruntime_cannot_run_trains_its_module_in_eager():
    model, ref = _WideOutputPadding(), _WideOutputPadding()
    x = torch.randn(2, 2, 4, 4)
    alone = _WideOutputPadding()
    off = ORTTrainer(alone, _sgd(alone.parameters()), TrainerOptions(fallback="off"))
    with pytest.raises(RuntimeError, match="ConvTranspose"):
        off.train_step(x)
    trainer = ORTTrainer(model, _sgd(model.parameters()), TrainerOptions())
    opt_ref = _sgd(ref.parameters())
    for i in range(2):
        got = trainer.train_step(x)
        opt_ref.zero_grad()
        want = ref(x)
        want.backward()
        opt_ref.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
    trainer.sync_to_module()
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    seg = trainer.segments
    assert seg is not None and seg.cause.startswith("ONNX Runtime could not run the graph")
    assert [(p.name, p.status) for p in seg.model.fallbacks] == [("up", "eager")]


class _NoGradThrough(torch.autograd.Function):
    """Passes its input on and gives it no gradient (None), as some of torch's backward
    formulas do (``torch.norm(x, p=0)``)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return None


class _HalfReached(torch.nn.Module):
    """``b``'s output reaches the loss only through ``_NoGradThrough``: eager gives ``b`` no
    gradient, so the optimizer skips it (no weight decay, no momentum)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        return (self.a(x) ** 2).mean() + _NoGradThrough.apply(self.b(x)).mean()


class _Zeroed(torch.nn.Module):
    """A loss that eager's autograd reaches with zero gradients (a ``zero_`` of what the
    layer made), which the export computes from no parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).clone().zero_().sum() + x.sum()


@pytest.mark.parametrize("cls", [_HalfReached, _Zeroed])
def test_parameters_without_a_gradient_or_with_zeros_step_as_in_eager(cls):
    model, ref = cls(), cls()

    def sgd(params):  # weight decay and momentum move a parameter given zeros, not None
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)

    trainer = ORTTrainer(model, sgd(model.parameters()), TrainerOptions())
    opt_ref = sgd(ref.parameters())
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for i in range(3):
        got = trainer.train_step(x)
        opt_ref.zero_grad()
        want = ref(x)
        want.backward()
        opt_ref.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i}")
    trainer.sync_to_module()
    assert trainer.segments is not None
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    start = cls()
    moved = [k for k, p in model.named_parameters() if not torch.equal(p, start.get_parameter(k))]
    # b is skipped (no gradient); the zeroed layer moves by weight decay and momentum alone
    assert moved == (["a.weight", "a.bias"] if cls is _HalfReached else ["lin.weight", "lin.bias"])
