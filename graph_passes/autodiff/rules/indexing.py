"""Index, gather and scatter ops: GatherElements, ScatterElements, ScatterND, TopK, Einsum."""

from __future__ import annotations
