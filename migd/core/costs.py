"""Reconfiguration cost model: seconds to create or destroy a GPU instance.

Defaults are [Villarrubia] (FAR), Table 1: average NVML create/destroy times per
instance size (compute slices), measured on A30, A100 and H100. The driver
serialises creations and destructions, so a plan's cost is the sum of its
operations. Models newer than H100 use the H100 column until measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache, cached_property

# size (compute slices) -> (create_s, destroy_s)
SEED003_TABLE1: dict[str, dict[int, tuple[float, float]]] = {
    "A30": {1: (0.11, 0.10), 2: (0.12, 0.10), 4: (0.13, 0.10)},
    "A100": {1: (0.16, 0.20), 2: (0.17, 0.20), 3: (0.20, 0.21), 4: (0.21, 0.21), 7: (0.24, 0.22)},
    "H100": {1: (0.16, 0.21), 2: (0.21, 0.23), 3: (0.33, 0.25), 4: (0.38, 0.26), 7: (0.42, 0.26)},
}


def _family(model: str) -> str:
    if model.startswith("A30"):
        return "A30"
    if model.startswith("A100"):
        return "A100"
    return "H100"


@dataclass(frozen=True)
class CostModel:
    """Create/destroy seconds by instance compute size; unknown sizes use the nearest larger."""

    table: Mapping[int, tuple[float, float]] = field(
        default_factory=lambda: dict(SEED003_TABLE1["A100"])
    )

    @staticmethod
    @cache
    def for_model(model: str) -> CostModel:
        """[Villarrubia]'s column for ``model`` (one shared instance per model: do not mutate)."""
        return CostModel(dict(SEED003_TABLE1[_family(model)]))

    def _nearest(self, compute_slices: int) -> tuple[float, float]:
        sizes = sorted(self.table)
        return self.table[next((s for s in sizes if s >= compute_slices), sizes[-1])]

    @cached_property
    def _rows(self) -> dict[int, tuple[float, float]]:
        """Row per compute size 1-8 (the most any model has), looked up once."""
        return {want: self._nearest(want) for want in range(1, 9)}

    def _row(self, compute_slices: int) -> tuple[float, float]:
        row = self._rows.get(compute_slices)
        return row if row is not None else self._nearest(compute_slices)

    def create_s(self, compute_slices: int) -> float:
        return self._row(compute_slices)[0]

    def destroy_s(self, compute_slices: int) -> float:
        return self._row(compute_slices)[1]
