"""A new batch shape's graph built once its eager steps have lost a build's time
(``ortrain/deferred_builds.py``): the rule's arithmetic, and training through it equal to
eager PyTorch's step by step, the graphs built where the rule says."""

from __future__ import annotations

import copy

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions, explain
from ortrain.deferred_builds import DeferredBuilds, Rented, elements


def _batch(rows: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, length, 6, generator=g)}


def _rule(build_s: float | None, graph_step_s: float) -> DeferredBuilds:
    rule = DeferredBuilds(ctx=None)  # type: ignore[arg-type]  # (its eager steps unused)
    rule.build_seconds = build_s
    batch = _batch(2, 5, 0)
    rule._per_element.append(graph_step_s / elements(batch))
    return rule


def test_a_shape_steps_in_eager_until_its_losses_reach_a_build() -> None:
    batch = _batch(2, 5, 0)
    sig = ("shape",)
    rule = _rule(build_s=0.9, graph_step_s=0.1)
    rented = 0
    while rule.rents(sig, batch):  # eager 0.3 s a step, 0.2 s lost each: 4 steps < 0.9 s
        r = rule.rented.setdefault(sig, Rented())
        r.seconds, r.elements, r.steps = r.seconds + 0.3, r.elements + elements(batch), r.steps + 1
        rented += 1
        assert rented < 100
    assert rented == 4
    assert rule.lost(sig) == pytest.approx(0.8)
    rule.graph_step(sig, batch, 2.5, built=True)  # the build: its time is the next's price
    assert rule.build_seconds == 2.5 and sig in rule.built and sig not in rule.rented


def test_no_build_known_builds_and_eager_as_fast_never_does() -> None:
    batch, sig = _batch(2, 5, 0), ("shape",)
    assert not _rule(build_s=None, graph_step_s=0.1).rents(sig, batch)
    rule = _rule(build_s=0.5, graph_step_s=0.1)
    rule.rented[sig] = Rented(seconds=0.09 * 50, elements=elements(batch) * 50, steps=50)
    assert rule.rents(sig, batch)  # eager 0.09 s against the graph's 0.1 s: no gain to buy
    # a graph step's estimate scales with the batch's elements (a longer bucket)
    longer = _batch(2, 10, 0)
    assert rule.graph_step_estimate(longer) == pytest.approx(2 * rule.graph_step_estimate(batch))


class _Causal(torch.nn.Module):
    """A per-position model whose loss is a mean over every element: any length trains,
    none is padded (bucketing needs token ids), each length its own shape."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


def _eager_losses(model, batches) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for b in batches:
        opt.zero_grad()
        loss = model(**b)
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def _one_core(monkeypatch) -> None:
    """A due build runs in line (as on one core), whatever this machine's cores and
    torch's threads (a test alone runs with more than a pytest-xdist worker)."""
    from ortrain import whole_program

    monkeypatch.setattr(whole_program, "_cores", lambda: 1)


@pytest.mark.parametrize("build_s", [1e9, 0.0])
def test_training_through_deferred_shapes_equals_eager(build_s: float, monkeypatch) -> None:
    """Lengths 5, 7, 5, 7, 9, 7: with builds priced out of reach every new shape steps in
    eager (one graph); priced at nothing a new shape builds at its second step (here, on
    one core: not aside). Either way each step's loss and the parameters after equal
    eager training's."""
    _one_core(monkeypatch)
    torch.manual_seed(0)
    model = _Causal()
    reference = copy.deepcopy(model)
    lengths = [5, 7, 5, 7, 9, 7, 9]
    batches = [_batch(3, n, i) for i, n in enumerate(lengths)]
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), TrainerOptions())
    rule = trainer._program.deferred
    assert rule is not None
    rule.per_element = lambda: 0.0  # a graph step's estimate pinned: eager always loses
    losses, graphs, eager = [], [], []
    for i, b in enumerate(batches):
        losses.append(float(trainer.train_step(**b)))
        if i == 0:
            assert rule.build_seconds is not None and rule.build_seconds > 0
        rule.build_seconds = build_s  # the price of the next build pinned
        graphs.append(trainer.build_count)
        eager.append(trainer.eager_steps)
    expected = _eager_losses(reference, batches)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    if build_s > 1:
        assert graphs == [1] * 7 and eager == [0, 1, 1, 2, 3, 4, 5]
        assert "x [3, 7, 6]: 3 step(s) in eager, no graph yet" in trainer.deferred_builds
    else:  # each new length: one eager step (its time unknown), its graph at the next
        assert graphs == [1, 1, 1, 2, 2, 2, 3] and eager == [0, 1, 1, 1, 2, 2, 2]
        assert "x [3, 7, 6]: 1 step(s) in eager, then built" in trainer.deferred_builds
        assert "shapes stepped in eager until a build would pay" in explain(trainer)


def test_eager_if_faster_off_builds_every_shape() -> None:
    torch.manual_seed(0)
    model = _Causal()
    options = TrainerOptions(eager_if_faster=False)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), options)
    assert trainer._program.deferred is None
    for i, n in enumerate([5, 7, 9]):
        trainer.train_step(**_batch(3, n, i))
    assert trainer.build_count == 3 and trainer.eager_steps == 0


def test_a_shape_the_graph_cache_holds_loads_at_once(tmp_path, monkeypatch) -> None:
    """A shape whose graph is a load away (the graph cache holds it) is not deferred."""
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model = _Causal()
    batches = [_batch(3, n, i) for i, n in enumerate([5, 7, 7])]
    other = copy.deepcopy(model)
    options = TrainerOptions(eager_if_faster=False)
    first = ORTTrainer(other, torch.optim.AdamW(other.parameters(), lr=1e-2), options)
    for b in batches[:2]:
        first.train_step(**b)
    assert first.build_count == 2 and first.cache_hits == 0
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), TrainerOptions())
    trainer.train_step(**batches[0])
    trainer._program.deferred.build_seconds = 1e9  # a build priced out of reach
    trainer.train_step(**batches[1])
    assert trainer.build_count == 2 and trainer.cache_hits == 2 and trainer.eager_steps == 0
    trainer.train_step(**_batch(3, 9, 5))  # not in the cache: eager
    assert trainer.build_count == 2 and trainer.eager_steps == 1


def test_a_graph_loaded_from_the_cache_prices_new_shapes_at_its_build(
    tmp_path, monkeypatch
) -> None:
    """A first graph the graph cache holds loads in a fraction of its build: a new shape
    (not cached) is priced at what that build took where it was made, not at the load."""
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model = _Causal()
    other = copy.deepcopy(model)
    options = TrainerOptions(eager_if_faster=False)
    first = ORTTrainer(other, torch.optim.AdamW(other.parameters(), lr=1e-2), options)
    first.train_step(**_batch(3, 5, 0))
    stages = sum(r.seconds for r in first.build_log)
    assert first.build_count == 1 and stages > 0
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), TrainerOptions())
    trainer.train_step(**_batch(3, 5, 0))
    assert trainer.cache_hits == 1
    load = sum(r.seconds for r in trainer.build_log)
    assert [r.stage for r in trainer.build_log] == ["cache"] and load < stages
    price = trainer._program.deferred.build_seconds
    assert price is not None and price >= stages - load


def _eager_step(model, opt, batch) -> torch.Tensor:
    opt.zero_grad()
    out = model(**batch)
    loss = out[1] if isinstance(out, tuple) else out.loss
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("eager_if_faster", [False, "auto"])
def test_a_layout_s_first_padded_batch_borrows_a_longer_graph(eager_if_faster) -> None:
    """A masked batch of 48 tokens (its own bucket: not padded, its graph built), then
    shorter ones (bucket 32): the first of them is padded to 48, the layout proven on
    that graph (its proof holds for any real length) and checked in eager; no second
    graph, and none deferred."""
    from tests.conftest import gpt2
    from tests.test_bucketing import varlen_batch

    model = gpt2(layers=1, hidden=32)
    ref = copy.deepcopy(model)
    options = TrainerOptions(eager_if_faster=eager_if_faster)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), options)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for i, lengths in enumerate([[48, 20], [19, 11], [25, 24], [30, 5]]):
        batch = varlen_batch(lengths, seed=i)
        loss = trainer.train_step(**batch)
        torch.testing.assert_close(loss, _eager_step(ref, opt, batch), rtol=1e-5, atol=0)
    assert trainer.build_count == 1 and trainer.eager_steps == 0
    (key,) = trainer.bucketing.verdicts
    assert trainer.bucketing.verdicts[key].exact and trainer.bucketing.proofs[key][0] == "exact"
    (graph,) = trainer.train_graphs
    assert [v.shape[1] for v in graph.graph.inputs if v.name == "input_ids"] == [48]


@pytest.mark.parametrize("build_s", [1e9, 0.0])
def test_a_learned_layout_s_proof_waits_for_its_deferred_graph(build_s: float, monkeypatch) -> None:
    """nanoGPT's names (``idx``, ``targets`` skipped at -1): the first length runs on its
    own graph; the next lengths' padded shape is deferred, so its padding proof waits:
    they run unpadded in eager, their time counted to the padded shape, whose graph (and
    the proof on it) comes once that time reaches a build's, here pinned (in line)."""
    _one_core(monkeypatch)
    from tests.test_loss_outputs import GPT, GPTConfig

    cfg = GPTConfig(block_size=64)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rule = trainer._program.deferred
    rule.per_element = lambda: 0.0  # eager always loses against the graph's estimate
    g = torch.Generator().manual_seed(1)
    graphs = []
    for n in [40, 45, 41, 44, 47]:
        seq = torch.randint(0, cfg.vocab_size, (2, n + 1), generator=g)
        batch = {"idx": seq[:, :-1].contiguous(), "targets": seq[:, 1:].contiguous()}
        loss = trainer.train_step(**batch)
        torch.testing.assert_close(loss, _eager_step(ref, opt, batch), rtol=1e-5, atol=0)
        rule.build_seconds = build_s
        graphs.append(trainer.build_count)
    (key,) = trainer.bucketing.learned
    assert trainer.bucketing.learned[key]["targets"] == -1
    if build_s > 1:  # every later length in eager, unpadded; the proof and check to come
        assert graphs == [1] * 5 and trainer.eager_steps == 4
        assert key not in trainer.bucketing.proofs and key not in trainer.bucketing.verdicts
        assert "idx [2, 48], targets [2, 48]: 4 step(s) in eager" in trainer.deferred_builds
    else:  # 45 in eager (its time unknown), 41 builds the padded shape (48) and proves it
        assert graphs == [1, 1, 2, 2, 2] and trainer.eager_steps == 1
        assert trainer.bucketing.proofs[key] == ("exact", "")
        assert trainer.bucketing.verdicts[key].exact
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_a_due_graph_builds_aside_while_its_steps_run_in_eager(monkeypatch) -> None:
    """Where a forked child can take a core, a shape's due build runs there: its steps go
    on in eager (one thread fewer) until the graph arrives, then run on it, checked."""
    from ortrain import whole_program

    monkeypatch.setattr(whole_program, "_cores", lambda: 2)
    torch.manual_seed(0)
    model = _Causal()
    reference = copy.deepcopy(model)
    batches = [_batch(3, n, i) for i, n in enumerate([5, 7, 7, 7, 7])]
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), TrainerOptions())
    program = trainer._program
    program.deferred.per_element = lambda: 0.0
    losses, aside = [], []
    for b in batches:
        losses.append(float(trainer.train_step(**b)))
        program.deferred.build_seconds = 0.0  # every later build due at once
        aside.append(program._aside is not None)
        if program._aside is not None:
            program._aside.wait()  # (the next step takes it)
    torch.testing.assert_close(losses, _eager_losses(reference, batches), rtol=1e-5, atol=1e-6)
    # 7: its first step in eager (its time unknown), its second starts the build aside
    # and runs in eager too, the third takes the graph
    assert aside == [False, False, True, False, False]
    assert trainer.build_count == 2 and trainer.eager_steps == 2
    assert "x [3, 7, 6]: 2 step(s) in eager, then built" in trainer.deferred_builds
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_learned_layout_s_graph_built_aside_is_proven_when_it_arrives(monkeypatch) -> None:
    """The padded shape's graph built aside (a core free): the batch after it arrives is
    proven on it and runs on it, padded; nothing is built twice."""
    from ortrain import whole_program
    from tests.test_loss_outputs import GPT, GPTConfig

    monkeypatch.setattr(whole_program, "_cores", lambda: 2)
    cfg = GPTConfig(block_size=64)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    program = trainer._program
    program.deferred.per_element = lambda: 0.0
    g = torch.Generator().manual_seed(1)
    graphs, aside = [], []
    for n in [40, 45, 41, 44, 47]:
        seq = torch.randint(0, cfg.vocab_size, (2, n + 1), generator=g)
        batch = {"idx": seq[:, :-1].contiguous(), "targets": seq[:, 1:].contiguous()}
        loss = trainer.train_step(**batch)
        torch.testing.assert_close(loss, _eager_step(ref, opt, batch), rtol=1e-5, atol=0)
        program.deferred.build_seconds = 0.0
        graphs.append(trainer.build_count)
        aside.append(program._aside is not None)
        if program._aside is not None:
            program._aside.wait()
    # 45: eager (its time unknown); 41: due, built aside, eager; 44 takes it, proven
    assert aside == [False, False, True, False, False]
    assert graphs == [1, 1, 1, 2, 2] and trainer.eager_steps == 2
    (key,) = trainer.bucketing.learned
    assert trainer.bucketing.proofs[key] == ("exact", "") and trainer.bucketing.verdicts[key].exact
