"""In-graph optimizer updates (one module per optimizer) and the update-graph builder."""

from graph_passes.optimizer.update_graph import UpdateGraph, build_update_graph

__all__ = ["UpdateGraph", "build_update_graph"]
