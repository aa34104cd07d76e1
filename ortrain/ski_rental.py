"""Whether a shape without a graph keeps running in eager or has its graph built now.

A graph pays for its build only over the calls that run on it, and a shape's future calls
are unknown: the ski-rental rule rents (runs in eager, timed) until what the rented calls
lost against the graph's estimated time would, with one more such call, reach what a
build costs, and then buys (builds). A shape that comes back often gets its graph after
at most one build's cost lost; one that never comes back (a size that depends on the data)
never costs a build; one that eager runs as fast as a graph never builds.

Used for whole-model batch shapes (``deferred_builds.py``) and for the new call
signatures of a compiled segment (``segments/partition.py``). Every number is measured
in the run: the calls' own times, the graphs' time per element, the last build's time.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Rented:
    """A shape's eager calls so far: their seconds and the elements of their inputs."""

    seconds: float = 0.0
    elements: int = 0
    steps: int = 0

    def add(self, seconds: float, elements: int) -> None:
        self.seconds += seconds
        self.elements += elements
        self.steps += 1

    def lost(self, per_element: float) -> float:
        """What these calls cost beyond a graph's estimate (``per_element`` seconds)."""
        return self.seconds - per_element * self.elements


def keeps_renting(r: Rented | None, per_element: float, elements: int, price: float) -> bool:
    """Whether a call of ``elements`` input elements of the shape whose eager calls are
    ``r`` runs in eager again, given a graph's ``per_element`` seconds and a build's
    ``price`` in seconds."""
    if r is None or r.steps == 0:  # its first call: eager's time is not known yet, a build is
        return True
    # this call would lose about what the earlier ones did on average
    per_call = r.seconds / r.steps - per_element * elements
    if per_call <= 0:  # eager is as fast: a build gains nothing
        return True
    return r.lost(per_element) + per_call < price
