"""Ops through which no gradient flows, and ops that must not be differentiated."""

from ortrain.core.names import GRAD_DOMAIN, STOP_GRADIENT
from ortrain.graph_passes.autodiff.registry import no_gradient, not_differentiable

# Integer-valued, boolean or random outputs: torch leaves no autograd path (a parameter
# read only through them gets no gradient, ``None``). The piecewise-constant float ops
# (Sign, Floor, Ceil, Round) are not here: torch differentiates through them with a zero
# gradient (``elementwise.py``).
no_gradient(
    "Shape",
    "Size",
    "Equal",
    "Less",
    "LessOrEqual",
    "Greater",
    "GreaterOrEqual",
    "And",
    "Or",
    "Not",
    "Xor",
    "Range",
    "ArgMax",
    "ArgMin",
    "NonZero",
    "OneHot",
    "ConstantOfShape",
    "Constant",
    "IsNaN",
    "IsInf",
    "RandomUniform",
    "RandomNormal",
    "RandomUniformLike",
    "RandomNormalLike",
    "Bernoulli",
    "EyeLike",
    "BitShift",
    "BitwiseAnd",
    "BitwiseOr",
    "BitwiseNot",
    "BitwiseXor",
)

# Control flow: the subgraph would need its own gradient graph, which ortrain does not build.
for _op in ("If", "Loop", "Scan"):
    not_differentiable(_op, "control flow (subgraphs) is not supported by ortrain's autodiff")

# x.detach() and values made under torch.no_grad() (ortrain/stop_gradient.py)
no_gradient(STOP_GRADIENT, domain=GRAD_DOMAIN)
