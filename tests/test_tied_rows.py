"""A tied embedding trained as segments: the embedding's rows are added in place to the
gradient the LM head's backward already made (``ortrain/segments/accumulate.py``,
``TiedGradients`` in ``ortrain/segments/runner.py``), and training stays eager's."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from ortrain import TrainerOptions
from ortrain.core.roles import Role
from ortrain.segments.runner import TiedGradients
from tests.test_fallback import train_like_eager

V, D = 40, 16


class _Block(torch.nn.Module):
    def __init__(self, width: int = D) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class _LM(torch.nn.Module):
    """Token embedding, two blocks, an LM head; ``tied``: the head's weight is the
    embedding's; ``eager_read``: the root's own forward reads the tied table too."""

    def __init__(
        self, tied: bool = True, eager_read: bool = False, vocab: int = V, width: int = D
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(2))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.eager_read = eager_read

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        loss = F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
        if self.eager_read:
            loss = loss + 1e-2 * self.emb.weight[:4].square().sum()
        return loss


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, V, (4, 6), generator=g), torch.randint(0, V, (4, 6), generator=g))
        for _ in range(n)
    ]


BLOCKS = TrainerOptions(segments="blocks")


def test_the_rows_go_into_the_heads_gradient_and_train_like_eager():
    trainer = train_like_eager(_LM, _batches(4), BLOCKS)
    seg = trainer.segments.model
    emb_runner = next(iter(seg.runners["emb"].values()))
    # the embedding's backward has a variant whose rows add into an input, not into zeros
    acc = [r for r in emb_runner.graphs.backward_acc.inputs if r.role is Role.ACCUMULATOR]
    assert [(r.name, r.of) for r in acc] == [("acc:weight", "weight")]
    assert emb_runner.graphs.accumulators == {"weight": "acc:weight"}
    assert seg.tied.eligible == {id(trainer.module.emb.weight)}
    assert seg.tied.added_count == 4  # every backward: the head's gradient came first
    assert emb_runner.bwd_acc is not None and emb_runner._bwd is None


@pytest.mark.slow
def test_accumulation_and_eager_code_reading_the_tied_table():
    """Two micro-steps per update (the rows go into this micro-step's gradient, autograd
    adds it to ``.grad``), and a loss term in the root's eager forward on the same table
    (a third gradient of it, which autograd adds): both as eager."""
    trainer = train_like_eager(
        lambda: _LM(eager_read=True),
        _batches(4),
        TrainerOptions(segments="blocks", grad_accumulation_steps=2),
        accumulation=2,
    )
    assert trainer.segments.model.tied.eligible  # the head and the embedding make one each


def test_an_untied_embedding_keeps_its_own_rows():
    """Its rows go into zeros made per backward: the plain graph, whose zeros ONNX Runtime
    would fold into a table-sized constant its session keeps, is never made."""
    trainer = train_like_eager(lambda: _LM(tied=False), _batches(2), BLOCKS)
    seg = trainer.segments.model
    assert not seg.tied.eligible and seg.tied.added_count == 0
    runner = next(iter(seg.runners["emb"].values()))
    assert runner.bwd_acc is not None and runner._bwd is None
    block = next(iter(seg.runners["blocks.0"].values()))
    assert block.graphs.backward_acc is None and block._bwd is not None  # no rows: plain


def test_a_gradient_replaced_after_the_rows_went_in_raises():
    """The guard: autograd must accumulate the very tensor the rows were added to."""
    tied = TiedGradients()
    p = torch.nn.Parameter(torch.ones(3))
    tied.watch(p)
    # rows "added" into a tensor autograd does not hold (kept alive: a freed one's memory
    # could be the gradient's, whose address would then match)
    elsewhere = torch.zeros(3)
    tied.added(p, elsewhere)
    with pytest.raises(RuntimeError, match="rows would be lost"):
        (2 * p).sum().backward()
    assert p.grad is None
    tied.clear()
    (2 * p).sum().backward()  # nothing added this backward: no check
    torch.testing.assert_close(p.grad, torch.full((3,), 2.0))


class _Sink:
    """ZeRO-2's part in ``TiedGradients``' routing, summing in one process: a routed
    parameter's dense gradients and rows, outside autograd."""

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size
        self.rows: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.factors: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.routes: list[tuple[set[str], set[str]]] = []

    def route(self, rows: set[str], factors: set[str]) -> None:
        self.routes.append((set(rows), set(factors)))

    def agree_routes(
        self, routed: frozenset[str], rows: frozenset[str], factors: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        return routed, rows, factors  # (one rank)

    def add_rows(self, name: str, rows: torch.Tensor, updates: torch.Tensor) -> None:
        self.rows.setdefault(name, []).append((rows.clone(), updates.clone()))

    def take_factors(self, name: str, left: torch.Tensor, right: torch.Tensor) -> None:
        self.factors.setdefault(name, []).append((left.clone(), right.clone()))

    def whole(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """What a reducer would add up of ``name``'s pieces."""
        from ortrain.segments.runner import add_rows

        out = torch.zeros_like(like)
        for left, right in self.factors.get(name, []):
            out += left.t() @ right
        for rows, updates in self.rows.get(name, []):
            add_rows(out, rows, updates)
        return out


class _TwoHeads(_LM):
    """The head called twice in a forward: two gradients of the table from it."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        loss = F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
        return loss + 0.5 * F.cross_entropy(self.head(-h).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize(
    ("twice", "world"),
    [(False, 1), (True, 1), (False, 4)],
    ids=["head-once", "head-twice", "factors-larger"],
)
def test_a_routed_table_reaches_the_sink_in_pieces(twice: bool, world: int):
    """With a sink (ZeRO-2/3's reducer), a tied table whose head's gradient is smaller as
    its product's factors (24 tokens against a 400 x 128 table: a rank holds its own and
    every rank's, 2 x 24 x 528 < 51200 at 1 rank; not at 4) bypasses autograd: the
    embedding's rows and the head's factors (one pair per head call) reach the sink,
    never a table, and their sum is eager's gradient. Where the factors are larger, or
    eager code reads the table, it stays with autograd (its rows added in place)."""
    cls = _TwoHeads if twice else _LM

    def make() -> _LM:
        return cls(vocab=400, width=128)

    trainer = train_like_eager(make, _batches(1), BLOCKS)
    seg = trainer.segments.model
    sink = _Sink(world)
    seg.route_rows(sink, read_in_eager=())
    table, calls = "emb.weight", 2 if twice else 1
    emb = next(iter(seg.runners["emb"].values()))
    head = next(iter(seg.runners["head"].values()))
    assert set(emb.graphs.row_outputs) == {"weight"} and not emb.graphs.factor_outputs
    assert set(head.graphs.factor_outputs) == {"weight"} and not head.graphs.row_outputs
    roles = {r.role for r in emb.graphs.backward_rows.outputs}
    assert {Role.ROW_INDICES, Role.ROW_UPDATES} <= roles and Role.GRADIENT not in roles
    weight = [r.role for r in head.graphs.backward_factored.outputs if r.of == "weight"]
    assert weight == [Role.FACTOR_LEFT, Role.FACTOR_RIGHT]  # no GRADIENT of it

    ref = make()
    ref.load_state_dict(trainer.module.state_dict())
    ids, labels = _batches(2)[1]
    ref(ids, labels).backward()
    module = trainer.module
    module.zero_grad(set_to_none=True)
    added = seg.tied.added_count
    with seg.active():
        module(ids, labels).backward()
    seg.tied.clear()
    want = ref.emb.weight.grad
    # float32 sums in another order: 1e-5 of the largest element's size, absolute
    atol = 1e-5 * want.abs().max().item()
    if world > 1:  # not routed: autograd's gradient, the rows added into the head's
        assert sink.routes == [] and not seg.tied.routed
        assert seg.tied.added_count == added + 1
        torch.testing.assert_close(module.emb.weight.grad, want, rtol=1e-5, atol=atol)
        return
    assert sink.routes == [({table}, {table})]
    assert module.emb.weight.grad is None  # autograd got none of it
    assert seg.tied.added_count == added
    assert len(sink.rows[table]) == 1 and sink.rows[table][0][0].shape == (ids.numel(), 1)
    assert len(sink.factors[table]) == calls
    left, right = sink.factors[table][0]  # the head's output gradient's rows, its input's
    assert left.shape == (ids.numel(), 400) and right.shape == (ids.numel(), 128)
    got = sink.whole(table, module.emb.weight)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    # the blocks' gradients still went through autograd
    torch.testing.assert_close(module.blocks[0].up.weight.grad, ref.blocks[0].up.weight.grad)

    eager_reads = train_like_eager(
        lambda: _LM(eager_read=True, vocab=400, width=128), _batches(1), BLOCKS
    )
    other = _Sink()
    eager_reads.segments.model.route_rows(other, read_in_eager=["emb.weight"])
    assert other.routes == [] and not eager_reads.segments.model.tied.routed


def test_an_untied_head_has_no_factored_graph():
    trainer = train_like_eager(lambda: _LM(tied=False), _batches(1), BLOCKS)
    head = next(iter(trainer.segments.model.runners["head"].values()))
    assert head.graphs.backward_factored is None and not head.graphs.factor_outputs


@pytest.mark.parametrize("width", [1, 5, 16])
def test_rows_added_into_a_shard_cut_anywhere_match_the_whole_table(width: int):
    from ortrain.distributed.sharded_grads import add_product_in_range, add_rows_in_range

    g = torch.Generator().manual_seed(width)
    n_rows = 9
    rows = torch.randint(0, n_rows, (40,), generator=g)
    rows[:6] = 4  # a row hit many times
    updates = torch.randn(40, width, generator=g)
    whole = torch.zeros(n_rows, width).index_add_(0, rows, updates).reshape(-1)
    inner = torch.randint(0, n_rows * width, (4,), generator=g).tolist()
    cuts = sorted({0, n_rows * width, *inner})
    for a, b in itertools.pairwise(cuts):  # shards of one layout, edges inside rows too
        dst = torch.zeros(b - a)
        add_rows_in_range(dst, a, width, rows, updates)
        torch.testing.assert_close(dst, whole[a:b], rtol=1e-6, atol=1e-6, msg=f"[{a}, {b})")
    # the same table as a product's factors: tokens x rows and tokens x width
    left = torch.zeros(40, n_rows).index_put_((torch.arange(40), rows), torch.ones(40))
    product = (left.t() @ updates).reshape(-1)
    torch.testing.assert_close(product, whole, rtol=1e-6, atol=1e-6)
    left = left + torch.randn(40, n_rows, generator=g)  # a dense one too
    product = (left.t() @ updates).reshape(-1)
    for a, b in itertools.pairwise(cuts):
        dst = torch.zeros(b - a)
        add_product_in_range(dst, a, width, left, updates)
        torch.testing.assert_close(dst, product[a:b], rtol=1e-5, atol=1e-5, msg=f"[{a}, {b})")
