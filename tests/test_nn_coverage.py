"""Breadth as a measured property (ortrain/coverage/): every torch.nn class and every
public callable of torch.nn.functional has an entry, every spec trains like eager, and
docs/model-coverage.md lists exactly the current specs.

1. (fast) every class of ``vars(torch.nn)`` has a spec or a reason, every public callable
   of ``torch.nn.functional`` a spec, a class's spec that calls it, or a reason; no entry
   is stale; every spec's harness is deterministic and its loss reaches every parameter;
2. (fast) a function said to be exercised by a class's spec is called by that spec's
   forward (recorded), and the reasons that are facts about eager PyTorch still hold;
3. (fast) the page is the current table: rendered again from the outcomes it lists, it is
   itself (every spec has a row, every row a spec; outcomes change only by regenerating);
4. (slow, one test per spec) each spec trains through ``ORTTrainer`` like eager: compiled
   or compiled with fallback, never WRONG; a refusal only where ``EXPECTED_REFUSALS``
   lists it with its cause, so a new refusal fails;
5. (slow) the check itself fails a model that does not train like eager.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ortrain.coverage import catalog, report
from ortrain.coverage.check import (
    COMPILED,
    FALLBACK,
    REFUSED,
    WRONG,
    _differences,
    train_against_eager,
)
from ortrain.coverage.spec import Float, Harness, Spec

SPECS = catalog.all_specs()
_LISTED = report.listed(report.DOC.read_text())  # the page's outcomes by spec id

# Specs that are refused today, each with a part of its cause (the exception's type and
# first line): a refusal not listed here fails, and so does a listed one that trains. None
# today: the refusals the table first showed (eager changing a segment's output in place,
# a sparse gradient in the first-step check, a graph ONNX Runtime refuses) were bugs of the
# fallback, fixed, each shown on its own in section 6.
EXPECTED_REFUSALS: dict[str, str] = {}


# ----------------------------------------------------------------------------- 1. entries
def test_every_torch_nn_class_has_a_spec_or_a_reason():
    classes = catalog.nn_classes()
    assert len(classes) > 150 and "Linear" in classes and "LinearCrossEntropyLoss" in classes
    covered = {s.covers for s in SPECS}
    missing = [c for c in classes if c not in covered and c not in catalog.NOT_A_LAYER]
    assert not missing, f"torch.nn classes without a spec or a reason: {missing}"
    both = sorted(covered & set(catalog.NOT_A_LAYER))
    assert not both, f"classes with a spec and a reason: {both}"


def test_every_functional_callable_has_a_spec_a_class_spec_or_a_reason():
    names = catalog.functional_names()
    assert len(names) > 120 and "grid_sample" in names
    own = {s.covers.removeprefix("F.") for s in SPECS if s.covers.startswith("F.")}
    entries = own | set(catalog.EXERCISED_BY) | set(catalog.NOT_AN_OP)
    missing = [n for n in names if n not in entries]
    assert not missing, f"torch.nn.functional callables without an entry: {missing}"
    reasoned = set(catalog.NOT_AN_OP) & (own | set(catalog.EXERCISED_BY))
    assert not reasoned, f"functions with a spec and a reason: {sorted(reasoned)}"


def test_no_entry_is_stale():
    classes, functions = set(catalog.nn_classes()), set(catalog.functional_names())
    assert not set(catalog.NOT_A_LAYER) - classes
    assert not set(catalog.NOT_AN_OP) - functions
    assert not set(catalog.EXERCISED_BY) - functions
    ids = [s.id for s in SPECS]
    assert len(ids) == len(set(ids)), "spec ids repeat"
    for spec in SPECS:
        if catalog.section(spec) == "utils":
            owner, _, name = ("torch.nn." + spec.covers).rpartition(".")
            assert callable(getattr(importlib.import_module(owner), name, None)), spec.id
            continue
        name = spec.covers.removeprefix("F.")
        assert name in (functions if spec.covers.startswith("F.") else classes), spec.id
    pointers = {f: i for f, i in catalog.EXERCISED_BY.items() if i not in set(ids)}
    assert not pointers, f"EXERCISED_BY names specs that do not exist: {pointers}"
    assert not set(EXPECTED_REFUSALS) - set(ids), "EXPECTED_REFUSALS names unknown specs"


def test_every_harness_is_deterministic_and_its_loss_reaches_every_parameter():
    """A spec whose loss does not reach the unit would compare nothing."""
    warnings.simplefilter("ignore")
    unreached = []
    for spec in SPECS:
        (first,) = spec.batches(1)
        a, b = Harness(spec, first), Harness(spec, first)
        for (k, p), q in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(p, q), (spec.id, k)
            # the trained harness and the eager one must not share a tensor
            shared = p.numel() and p.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
            assert not shared, (spec.id, k)
        loss = a(*first)
        assert loss.dim() == 0 and torch.isfinite(loss), spec.id
        loss.backward()
        missing = [n for n, p in a.named_parameters() if p.grad is None]
        unit = [p.grad for n, p in a.named_parameters() if n.startswith("unit.")]
        if missing or (unit and not any(bool(g.abs().sum() > 0) for g in unit)):
            unreached.append((spec.id, missing))
    assert not unreached, f"specs whose loss does not reach their parameters: {unreached}"


# ---------------------------------------------------------------------- 2. exercised, facts
class _Called(TorchFunctionMode):
    """The torch functions a forward calls (the outermost of nested calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.add(func)
        return func(*args, **(kwargs or {}))


def _dispatch_targets(fn) -> set:
    """A ``boolean_dispatch`` function (``max_pool2d``) runs one of two functions."""
    from torch._jit_internal import boolean_dispatched

    table = boolean_dispatched.get(fn)
    return {fn} if table is None else {fn, table["if_true"], table["if_false"]}


@pytest.mark.parametrize("name", sorted(catalog.EXERCISED_BY))
def test_a_function_exercised_by_a_class_spec_is_called_by_it(name):
    spec = catalog.spec_by_id(catalog.EXERCISED_BY[name])
    (first,) = spec.batches(1)
    harness = Harness(spec, first)
    with _Called() as called:
        harness(*first)
    assert _dispatch_targets(getattr(F, name)) & called.seen, (
        f"{spec.id}'s forward does not call F.{name}"
    )


def test_the_reasons_about_eager_still_hold():
    """When torch learns these, they get specs."""
    w = torch.randn(2, 8, 4, requires_grad=True)
    out = F.grouped_mm(torch.randn(2, 4, 4), w.transpose(-2, -1))
    with pytest.raises(RuntimeError, match="Invalid strides/sizes"):
        out.sum().backward()
    h = torch.randn(2, 4, 3, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="not implemented"):
        F.native_channel_shuffle(h, 2).sum().backward()


def test_causes_are_shortened_to_the_op_and_why():
    from ortrain.coverage.check import shorten

    guard = (
        "ExportError: torch.onnx.export failed for Harness: GuardOnDataDependentSymNode: Could "
        "not guard on data-dependent expression Eq(u0, 0) (unhinted: Eq(u0, 0)).  (Size-like "
        "symbols: u0) (at adaptive.py:231 in forward: `if n == 0:`)"
    )
    assert shorten(guard) == (
        "export: GuardOnDataDependentSymNode: Could not guard on data-dependent expression "
        "Eq(u0, 0). (at adaptive.py:231 in forward: `if n == 0:`)"
    )
    known = (
        "ExportError: torch.onnx.export failed for Harness: Embedding 'unit' (max_norm=1) "
        "renormalises the rows a batch reads in place, a write to its weight that a graph "
        "cannot make (the exporter: AssertionError: expected compiled_fn to be GraphModule)"
    )
    assert shorten(known).endswith("a graph cannot make")
    assert len(shorten("x" * 400)) == 150


def test_differences_compare_element_by_element():
    want = {"w": torch.tensor([1.0, 2.0, float("nan")]), "n": torch.tensor([3])}
    assert _differences({k: v.clone() for k, v in want.items()}, want, 1e-5, 1e-6) == []
    off = {"w": torch.tensor([1.0, 2.0001, float("nan")]), "n": torch.tensor([4])}
    found = _differences(off, want, 1e-5, 1e-6)
    assert [f.split(":")[0] for f in found] == ["n", "w"]
    assert "1 of 3 elements differ" in found[1]
    assert _differences({"w": torch.ones(2)}, {"w": torch.ones(3)}, 1e-5, 1e-6)


# ----------------------------------------------------------------------------- 3. the page
def test_the_page_lists_exactly_the_current_specs():
    text = report.DOC.read_text()
    listed = report.listed(text)
    ids = [s.id for s in SPECS]
    missing = [i for i in ids if i not in listed]
    extra = [i for i in listed if i not in set(ids)]
    hint = "regenerate: python -m ortrain.coverage --write"
    assert not missing and not extra, f"missing rows {missing[:5]}, stale rows {extra[:5]}; {hint}"
    assert list(listed) == ids, f"rows out of order; {hint}"
    assert text == report.page(listed, text), f"docs/model-coverage.md is stale; {hint}"


def test_the_page_lists_no_wrong_outcome_and_only_expected_refusals():
    listed = report.listed(report.DOC.read_text())
    assert not [i for i, o in listed.items() if o.kind == WRONG]
    refused = {i for i, o in listed.items() if o.kind == REFUSED}
    assert refused == set(EXPECTED_REFUSALS)


# ----------------------------------------------------------------------------- 4. training
@pytest.fixture
def _spec_builds(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec's build takes seconds: a forked build child that hangs is given up (and the
    build run in process) after two minutes, not conftest's ten. Builds and the first
    step's eager reference run in this process (``ORTRAIN_BUILD_IN_PROCESS``): the table
    checks each layer's graph, and the forked-build tests and every end-to-end test check
    the children; each fork of a test worker costs about 0.15 s of system time, a fifth
    of this table's. Not for a lazy module, whose first call materializes its parameters
    in whichever process makes it (``first_step.EagerSide._build_lazy_buffers``)."""
    monkeypatch.setenv("ORTRAIN_EXPORT_TIMEOUT", "120")
    if "Lazy" not in request.node.callspec.params["spec_id"]:
        monkeypatch.setenv("ORTRAIN_BUILD_IN_PROCESS", "1")


@pytest.mark.slow
@pytest.mark.usefixtures("_spec_builds")
@pytest.mark.parametrize("spec_id", [s.id for s in SPECS])
def test_spec_trains_like_eager(spec_id):
    outcome = train_against_eager(catalog.spec_by_id(spec_id))
    assert outcome.kind != WRONG, outcome.detail
    if spec_id in EXPECTED_REFUSALS:
        assert outcome.kind == REFUSED, f"listed as refused, now {outcome.kind}: update the table"
        assert EXPECTED_REFUSALS[spec_id] in outcome.detail, outcome.detail
    else:
        assert outcome.kind in (COMPILED, FALLBACK), outcome.detail
    # the page is a guard too: a row it lists as compiled that now falls back is a
    # regression (a fallback trains correctly, so nothing else would show it); one that
    # now compiles wants the page regenerated
    listed = _LISTED.get(spec_id)
    if listed is not None and listed.kind != outcome.kind:
        what = "regressed" if listed.kind == COMPILED else "changed: regenerate the page"
        raise AssertionError(
            f"listed as {listed.kind}, now {outcome.kind} ({what}): {outcome.detail}"
        )


# ----------------------------------------------------------------------------- 5. the check
_calls = [0]


class _Drifting(torch.nn.Module):
    """Not a function of its inputs and weights: each call scales by a new number, so the
    graph (traced once) and eager disagree after the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, h):
        _calls[0] += 1
        return self.lin(h) * (1.0 + 0.1 * _calls[0])


@pytest.mark.slow
def test_the_check_reports_a_model_that_does_not_train_like_eager():
    spec = Spec("Drifting", "", _Drifting, (Float((3, 4)),))
    outcome = train_against_eager(spec)
    assert outcome.kind == WRONG, outcome
    assert "loss at step 0" in outcome.detail or "loss at step 1" in outcome.detail


# -------------------------- 6. found by the table, fixed (each was a strict xfail first)
class _InPlaceAfterSegment(torch.nn.Module):
    """Eager glue that changes a compiled segment's output in place (as ``RReLU(inplace=
    True)`` after a Linear does), with an op without a gradient rule (Det) so the model
    trains as segments."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, h):
        z = self.lin(h)
        z.mul_(2.0)  # eager PyTorch allows it: Linear's backward does not read its output
        return torch.linalg.det(z.reshape(-1, 2, 2)).pow(2).mean()


@pytest.mark.slow
def test_eager_code_may_change_a_segment_output_in_place():
    model, ref = _InPlaceAfterSegment(), _InPlaceAfterSegment()
    from ortrain import ORTTrainer

    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for seed in range(2):
        h = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
        got = trainer.train_step(h)
        opt.zero_grad()
        want = ref(h)
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0)
    assert trainer.segments is not None and trainer.segments.model.compiled == ["lin"]
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)


class _SparseEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4, sparse=True)

    def forward(self, ids):
        return (self.emb(ids) ** 2).mean()


def test_the_first_step_check_takes_a_sparse_gradient():
    from ortrain.verify import compare

    model = _SparseEmbedding()
    ids = torch.tensor([[1, 2, 2], [0, 9, 1]])
    model(ids).backward()
    sparse = model.emb.weight.grad
    assert sparse.is_sparse
    assert compare({"emb.weight": sparse.to_dense()}, {"emb.weight": sparse}, 1e-3) == []


def _attention_inputs() -> torch.Tensor:
    return torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(0))


def test_no_dropout_reaches_multihead_attentions_own_dropout():
    from ortrain.verify import no_dropout

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, dropout=0.5)
    plain = torch.nn.MultiheadAttention(8, 2, dropout=0.0)
    plain.load_state_dict(mha.state_dict())
    q = _attention_inputs()
    with no_dropout():
        got = mha(q, q, q)[0]
    torch.testing.assert_close(got, plain(q, q, q)[0], rtol=0, atol=0)


def test_no_dropout_reaches_the_dropout_between_recurrent_layers():
    from ortrain.verify import no_dropout

    torch.manual_seed(0)
    lstm = torch.nn.LSTM(8, 5, num_layers=2, dropout=0.5)
    plain = torch.nn.LSTM(8, 5, num_layers=2, dropout=0.0)
    plain.load_state_dict(lstm.state_dict())
    h = _attention_inputs()
    with no_dropout():
        got = lstm(h)[0]
    torch.testing.assert_close(got, plain(h)[0], rtol=0, atol=0)


class _SoftTargets(torch.nn.Module):
    """Cross-entropy with class probabilities as targets (the exporter's own translation
    wrote a SoftmaxCrossEntropyLoss with float labels, which ONNX Runtime refuses to load;
    ``ortrain/export_losses.py`` spells it as torch computes it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 5)

    def forward(self, h, target):
        return torch.nn.functional.cross_entropy(self.lin(h), target)


def _train_soft_targets(trainer, ref) -> None:
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        h, target = torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g).softmax(1)
        got = trainer.train_step(h, target)
        opt.zero_grad()
        want = ref(h, target)
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_probability_targets_compile_as_one_graph():
    from ortrain import ORTTrainer

    model, ref = _SoftTargets(), _SoftTargets()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.5))
    _train_soft_targets(trainer, ref)
    assert trainer.segments is None


@pytest.mark.slow
def test_a_graph_onnx_runtime_refuses_falls_back_to_eager(monkeypatch):
    """ONNX Runtime refusing the whole model's graph (a kernel it lacks for these types;
    injected here: the session of the first built graph raises ONNX Runtime's own error)
    makes the model segments, which train like eager."""
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidGraph

    import ortrain.program_context as context_mod
    from ortrain import ORTTrainer

    real, calls = context_mod.make_session, []

    def refusing_first(model, **kw):
        if hasattr(model, "ort_data"):  # a built graph (not the update graph)
            calls.append(model)
            if len(calls) == 1:
                raise InvalidGraph("[ONNXRuntimeError] : 10 : INVALID_GRAPH : injected refusal")
        return real(model, **kw)

    monkeypatch.setattr(context_mod, "make_session", refusing_first)
    model, ref = _SoftTargets(), _SoftTargets()
    with pytest.warns(UserWarning, match="ONNX Runtime refused the graph: .*injected refusal"):
        trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.5))
        _train_soft_targets(trainer, ref)
    assert trainer.segments is not None and len(calls) > 1


class _TransposedTimesVector(torch.nn.Module):
    """W.T @ v with a 1-D v (spectral_norm's power iteration does it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 3))

    def forward(self, v):
        return ((self.w.t() @ v) ** 2).sum()


@pytest.mark.slow
def test_a_transposed_matrix_times_a_vector_evaluates_like_eager():
    from ortrain import ORTTrainer, TrainerOptions

    model = _TransposedTimesVector()
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions(verify=False)
    )
    v = torch.randn(4, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(v)
    torch.testing.assert_close(trainer.eval_step(v)["loss"], want, rtol=1e-5, atol=0)
