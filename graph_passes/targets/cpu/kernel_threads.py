"""Which threads ortrain's CPU kernels run on: the products' threads.

ortrain's ``ortrain.cpu`` kernels run their blocks on torch's OpenMP team (when the
library binds torch's OpenMP runtime, ``ortrain/runtime/kernel_util.h``: ``for_blocks``)
or on ONNX Runtime's intra-op threads. The team's workers spin for a while after each
parallel region, so whichever pool the large products do *not* run on loses its cores
to spinning threads right after every kernel:

- products on the BLAS op (``ortrain.blas``, MKL on torch's team): kernels on the team;
- products on ONNX Runtime's own GEMMs (MLAS, on its intra-op threads; ``cpu_gemm``
  picks them on AMD): kernels on ONNX Runtime's threads too.

Both placements were measured against the other on the same graph
(``docs/benchmarks/history/``); the rule follows from where the products run, a fact of
the graph, so it needs no threshold.

Applied where a graph is serialized for ONNX Runtime, next to ``ort_order``: a property
of how the graph runs, not of what it computes (results do not depend on the threads).
"""

from __future__ import annotations

import onnx

from ortrain.core.names import BLAS_DOMAIN, CPU_DOMAIN

ATTRIBUTE = "omp_team"  # int; absent or 1: the team where the library has it; 0: ORT's


def products_on_team(graph: onnx.GraphProto) -> bool:
    """Whether the graph's products run on the BLAS op (torch's OpenMP team)."""
    return any(n.domain == BLAS_DOMAIN for n in graph.node)


def place_kernel_threads(graph: onnx.GraphProto) -> int:
    """Set each ``ortrain.cpu`` node's ``omp_team`` to where the products run, in place;
    returns the number of kernels whose setting changed."""
    team = products_on_team(graph)
    changed = 0
    for node in graph.node:
        if node.domain != CPU_DOMAIN:
            continue
        before = [a for a in node.attribute if a.name == ATTRIBUTE]
        kept = [a for a in node.attribute if a.name != ATTRIBUTE]
        del node.attribute[:]
        node.attribute.extend(kept)
        if not team:
            node.attribute.append(onnx.helper.make_attribute(ATTRIBUTE, 0))
        after = [a for a in node.attribute if a.name == ATTRIBUTE]
        changed += before != after
    return changed
