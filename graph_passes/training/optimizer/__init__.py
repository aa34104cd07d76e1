"""In-graph optimizer updates (one module per optimizer) and the update-graph builder."""

from ortrain.graph_passes.training.optimizer.update_graph import UpdateGraph, build_update_graph

__all__ = ["UpdateGraph", "build_update_graph"]
