"""Profile demand mix for demand-weighted reachability (pure).

Seed 001 (GRMU, Algorithm 7) weights each profile by how likely it is to be
requested, estimated over a look-back window (24 h worked best there). migd
keeps an exponentially decaying count per profile (half-life instead of a hard
window, so one request never falls off a cliff) on top of a configured prior
mix, and hands the normalised weights to the planner.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class DemandModel:
    """Decaying request counts per profile ID.

    Args:
        prior: profile ID -> weight before anything is observed (any scale).
        prior_strength: how many observed requests the prior is worth.
        half_life_s: observed counts halve over this time (default 24 h, seed 001).
    """

    prior: Mapping[int, float] = field(default_factory=dict)
    prior_strength: float = 10.0
    half_life_s: float = 24 * 3600.0
    _counts: dict[int, float] = field(default_factory=dict)
    _last_s: float | None = None

    def _decay_to(self, now_s: float) -> None:
        if self._last_s is not None and now_s > self._last_s and self.half_life_s > 0:
            factor = math.pow(0.5, (now_s - self._last_s) / self.half_life_s)
            for pid in self._counts:
                self._counts[pid] *= factor
        self._last_s = now_s if self._last_s is None else max(self._last_s, now_s)

    def observe(self, profile_id: int, now_s: float, weight: float = 1.0) -> None:
        self._decay_to(now_s)
        self._counts[profile_id] = self._counts.get(profile_id, 0.0) + weight

    def weights(self, now_s: float | None = None) -> dict[int, float]:
        """Normalised demand (sums to 1); empty when nothing is known."""
        if now_s is not None:
            self._decay_to(now_s)
        total_prior = sum(self.prior.values())
        combined: dict[int, float] = {}
        if total_prior > 0:
            for pid, w in self.prior.items():
                combined[pid] = self.prior_strength * w / total_prior
        for pid, c in self._counts.items():
            combined[pid] = combined.get(pid, 0.0) + c
        total = sum(combined.values())
        if total <= 0:
            return {}
        return {pid: w / total for pid, w in combined.items() if w > 0}

    def snapshot(self) -> dict[str, float]:
        return {str(k): round(v, 4) for k, v in self._counts.items()}

    def load(self, counts: Mapping[str, float], last_s: float | None) -> None:
        self._counts = {int(k): float(v) for k, v in counts.items()}
        self._last_s = last_s
