"""Gradient rules, one small function per op, grouped by op family."""

_done = False


def register_all() -> None:
    """Import every rule module once (registration happens at import)."""
    global _done
    if _done:
        return
    _done = True
    from ortrain.graph_passes.autodiff.rules import (  # noqa: F401
        activation,
        batch_norm,
        contrib,
        conv,
        elementwise,
        grid_sample,
        indexing,
        loss,
        matmul,
        nn,
        nondiff,
        normalization,
        pooling,
        reduce,
        reduce_more,
        shape,
        signal,
    )
