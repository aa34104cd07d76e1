"""MatMul and Gemm. Backward matmuls carry their transposes as attributes (Gemm
transA/transB, com.microsoft FusedMatMul) instead of explicit Transpose nodes."""

from __future__ import annotations

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient
from ortrain.graph_passes.infra.emitter import MS_DOMAIN


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


@gradient("MatMul")
def matmul(ctx: GradContext):
    a, b, g = ctx.I(0), ctx.I(1), ctx.GO(0)
    sa, sb, so = ctx.shape(a), ctx.shape(b), ctx.shape(ctx.O(0))
    if len(sa) < 2 or len(sb) < 2:
        raise NotImplementedError(f"MatMul with a 1-D operand (shapes {sa} x {sb})")
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
        return out
    batch = so[:-2]
    if ctx.needs(0):
        ga = ctx.op("FusedMatMul", g, b, domain=MS_DOMAIN, transB=1, alpha=1.0)
        out[0] = ctx.sum_to(ga, (*batch, sa[-2], sa[-1]), sa)
    if ctx.needs(1):
        gb = ctx.op("FusedMatMul", a, g, domain=MS_DOMAIN, transA=1, alpha=1.0)
        out[1] = ctx.sum_to(gb, (*batch, sb[-2], sb[-1]), sb)
    return out


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
    # two axes). transBatchA/B are not emitted by ortrain's fusions and raise here.
    if ctx.attr("transBatchA", 0) or ctx.attr("transBatchB", 0):
        raise NotImplementedError("FusedMatMul with transBatchA/transBatchB")
    a, b = ctx.I(0), ctx.I(1)
    ta, tb = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))
    if len(ctx.shape(b)) == 2 and not ta and len(ctx.shape(a)) >= 2:
        return _fused_matmul_2d_weight(ctx, tb)
    g = ctx.GO(0)
    alpha = float(ctx.attr("alpha", 1.0))
    sa, sb, so = ctx.shape(a), ctx.shape(b), ctx.shape(ctx.O(0))
    batch = so[:-2]
    out = {}
    if ctx.needs(0):
        if not ta:
            ga = ctx.op("FusedMatMul", g, b, domain=MS_DOMAIN, transB=1 - tb, alpha=alpha)
        else:
            ga = ctx.op("FusedMatMul", b, g, domain=MS_DOMAIN, transA=tb, transB=1, alpha=alpha)
        out[0] = ctx.sum_to(ga, (*batch, sa[-2], sa[-1]), sa)
    if ctx.needs(1):
        if not tb:
            gb = ctx.op("FusedMatMul", a, g, domain=MS_DOMAIN, transA=1 - ta, alpha=alpha)
        else:
            gb = ctx.op("FusedMatMul", g, a, domain=MS_DOMAIN, transA=1, transB=ta, alpha=alpha)
        out[1] = ctx.sum_to(gb, (*batch, sb[-2], sb[-1]), sb)
    return out


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
