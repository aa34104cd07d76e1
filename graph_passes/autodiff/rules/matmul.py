"""MatMul and Gemm. Backward matmuls carry their transposes as attributes (Gemm
transA/transB, com.microsoft FusedMatMul) instead of explicit Transpose nodes. A 1-D
operand is promoted as numpy does (a row for A, a column for B) and its gradient
reshaped back."""

from __future__ import annotations

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient
from ortrain.graph_passes.infra.emitter import MS_DOMAIN


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def _promoted(ctx: GradContext, a, b, g, sa, sb, so):
    """numpy's 1-D operands as matrices: a [K] as [1, K], b [K] as [K, 1], and the output
    gradient with the axes the product dropped put back. Returns the values, their shapes
    and the shapes to give the input gradients back."""
    back = (sa, sb)
    a1, b1 = len(sa) == 1, len(sb) == 1
    if a1:
        sa = (1, sa[0])
        a = ctx.reshape(a, sa)
    if b1:
        sb = (sb[0], 1)
        b = ctx.reshape(b, sb)
    if a1 and b1:
        so = (1, 1)
    elif a1:  # the row axis the product dropped
        so = (*so[:-1], 1, so[-1])
    elif b1:  # the column axis
        so = (*so, 1)
    if a1 or b1:
        g = ctx.reshape(g, so)
    return a, b, g, sa, sb, so, back


@gradient("MatMul")
def matmul(ctx: GradContext):
    a, b, g, sa, sb, so, back = _promoted(
        ctx, ctx.I(0), ctx.I(1), ctx.GO(0), ctx.shape(ctx.I(0)), ctx.shape(ctx.I(1)),
        ctx.shape(ctx.O(0)),
    )  # fmt: skip
    out = {}
    if len(sb) == 2:
        # x[..., K] @ W[K, N]: fold batch dims into rows, one Gemm each way.
        k, n = sb
        rows = _prod(sa[:-1])
        g2 = ctx.reshape(g, (rows, n))
        if ctx.needs(0):
            ga = ctx.op("Gemm", g2, b, transB=1, shape=(rows, k))
            out[0] = ctx.reshape(ga, sa)
        if ctx.needs(1):
            a2 = ctx.reshape(a, (rows, k))
            out[1] = ctx.op("Gemm", a2, g2, transA=1, shape=(k, n))
    else:
        batch = so[:-2]
        sga, sgb = (*batch, sa[-2], sa[-1]), (*batch, sb[-2], sb[-1])
        if ctx.needs(0):
            ga = ctx.op("FusedMatMul", g, b, domain=MS_DOMAIN, transB=1, alpha=1.0, shape=sga)
            out[0] = ctx.sum_to(ga, sga, sa)
        if ctx.needs(1):
            gb = ctx.op("FusedMatMul", a, g, domain=MS_DOMAIN, transA=1, alpha=1.0, shape=sgb)
            out[1] = ctx.sum_to(gb, sgb, sb)
    return {i: ctx.reshape(v, back[i]) for i, v in out.items()}


@gradient("Gemm")
def gemm(ctx: GradContext):
    # Y = alpha * op(A) @ op(B) + beta * C
    a, b, g = ctx.I(0), ctx.I(1), ctx.GO(0)
    alpha = float(ctx.attr("alpha", 1.0))
    beta = float(ctx.attr("beta", 1.0))
    ta, tb = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))
    out = {}
    if ctx.needs(0):
        if not ta:  # dA = alpha * dY @ op(B)^T
            out[0] = ctx.op("Gemm", g, b, transB=1 - tb, alpha=alpha, shape=ctx.shape(a))
        else:  # dA = alpha * op(B) @ dY^T
            out[0] = ctx.op("Gemm", b, g, transA=tb, transB=1, alpha=alpha, shape=ctx.shape(a))
    if ctx.needs(1):
        if not tb:  # dB = alpha * op(A)^T @ dY
            out[1] = ctx.op("Gemm", a, g, transA=1 - ta, alpha=alpha, shape=ctx.shape(b))
        else:  # dB = alpha * dY^T @ op(A)
            out[1] = ctx.op("Gemm", g, a, transA=1, transB=ta, alpha=alpha, shape=ctx.shape(b))
    if ctx.has_input(2) and ctx.needs(2):
        gc = ctx.unbroadcast(g, ctx.I(2))
        if beta != 1.0:
            gc = ctx.op("Mul", gc, ctx.scalar_like(beta, g))
        out[2] = gc
    return out


@gradient("FusedMatMul", domain=MS_DOMAIN)
def fused_matmul(ctx: GradContext):
    # Y = alpha * op(A) @ op(B) with batch broadcasting (op: transA/transB swap the last
    # two axes). transBatchA/B are not emitted by ortrain's fusions and raise here. A 1-D
    # operand (a Linear over a vector) is a matrix of one row (A) or one column (B), as
    # in MatMul. Refused: transposing a 1-D operand, and transA with a 1-D B (ONNX
    # Runtime's forward of it is not numpy's product of the transpose and the vector).
    if ctx.attr("transBatchA", 0) or ctx.attr("transBatchB", 0):
        raise NotImplementedError("FusedMatMul with transBatchA/transBatchB")
    a, b = ctx.I(0), ctx.I(1)
    ta, tb = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))
    sa, sb = ctx.shape(a), ctx.shape(b)
    if (len(sa) == 1 and ta) or (len(sb) == 1 and (ta or tb)):
        raise NotImplementedError(
            f"FusedMatMul with a 1-D operand and transA={ta}, transB={tb} (shapes {sa} x {sb})"
        )
    if len(sb) == 2 and not ta and len(sa) >= 2:
        return _fused_matmul_2d_weight(ctx, tb)
    g = ctx.GO(0)
    so = ctx.shape(ctx.O(0))
    if len(sa) == 1 or len(sb) == 1:
        a, b, g, sa, sb, so, back = _promoted(ctx, a, b, g, sa, sb, so)
    else:
        back = (sa, sb)
    alpha = float(ctx.attr("alpha", 1.0))
    batch = so[:-2]
    sga, sgb = (*batch, sa[-2], sa[-1]), (*batch, sb[-2], sb[-1])
    mm = {"domain": MS_DOMAIN, "alpha": alpha}
    out = {}
    if ctx.needs(0):
        if not ta:
            ga = ctx.op("FusedMatMul", g, b, transB=1 - tb, shape=sga, **mm)
        else:
            ga = ctx.op("FusedMatMul", b, g, transA=tb, transB=1, shape=sga, **mm)
        out[0] = ctx.sum_to(ga, sga, sa)
    if ctx.needs(1):
        if not tb:
            gb = ctx.op("FusedMatMul", a, g, transA=1 - ta, shape=sgb, **mm)
        else:
            gb = ctx.op("FusedMatMul", g, a, transA=1, transB=ta, shape=sgb, **mm)
        out[1] = ctx.sum_to(gb, sgb, sb)
    return {i: ctx.reshape(v, back[i]) for i, v in out.items()}


def _fused_matmul_2d_weight(ctx: GradContext, tb: int):
    # x[..., K] @ op(W) with W 2-D (torch Linear after fusion: transB=1): batch dims fold
    # into rows, one Gemm each way, no batched products and no reduction over the batch.
    a, b, g = ctx.I(0), ctx.I(1), ctx.GO(0)
    alpha = float(ctx.attr("alpha", 1.0))
    sa = ctx.shape(a)
    k = sa[-1]
    n = ctx.shape(ctx.O(0))[-1]
    rows = _prod(sa[:-1])
    scale = {"alpha": alpha} if alpha != 1.0 else {}
    g2 = ctx.reshape(g, (rows, n))
    out = {}
    if ctx.needs(0):  # dx = alpha * dY @ op(W)^T
        ga = ctx.op("Gemm", g2, b, transB=1 - tb, shape=(rows, k), **scale)
        out[0] = ctx.reshape(ga, sa)
    if ctx.needs(1):
        a2 = ctx.reshape(a, (rows, k))
        if not tb:  # dW = alpha * x^T @ dY
            out[1] = ctx.op("Gemm", a2, g2, transA=1, shape=(k, n), **scale)
        else:  # dW = alpha * dY^T @ x
            out[1] = ctx.op("Gemm", g2, a2, transA=1, shape=(n, k), **scale)
    return out
