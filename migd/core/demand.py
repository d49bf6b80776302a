"""Profile demand mix for demand-weighted reachability (pure).

[Siavashi] (GRMU, Algorithm 7) weights each profile by how likely it is to be
requested, estimated over a look-back window (24 h worked best there). migd
keeps an exponentially decaying count per profile (half-life instead of a hard
window, so one request never falls off a cliff) on top of a configured prior
mix, and hands the normalised weights to the planner.

Demand is counted per GPU model: a profile ID names a different profile on
another model (14 is ``2g.10gb`` on A100 but ``1g.6gb`` on A30), and a request
right-sizes to different profiles on different models. The scheduler records
every submitted request once per model it could run on, with the profile it
right-sizes to there, whether it is granted, queued or refused for now.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

DemandKey = tuple[str, int]
"""``(model, profile ID)``, e.g. ``("A100-40GB", 9)`` for 3g.20gb on an A100-40GB."""


@dataclass
class DemandModel:
    """Decaying request counts per ``(model, profile ID)``.

    Args:
        prior: ``(model, profile ID)`` -> weight before anything is observed (any scale;
            normalised per model).
        prior_strength: how many observed requests (per model) the prior is worth.
        half_life_s: observed counts halve over this time (default 24 h, [Siavashi]).
    """

    prior: Mapping[DemandKey, float] = field(default_factory=dict)
    prior_strength: float = 10.0
    half_life_s: float = 24 * 3600.0
    _counts: dict[DemandKey, float] = field(default_factory=dict)
    _last_s: float | None = None

    def _decay_to(self, now_s: float) -> None:
        if self._last_s is not None and now_s > self._last_s and self.half_life_s > 0:
            factor = math.pow(0.5, (now_s - self._last_s) / self.half_life_s)
            for key in self._counts:
                self._counts[key] *= factor
        self._last_s = now_s if self._last_s is None else max(self._last_s, now_s)

    def observe(self, model: str, profile_id: int, now_s: float, weight: float = 1.0) -> None:
        """Count one request for ``profile_id`` of ``model``."""
        self._decay_to(now_s)
        key = (model, profile_id)
        self._counts[key] = self._counts.get(key, 0.0) + weight

    def weights(self, now_s: float | None = None) -> dict[str, dict[int, float]]:
        """Normalised demand per model (each model's weights sum to 1); empty when unknown."""
        if now_s is not None:
            self._decay_to(now_s)
        prior_total: dict[str, float] = {}
        for (model, _), w in self.prior.items():
            prior_total[model] = prior_total.get(model, 0.0) + w
        combined: dict[str, dict[int, float]] = {}
        for (model, pid), w in self.prior.items():
            if prior_total[model] > 0:
                mix = combined.setdefault(model, {})
                mix[pid] = mix.get(pid, 0.0) + self.prior_strength * w / prior_total[model]
        for (model, pid), c in self._counts.items():
            mix = combined.setdefault(model, {})
            mix[pid] = mix.get(pid, 0.0) + c
        out: dict[str, dict[int, float]] = {}
        for model, mix in combined.items():
            total = sum(mix.values())
            if total > 0:
                out[model] = {pid: w / total for pid, w in mix.items() if w > 0}
        return out

    def snapshot(self) -> dict[str, float]:
        """Counts for the state db, keyed ``"MODEL:ID"``."""
        return {f"{model}:{pid}": round(v, 4) for (model, pid), v in self._counts.items()}

    def load(self, counts: Mapping[str, float], last_s: float | None) -> None:
        """Restore :meth:`snapshot` output.

        Counts saved by versions that keyed demand by bare profile ID cannot be told
        apart between models and are dropped (they decay within a day anyway).
        """
        loaded: dict[DemandKey, float] = {}
        for key, value in counts.items():
            model, sep, pid = str(key).rpartition(":")
            if sep and model and pid.isdigit():
                loaded[(model, int(pid))] = float(value)
        self._counts = loaded
        self._last_s = last_s
