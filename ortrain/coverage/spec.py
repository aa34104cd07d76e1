"""One coverage spec: a unit (a ``torch.nn`` module or a functional call), its inputs, and
how a small model around it makes a scalar loss.

The model around a unit is a ``Harness``:

1. every ``Float`` input is a batch tensor passed through a ``Linear`` over its last axis
   (and an optional ``then``: a sigmoid for probabilities, a log-softmax for
   log-probabilities), so a unit without parameters still trains, and the gradient the
   unit sends back to its input is part of what is compared;
2. ``Data`` inputs (indices, targets, masks, lengths) reach the unit as they are;
3. the unit is called as ``unit(*inputs)``, or as the spec's ``call(unit, *inputs)`` where
   it takes keywords or needs glue (a max pool's indices for ``MaxUnpool``);
4. the loss: ``"mse"`` (layers) is the mean squared error of every floating-point output
   against a fixed random target of its shape (buffers of the harness, drawn once from a
   first call on the first batch, which also materializes lazy modules); ``"loss"``
   (criteria) is the unit's output itself, its mean when it is not reduced.

Everything is drawn from fixed seeds: two harnesses of one spec are equal, parameter for
parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

Sampler = Callable[[torch.Generator], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Float:
    """A float batch tensor of ``shape``, made trainable by a Linear over its last axis."""

    shape: tuple[int, ...]
    then: Callable[[torch.Tensor], torch.Tensor] | None = None

    def sample(self, g: torch.Generator) -> torch.Tensor:
        return torch.randn(self.shape, generator=g)


@dataclasses.dataclass(frozen=True)
class Data:
    """A batch tensor handed to the unit as it is (indices, targets, masks, lengths)."""

    sampler: Sampler

    def sample(self, g: torch.Generator) -> torch.Tensor:
        return self.sampler(g)


Input = Float | Data


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one row of the coverage table trains.

    ``covers``: the ``torch.nn`` class or ``F.<function>`` it exercises; ``options``: the
    constructor options (or call arguments) that differ from the base spec, as shown in
    the table; ``random``: the unit draws random numbers while training (dropout, RReLU),
    so only ortrain's own first-step check (with randomness off) compares it with eager.
    """

    covers: str
    options: str
    unit: Callable[[], nn.Module]
    inputs: tuple[Input, ...]
    head: str = "mse"  # "mse" | "loss"
    call: Callable[..., Any] | None = None
    pick: Callable[[Any], Any] | None = None  # the part of the output the head reads
    random: bool = False

    @property
    def id(self) -> str:
        return f"{self.covers}({self.options})" if self.options else self.covers

    def batches(self, steps: int) -> list[tuple[torch.Tensor, ...]]:
        g = torch.Generator().manual_seed(1234)
        return [tuple(i.sample(g) for i in self.inputs) for _ in range(steps)]


def _leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _leaves(o)]
    return []


class Harness(nn.Module):
    """A spec's unit in a model whose forward returns the loss (module docstring)."""

    def __init__(self, spec: Spec, first: Sequence[torch.Tensor]):
        super().__init__()
        torch.manual_seed(0)
        self.spec = spec
        floats = [i for i in spec.inputs if isinstance(i, Float)]
        self.pre = nn.ModuleList(nn.Linear(f.shape[-1], f.shape[-1]) for f in floats)
        self.unit = spec.unit()
        if spec.head == "mse":
            # a first call on the first batch: it materializes lazy modules and gives the
            # outputs' shapes; what it changes otherwise (BatchNorm statistics, a max_norm
            # renormalization) is put back
            with torch.no_grad():
                lazy = any(isinstance(p, nn.parameter.UninitializedParameter)
                           for p in self.unit.parameters())  # fmt: skip
                saved = None if lazy else {k: v.clone() for k, v in self.state_dict().items()}
                outs = self._outputs(*first)
                if saved is not None:
                    self.load_state_dict(saved)
            g = torch.Generator().manual_seed(99)
            for k, o in enumerate(outs):
                self.register_buffer(f"target_{k}", torch.randn(o.shape, generator=g))
        elif any(isinstance(p, nn.parameter.UninitializedParameter) for p in self.parameters()):
            with torch.no_grad():
                self._outputs(*first)

    def _outputs(self, *batch: torch.Tensor) -> list[torch.Tensor]:
        spec = self.spec
        xs, k = [], 0
        for kind, value in zip(spec.inputs, batch):
            if isinstance(kind, Float):
                value = self.pre[k](value)
                k += 1
                if kind.then is not None:
                    value = kind.then(value)
            xs.append(value)
        out = spec.call(self.unit, *xs) if spec.call is not None else self.unit(*xs)
        if spec.pick is not None:
            out = spec.pick(out)
        return [o for o in _leaves(out) if o.is_floating_point()]

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        outs = self._outputs(*batch)
        if self.spec.head == "loss":
            (out,) = outs
            return out if out.dim() == 0 else out.mean()
        targets = [getattr(self, f"target_{k}") for k in range(len(outs))]
        return sum(((o - t) ** 2).mean() for o, t in zip(outs, targets))  # type: ignore[return-value]


# --------------------------------------------------------------------------- table helpers
@dataclasses.dataclass(frozen=True)
class Fresh:
    """A tensor option drawn when the unit is built (under the harness's seed): a class
    weight, a positive weight. Shown in the table as what it is, not its values."""

    shape: tuple[int, ...]
    low: float = 0.5
    high: float = 1.5

    def __call__(self) -> torch.Tensor:
        return self.low + (self.high - self.low) * torch.rand(self.shape)

    def __repr__(self) -> str:
        return f"rand{list(self.shape)}"


def shown(value: Any) -> str:
    if isinstance(value, Fresh):
        return repr(value)
    if callable(value) and not isinstance(value, type):
        return getattr(value, "label", None) or getattr(value, "__name__", "fn")
    if isinstance(value, type):
        return value.__name__
    return repr(value)


def labelled(fn: Callable, label: str) -> Callable:
    """A callable option (a distance function, an activation) with its table label."""
    fn.label = label  # type: ignore[attr-defined]
    return fn


def _built(value: Any) -> Any:
    return value() if isinstance(value, Fresh) else value


@dataclasses.dataclass(frozen=True)
class Variant:
    """One spec of a class: constructor keywords, and what else differs from the base."""

    kwargs: dict[str, Any]
    note: str = ""  # shown after the options (an input form, a call argument)
    args: tuple | None = None  # other positional constructor arguments
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)  # Spec fields replaced

    def label(self) -> str:
        opts = ", ".join(f"{k}={shown(v)}" for k, v in self.kwargs.items())
        return ", ".join(t for t in (opts, self.note) if t)


def v(note: str = "", *, args: tuple | None = None, **kwargs: Any) -> Variant:
    """A variant: ``inputs=``, ``call=``, ``pick=``, ``head=``, ``random=`` replace the
    spec's; the other keywords go to the constructor."""
    fields = {k: kwargs.pop(k) for k in ("inputs", "call", "pick", "head", "random") if k in kwargs}
    if "inputs" in fields:
        fields["inputs"] = tuple(fields["inputs"])
    return Variant(kwargs, note, args, fields)


def module_specs(
    cls: Callable[..., nn.Module],
    args: tuple,
    inputs: Sequence[Input],
    variants: Sequence[Variant | dict[str, Any]] = (),
    base: dict[str, Any] | None = None,
    note: str = "",
    name: str | None = None,
    **fields: Any,
) -> list[Spec]:
    """``cls(*args, **base)`` (shown with ``note``) and one spec per variant, each
    ``cls(*args, **base, **variant)``; ``fields`` are the base spec's (``call``, ...);
    ``name``: the class covered where ``cls`` is a factory (the class's name otherwise)."""
    out = []
    for var in [Variant({}, note), *variants]:
        if isinstance(var, dict):
            var = Variant(var)
        kwargs = {**(base or {}), **var.kwargs}
        a = var.args if var.args is not None else args

        def unit(a: tuple = a, kwargs: dict = kwargs) -> nn.Module:
            return cls(*a, **{k: _built(x) for k, x in kwargs.items()})

        merged = {"inputs": tuple(inputs), **fields, **var.fields}
        out.append(Spec(name or cls.__name__, var.label(), unit, **merged))
    return out


class Fn(nn.Module):
    """A functional call as a unit: ``fn(*inputs, **params, **buffers, **kwargs)``;
    ``params`` (name -> shape) are parameters drawn at construction, ``buffers`` (name ->
    factory) buffers."""

    def __init__(
        self,
        fn: Callable[..., Any],
        params: dict[str, tuple[int, ...]] | None = None,
        buffers: dict[str, Callable[[], torch.Tensor]] | None = None,
        positional: Sequence[str] = (),
        **kwargs: Any,
    ):
        super().__init__()
        self.fn = fn
        self.kwargs = {k: _built(v) for k, v in kwargs.items()}
        self.names = list((params or {}).keys()) + list((buffers or {}).keys())
        self.positional = list(positional)  # these of params/buffers go by position
        for name, shape in (params or {}).items():
            setattr(self, name, nn.Parameter(torch.randn(shape) * 0.5))
        for name, make in (buffers or {}).items():
            self.register_buffer(name, make())

    def forward(self, *inputs: Any) -> Any:
        named = {n: getattr(self, n) for n in self.names}
        pos = [named.pop(n) for n in self.positional]
        return self.fn(*inputs, *pos, **named, **self.kwargs)


def fn_spec(
    fn: Callable[..., Any],
    inputs: Sequence[Input],
    params: dict[str, tuple[int, ...]] | None = None,
    buffers: dict[str, Callable[[], torch.Tensor]] | None = None,
    positional: Sequence[str] = (),
    label: str | None = None,
    note: str = "",
    **kwargs: Any,
) -> Spec:
    """A spec of ``F.<fn>`` called with ``kwargs`` (shown as its options, then ``note``;
    ``label`` replaces both); ``head``, ``call``, ``pick`` and ``random`` go to the spec."""
    fields = {k: kwargs.pop(k) for k in ("head", "call", "pick", "random") if k in kwargs}
    opts = ", ".join(f"{k}={shown(v)}" for k, v in kwargs.items())
    text = label if label is not None else ", ".join(t for t in (opts, note) if t)

    def unit() -> nn.Module:
        return Fn(fn, params, buffers, positional, **kwargs)

    return Spec(f"F.{fn.__name__}", text, unit, tuple(inputs), **fields)
