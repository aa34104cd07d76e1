"""Gradient rules of graph_passes/autodiff/rules/indexing.py against torch.autograd.

GatherElements with repeated and negative indices (gradients must accumulate, also with
several threads), ScatterElements / ScatterND with reduction none and add, TopK (largest,
sorted, axis, ties: the gradient goes to the indices TopK returned), Einsum over the
equations users write (batched products, attention, outer products, ``...``
broadcasting, reductions, transposes, implicit output, diagonals), Trilu, DepthToSpace,
SpaceToDepth and ReverseSequence; then the cases the rules refuse.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer
from ortrain.graph_passes.autodiff import GradientError, build_gradient_graph, registry
from ortrain.graph_passes.infra.tags import GRAD_OF, is_backward
from tests import gradcheck
from tests.gradcheck import Const, Fixed, In, Index, Spec, TinyGraph, X, case, check_gradients


def Ties(*shape: int) -> In:
    """Integer-valued floats in [-1, 2): many ties."""
    return In(tuple(shape), "float32", lambda rng, s: rng.integers(-1, 2, s), grad=True)


def Perm(shape: tuple[int, ...], axis: int, n: int) -> In:
    """Indices along ``axis`` distinct within each line (ScatterElements without reduction
    is only defined for distinct targets), drawn from a permutation of range(n)."""

    def sample(rng: np.random.Generator, s: tuple[int, ...]) -> np.ndarray:
        moved = list(s)
        k = moved.pop(axis)
        lines = int(np.prod(moved, dtype=np.int64))
        rows = np.stack([rng.permutation(n)[:k] for _ in range(lines)])
        return np.moveaxis(rows.reshape(*moved, k), -1, axis)

    return In(tuple(shape), "int64", sample)


def _ids(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


# --- gathers and scatters ------------------------------------------------------------------


def _gather_elements() -> list[Spec]:
    out = []
    shapes = [((3, 5), (3, 7), 1), ((4, 3), (6, 3), 0), ((2, 3, 4), (2, 3, 9), -1),
              ((2, 3, 4), (2, 5, 4), 1)]  # fmt: skip
    for data, idx_shape, axis in shapes:
        n = data[axis]

        def ref(x, i, axis=axis, n=n):
            return torch.gather(x, axis, i % n)

        for threads in (1, 4):
            out.append(case(
                f"GatherElements-{_ids(data)}-axis{axis}-t{threads}", "GatherElements",
                [X(*data), Index(idx_shape, -n, n)], ref, attrs={"axis": axis}, threads=threads,
            ))  # fmt: skip
    return out


def _scatter_elements() -> list[Spec]:
    out = []
    for data, upd, axis in [((3, 6), (3, 4), 1), ((5, 3), (2, 3), 0), ((2, 3, 5), (2, 3, 2), -1)]:
        n = data[axis]

        def put(x, i, u, axis=axis):
            return x.scatter(axis, i, u)

        def add(x, i, u, axis=axis, n=n):
            return x.scatter_add(axis, i % n, u)

        out.append(
            case(
                f"ScatterElements-{_ids(data)}-axis{axis}-none",
                "ScatterElements",
                [X(*data), Perm(upd, axis, n), X(*upd)],
                put,
                attrs={"axis": axis},
            )
        )
        out.append(
            case(
                f"ScatterElements-{_ids(data)}-axis{axis}-add",
                "ScatterElements",
                [X(*data), Index(upd, -n, n), X(*upd)],
                add,
                attrs={"axis": axis, "reduction": "add"},
            )
        )
        out.append(case(f"ScatterElements-{_ids(data)}-axis{axis}-none-updates-only",
                        "ScatterElements", [X(*data, grad=False), Perm(upd, axis, n), X(*upd)],
                        put, attrs={"axis": axis}))  # fmt: skip
        for red, torch_red in (("max", "amax"), ("min", "amin")):

            def extremum(x, i, u, axis=axis, n=n, torch_red=torch_red):
                return x.scatter_reduce(axis, i % n, u, torch_red, include_self=True)

            # integer-valued data and updates, repeated targets: tied extrema, whose
            # gradient torch splits evenly
            out.append(case(f"ScatterElements-{_ids(data)}-axis{axis}-{red}-ties",
                            "ScatterElements", [Ties(*data), Index(upd, -n, n), Ties(*upd)],
                            extremum, attrs={"axis": axis, "reduction": red}))  # fmt: skip
    return out


def _index_put(accumulate: bool):
    def ref(x, idx, u):
        return x.index_put(tuple(idx.unbind(-1)), u, accumulate=accumulate)

    return ref


def _scatter_nd() -> list[Spec]:
    rows = [
        ("rows", (5, 3, 2), [[1], [3]], (2, 3, 2)),
        ("elements", (4, 3), [[0, 1], [2, 0], [3, 2]], (3,)),
        ("slices-2d-index", (4, 3, 2), [[[0, 1]], [[3, 2]]], (2, 1, 2)),
    ]
    out = []
    for name, data, idx, upd in rows:
        out.append(
            case(
                f"ScatterND-{name}-none",
                "ScatterND",
                [X(*data), Fixed(idx), X(*upd)],
                _index_put(False),
            )
        )
    # reduction add with a repeated target (index_add / index_put accumulate=True).
    out.append(
        case(
            "ScatterND-rows-add-repeated",
            "ScatterND",
            [X(5, 3), Fixed([[1], [4], [1]]), X(3, 3)],
            _index_put(True),
            attrs={"reduction": "add"},
        )
    )
    out.append(case("ScatterND-elements-add-repeated", "ScatterND",
                    [X(3, 4), Fixed([[0, 1], [2, 3], [0, 1]]), X(3)], _index_put(True),
                    attrs={"reduction": "add"}))  # fmt: skip
    return out


# --- TopK ----------------------------------------------------------------------------------


def _topk() -> list[Spec]:
    out = []
    for shape, k, axis, largest in itertools.product(((4, 7), (2, 5, 3)), (1, 3), (-1, 0),
                                                     (1, 0)):  # fmt: skip
        if axis == 0 and k > shape[0]:
            continue

        def ref(x, kk, axis=axis, largest=largest):
            return torch.topk(x, int(kk[0]), dim=axis, largest=bool(largest), sorted=True).values

        out.append(case(f"TopK-{_ids(shape)}-k{k}-axis{axis}-largest{largest}", "TopK",
                        [X(*shape), Const([k])], ref, outputs=2,
                        attrs={"axis": axis, "largest": largest, "sorted": 1}))  # fmt: skip

    # Unsorted output and ties: the gradient goes to the indices TopK returned.
    def at_returned(x, kk, ort, axis=-1):
        return torch.gather(x, axis, ort[1])

    for name, x, largest, srt in [("ties", Ties(4, 8), 1, 1), ("ties-smallest", Ties(4, 8), 0, 1),
                                  ("unsorted", X(3, 9), 1, 0)]:  # fmt: skip
        out.append(
            case(
                f"TopK-{name}",
                "TopK",
                [x, Const([3])],
                at_returned,
                outputs=2,
                attrs={"largest": largest, "sorted": srt},
                ref_sees_ort=True,
            )
        )
    return out


# --- Einsum --------------------------------------------------------------------------------

EINSUMS = [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
    ("bhqk,bhkd->bhqd", [(2, 2, 3, 5), (2, 2, 5, 4)]),
    ("i,j->ij", [(3,), (4,)]),
    ("bi,bj->bij", [(2, 3), (2, 4)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 3, 4, 5)]),
    ("...ij,...jk->...ik", [(1, 3, 4), (2, 4, 5)]),
    ("ij->i", [(3, 4)]),
    ("ij->ji", [(3, 4)]),
    ("ij->", [(3, 4)]),
    ("ij", [(3, 4)]),
    ("ij,jk", [(3, 4), (4, 5)]),
    ("ij,j->i", [(3, 4), (4,)]),
    ("ij,ij->ij", [(3, 4), (3, 4)]),
    ("bsh,hd->bsd", [(2, 3, 4), (4, 5)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ("bn,bn->b", [(3, 4), (3, 4)]),
    ("ij,kl->ijkl", [(2, 3), (2, 2)]),
    ("i j , j k -> i k", [(3, 4), (4, 2)]),
    # diagonals: a subscript repeated within one operand
    ("ii->i", [(3, 3)]),
    ("ii->", [(3, 3)]),
    ("ii", [(3, 3)]),
    ("...ii->...i", [(2, 3, 3)]),
    ("bii->b", [(2, 3, 3)]),
    ("iji->j", [(3, 2, 3)]),
    ("iii->i", [(2, 2, 2)]),
    ("ii,ij->j", [(3, 3), (3, 4)]),
    ("ij,jj->ij", [(2, 3), (3, 3)]),
]


def _einsum() -> list[Spec]:
    out = []
    for eq, shapes in EINSUMS:

        def ref(*xs, eq=eq):
            return torch.einsum(eq.replace(" ", ""), *xs)

        sid = f"Einsum-{eq.replace(' ', '')}-" + "-".join(_ids(s) for s in shapes)
        out.append(case(sid, "Einsum", [X(*s) for s in shapes], ref, attrs={"equation": eq}))
    out.append(case("Einsum-bij,bjk->bik-one-operand-frozen", "Einsum",
                    [X(2, 3, 4, grad=False), X(2, 4, 5)], lambda a, b: torch.einsum(
                        "bij,bjk->bik", a, b), attrs={"equation": "bij,bjk->bik"}))  # fmt: skip
    return out


# --- data movement ---------------------------------------------------------------------------


def _trilu() -> list[Spec]:
    out = []
    for shape, upper, k in itertools.product(((4, 5), (2, 5, 3)), (0, 1), (None, 1, -2)):

        def ref(x, kk=None, upper=upper):
            d = 0 if kk is None else int(kk)
            return torch.triu(x, d) if upper else torch.tril(x, d)

        inputs = [X(*shape)] + ([] if k is None else [Const(k)])
        out.append(
            case(
                f"Trilu-{_ids(shape)}-upper{upper}-k{k}",
                "Trilu",
                inputs,
                ref,
                attrs={"upper": upper},
            )
        )
    return out


def _d2s_dcr(x: torch.Tensor, b: int) -> torch.Tensor:
    n, c, h, w = x.shape
    y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    return y.reshape(n, c // (b * b), h * b, w * b)


def _s2d(x: torch.Tensor, b: int) -> torch.Tensor:
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b).permute(0, 3, 5, 1, 2, 4)
    return y.reshape(n, c * b * b, h // b, w // b)


def _reverse_sequence(batch_axis: int, time_axis: int):
    def ref(x, lens):
        out = x.clone()
        for b, n in enumerate(lens.tolist()):
            line = x.select(batch_axis, b)  # the time axis shifts down past batch_axis
            t = time_axis - (time_axis > batch_axis)
            rev = torch.cat([line.narrow(t, 0, n).flip(t), line.narrow(t, n, line.shape[t] - n)], t)
            out = out.select_scatter(rev, batch_axis, b)
        return out

    return ref


# fmt: off
MOVES: list[Spec] = [
    case("DepthToSpace-DCR-b2", "DepthToSpace", [X(2, 8, 3, 3)], lambda x: _d2s_dcr(x, 2),
         attrs={"blocksize": 2}),
    case("DepthToSpace-DCR-b3", "DepthToSpace", [X(1, 18, 2, 3)], lambda x: _d2s_dcr(x, 3),
         attrs={"blocksize": 3, "mode": "DCR"}),
    case("DepthToSpace-CRD-b2", "DepthToSpace", [X(2, 8, 3, 3)], lambda x: F.pixel_shuffle(x, 2),
         attrs={"blocksize": 2, "mode": "CRD"}),
    case("SpaceToDepth-b2", "SpaceToDepth", [X(2, 3, 4, 6)], lambda x: _s2d(x, 2),
         attrs={"blocksize": 2}),
    case("SpaceToDepth-b3", "SpaceToDepth", [X(1, 2, 6, 3)], lambda x: _s2d(x, 3),
         attrs={"blocksize": 3}),
    case("ReverseSequence-time0-batch1", "ReverseSequence", [X(5, 3, 2), Fixed([5, 2, 1])],
         _reverse_sequence(1, 0), attrs={"batch_axis": 1, "time_axis": 0}),
    case("ReverseSequence-batch0-time1", "ReverseSequence", [X(3, 4, 2), Fixed([4, 1, 3])],
         _reverse_sequence(0, 1), attrs={"batch_axis": 0, "time_axis": 1}),
]
# fmt: on

SPECS: list[Spec] = [
    *_gather_elements(),
    *_scatter_elements(),
    *_scatter_nd(),
    *_topk(),
    *_einsum(),
    *_trilu(),
    *MOVES,
]
_ids_all = [s.id for s in SPECS]
assert len(_ids_all) == len(set(_ids_all)), "duplicate spec ids"


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_rule(spec: Spec) -> None:
    check_gradients(spec)


# --- structure ---------------------------------------------------------------------------


def _backward_ops(res) -> list[tuple[str, str]]:
    return [
        (n.op_type, str(n.attributes["reduction"].value) if "reduction" in n.attributes else "")
        for n in res.model.graph
        if is_backward(n)
    ]


def test_repeated_gather_indices_accumulate() -> None:
    # The multi-threaded case must really repeat indices, and the scatter must add.
    spec = next(s for s in SPECS if s.id == "GatherElements-3x5-axis1-t4")
    idx = spec.inputs[1].draw(np.random.default_rng(gradcheck.seed_of(spec.id)))
    assert any(len(set(row % 5)) < len(row) for row in idx)
    res, _ = check_gradients(spec)
    assert ("ScatterElements", "add") in _backward_ops(res)


def test_topk_ties_are_real_and_scatter_without_reduction() -> None:
    spec = next(s for s in SPECS if s.id == "TopK-ties")
    x = spec.inputs[0].draw(np.random.default_rng(gradcheck.seed_of(spec.id)))
    third = np.sort(x, axis=-1)[:, -3]
    assert ((x == third[:, None]).sum(-1) > 1).any()  # a tie at the cut
    res, _ = check_gradients(spec)
    assert ("ScatterElements", "") in _backward_ops(res)


@pytest.mark.parametrize("red", ["none", "add"])
def test_scatter_add_data_gradient_passes_through(red: str) -> None:
    spec = next(s for s in SPECS if s.id == f"ScatterElements-3x6-axis1-{red}")
    res, _ = check_gradients(spec)
    ops = [op for op, _ in _backward_ops(res)]
    assert ops.count("GatherElements") == 1
    assert ops.count("ScatterElements") == (1 if red == "none" else 0)


def test_einsum_gradients_are_einsums() -> None:
    spec = next(s for s in SPECS if s.id.startswith("Einsum-bhqd,bhkd->bhqk"))
    res, _ = check_gradients(spec)
    eqs = sorted(str(n.attributes["equation"].value) for n in res.model.graph
                 if is_backward(n) and n.op_type == "Einsum")  # fmt: skip
    assert eqs == ["bhqk,bhkd->bhqd", "bhqk,bhqd->bhkd"]


def test_hardmax_is_no_gradient() -> None:
    reg = registry.lookup("Hardmax", "", 20)
    assert reg is not None and reg.kind == "no_gradient"


def test_einsum_diagonal_gradient_is_masked() -> None:
    spec = next(s for s in SPECS if s.id == "Einsum-ii,ij->j-3x3-3x4")
    res, _ = check_gradients(spec)
    ops = [n.op_type for n in res.model.graph if n.metadata_props.get(GRAD_OF) == "node_under_test"]
    assert ops.count("Einsum") == 2 and ops.count("Mul") == 1  # the mask: on operand 0 only


# --- refusals --------------------------------------------------------------------------------


def _one_node(op: str, inputs, out_shape, opset: int = 20, **attrs) -> tuple[ir.Model, str]:
    g = TinyGraph()
    x = g.input("x", inputs[0])
    rest = [g.const(f"c{i}", a) if isinstance(a, np.ndarray) else g.input(f"u{i}", a)
            for i, a in enumerate(inputs[1:], 1)]  # fmt: skip
    y = g.op(op, x, *rest, name="the_node", shape=out_shape, **attrs)
    loss = g.op("ReduceSum", y, name="loss", shape=(), keepdims=0)
    return g.model(loss, opsets={"": opset}), loss.name


@pytest.mark.parametrize(
    ("red", "ops"),
    [("mul", ("ScatterElements", "ScatterND")), ("max", ("ScatterND",)), ("min", ("ScatterND",))],
)
def test_scatter_reductions_without_gradient_are_refused(red: str, ops: tuple[str, ...]) -> None:
    idx = np.array([[0, 1], [1, 2]], dtype=np.int64)
    for op, index in (("ScatterElements", idx), ("ScatterND", idx[:, :1])):
        if op not in ops:
            continue
        model, loss = _one_node(op, [(3, 3), index, (2, 2) if op == "ScatterElements" else (2, 3)],
                                (3, 3), reduction=red)  # fmt: skip
        with pytest.raises(GradientError, match=rf"{op}.*the_node.*reduction='{red}'"):
            build_gradient_graph(model, loss, ["x"])


def test_gather_elements_before_opset_16_is_refused() -> None:
    idx = np.array([[0, 0], [1, 0]], dtype=np.int64)
    model, loss = _one_node("GatherElements", [(2, 3), idx], (2, 2), opset=15, axis=1)
    with pytest.raises(GradientError, match=r"GatherElements.*the_node.*opset 16"):
        build_gradient_graph(model, loss, ["x"])


# --- the torch forms users write, through the dynamo exporter ------------------------------

_IDX = torch.tensor([[[0, 3, 3], [7, 1, 0]], [[2, 2, 2], [5, 6, 4]]])  # repeats: must add up
_PERM = torch.tensor([[[4, 0, 2], [1, 7, 3]], [[6, 5, 0], [2, 3, 1]]])  # distinct per row


def _moe(logits: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    # A mixture-of-experts router: softmax -> top-2 -> renormalized weights on the experts.
    w, i = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    gates = torch.zeros_like(logits).scatter(-1, i, w)
    return torch.einsum("bte,bted->btd", gates, h)


def _slice_put(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = a.clone()
    h[:, :4] = b
    return h


def _slice_zero(a: torch.Tensor) -> torch.Tensor:
    h = a * 1.0
    h[:, :4] = 0
    return h


# name -> (function, input shapes, integer-valued inputs: ties)
FORMS: dict[str, tuple] = {
    "gather": (lambda a: torch.gather(a, 2, _IDX), [(2, 2, 8)], False),
    "scatter": (lambda a, b: a.scatter(2, _PERM, b), [(2, 2, 8), (2, 2, 3)], False),
    "scatter_add": (lambda a, b: a.scatter_add(2, _IDX, b), [(2, 2, 8), (2, 2, 3)], False),
    "index_add": (lambda a, b: a.index_add(1, torch.tensor([0, 2, 4]), b), [(2, 6), (2, 3)],
                  False),
    "slice_put": (_slice_put, [(3, 6, 2), (3, 4, 2)], False),
    "slice_zero": (_slice_zero, [(3, 6, 2)], False),
    "topk": (lambda a: torch.topk(torch.softmax(a, -1), 3, dim=-1).values, [(4, 7)], False),
    "moe_router": (_moe, [(2, 3, 4), (2, 3, 4, 5)], False),
    "amax": (lambda a: a.amax(dim=-1), [(4, 6)], True),
    "max_dim": (lambda a: torch.max(a, 1).values, [(4, 6)], True),
    "min_dim_keep": (lambda a: torch.min(a, 0, keepdim=True)[0], [(4, 6)], True),
    "max_all": (lambda a: a.max(), [(4, 6)], True),
    "logsumexp": (lambda a: torch.logsumexp(a, -1), [(3, 5)], False),
    "normalize": (lambda a: F.normalize(a, dim=-1), [(3, 5)], False),
    "cumsum": (lambda a: torch.cumsum(a, 1), [(3, 5)], False),
    "einsum_attn": (lambda q, k: torch.einsum("bhqd,bhkd->bhqk", q, k),
                    [(2, 2, 3, 4), (2, 2, 5, 4)], False),
    # (the exporter keeps ``...`` of different ranks, e.g. (2, 3, 4) with (4, 5), which
    # ONNX Runtime refuses to load: that forward does not run at all)
    "einsum_ellipsis": (lambda a, b: torch.einsum("...ij,...jk->...ik", a, b),
                        [(2, 3, 4), (1, 4, 5)], False),
    "einsum_outer": (lambda a, b: torch.einsum("i,j->ij", a, b), [(3,), (4,)], False),
    "einsum_reduce": (lambda a: torch.einsum("ij->i", a), [(3, 4)], False),
    "einsum_transpose": (lambda a: torch.einsum("ij->ji", a), [(3, 4)], False),
    "einsum_diagonal": (lambda a: torch.einsum("...ii->...i", a), [(2, 3, 3)], False),
    "tril": (lambda a: torch.tril(a), [(2, 4, 4)], False),
    "sort": (lambda a: torch.sort(a, -1).values, [(3, 5)], False),
    "pixel_shuffle": (lambda a: F.pixel_shuffle(a, 2), [(1, 8, 2, 3)], False),
    "norm": (lambda a: torch.norm(a, dim=-1), [(3, 5)], False),
    "norm_all": (lambda a: torch.norm(a), [(3, 5)], False),
    "prod": (lambda a: a.prod(-1), [(3, 4)], False),
    # scatter_reduce amax / amin (graph pooling): include_self=False is exported as a
    # reset of the targets, then the reduction; ties split evenly
    "scatter_amax": (lambda a, b: a.scatter_reduce(2, _IDX, b, "amax"), [(2, 2, 8), (2, 2, 3)],
                     True),
    "scatter_amin_no_self": (lambda a, b: a.scatter_reduce(2, _IDX, b, "amin",
                                                           include_self=False),
                             [(2, 2, 8), (2, 2, 3)], True),
}  # fmt: skip


class _Forms(torch.nn.Module):
    """Every form on its own inputs: loss = sum_k sum(form_k(inputs_k) * R_k)."""

    def __init__(self, rs: list[torch.Tensor]) -> None:
        super().__init__()
        self.rs = rs

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        loss, at = 0.0, 0
        for (fn, shapes, _), r in zip(FORMS.values(), self.rs, strict=True):
            y = fn(*xs[at : at + len(shapes)])
            at += len(shapes)
            loss = loss + (y * r.to(y.dtype)).sum()
        return loss


def test_exported_torch_forms_have_rules_and_match_eager() -> None:
    rng = np.random.default_rng(0)
    arrays = []
    for _, shapes, ties in FORMS.values():
        for s in shapes:
            a = rng.integers(-2, 3, s) if ties else rng.standard_normal(s)
            arrays.append(a.astype(np.float32))
    xs64 = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in arrays]
    with torch.no_grad():
        outs = [fn(*(torch.zeros(s) for s in shapes)) for fn, shapes, _ in FORMS.values()]
    rs = [torch.tensor(rng.standard_normal(tuple(o.shape)), dtype=torch.float64) for o in outs]

    module = _Forms(rs).eval()
    xs32 = tuple(torch.from_numpy(a) for a in arrays)
    prog = torch.onnx.export(module, xs32, dynamo=True, verbose=False)
    model = prog.model
    names = [v.name for v in model.graph.inputs]
    loss = model.graph.outputs[0].name
    build_gradient_graph(model, loss, names)  # raises naming any op without a rule

    got = gradcheck.run_model(model, {n: a for n, a in zip(names, arrays, strict=True)})
    want = torch.autograd.grad(module(*xs64), xs64)
    at = 0
    for form, (_, shapes, _) in FORMS.items():
        for j in range(len(shapes)):
            name = names[at]
            gradcheck.assert_close(got[f"grad:{name}"], want[at].numpy(), f"{form} input {j}")
            at += 1
    # torch.max/min(x, dim) on ties went through the first-index path (the exporter's tag).
    backward = [n.op_type for n in model.graph if is_backward(n)]
    assert "ArgMax" in backward and "ArgMin" in backward
    ops = {n.op_type for n in model.graph}
    for op in ("GatherElements", "ScatterElements", "ScatterND", "TopK", "ReduceMax",
               "ReduceMin", "ReduceLogSumExp", "ReduceL2", "CumSum", "Einsum", "Trilu",
               "ReduceProd"):  # fmt: skip
        assert op in ops, op


# --- training end to end -------------------------------------------------------------------


class _RoutedMixer(torch.nn.Module):
    """Routing, einsums, normalization, masks and pooling reductions in one small model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 8)
        self.router = torch.nn.Linear(8, 4)
        self.experts = torch.nn.Parameter(torch.randn(4, 8, 8) * 0.3)
        self.out = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, pick: torch.Tensor, labels: torch.Tensor):
        h = self.inp(x)  # [B, T, 8]
        w, i = torch.topk(torch.softmax(self.router(h), -1), 2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        gates = torch.zeros(*h.shape[:2], 4).scatter(-1, i, w)
        y = F.normalize(torch.einsum("bte,btd,edf->btf", gates, h, self.experts), dim=-1)
        att = torch.tril(torch.einsum("bqd,bkd->bqk", y, y))
        z = torch.cumsum(torch.einsum("bqk,bkd->bqd", att, h), 1) / h.shape[1]
        z = z.clone()
        z[:, :1] = 0
        z = z + torch.gather(h, 1, pick)
        pooled = torch.logsumexp(z, 1) + z.amax(1) + torch.max(z, 1).values + torch.norm(z, dim=1)
        return F.cross_entropy(self.out(pooled), labels)


def test_trains_like_eager_through_routing_einsum_and_reductions() -> None:
    model = _RoutedMixer()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    trainer = ORTTrainer(model, opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        batch = {
            "x": torch.randn(3, 5, 6, generator=gen),
            "pick": torch.randint(0, 5, (3, 5, 8), generator=gen),
            "labels": torch.randint(0, 5, (3,), generator=gen),
        }
        loss = trainer.train_step(**batch)
        ref_opt.zero_grad()
        want = ref(**batch)
        want.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-4, atol=0)
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    moved = max((p - q).abs().max().item() for p, q in zip(
        model.parameters(), _RoutedMixer().parameters(), strict=True))  # fmt: skip
    assert moved > 1e-2
    ops = {n.op_type for n in trainer.train_graphs[0].graph}
    # ArgMax: torch.max(z, 1)'s gradient went to its one index (the exporter's tag survived)
    assert {"TopK", "ScatterElements", "Einsum", "Trilu", "CumSum", "ScatterND", "ArgMax",
            "GatherElements", "ReduceLogSumExp", "ReduceMax", "ReduceL2"} <= ops  # fmt: skip
