"""A GPU's health: a set of conditions, each owned by the source that found it (pure).

Several parts of migd judge a GPU: the start-up checks (MIG mode, geometry, the
override), the resync that re-reads its instances, the MPS supervisor, the watchdog (a
hung NVML call), and (from other modules) XID events and persistence mode. Each raises
and clears only its own condition, so one source can never clear another's verdict::

    gpu.health.raise_("mps", "MPS daemon cannot be restarted: GPU-1234", now)
    gpu.health.clear("mps")          # the MPS supervisor's verdict only

A GPU is available for new work when it has no condition. ``str(health)`` is the
one-line summary ``migctl status`` and the ClassAd show ("ok", or the reasons).

Sources in use: ``startup``, ``resync``, ``mps``, ``watchdog`` (migd.daemon),
``xid``, ``persistence``. ``state_disk`` is a node-level condition, not a GPU's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class Condition:
    """Why a GPU takes no new work, as ``source`` judged it at ``since`` (wall clock)."""

    source: str
    reason: str
    since: float

    def to_dict(self) -> dict[str, str | float]:
        return {"source": self.source, "reason": self.reason, "since": self.since}


class GpuHealth:
    """The conditions of one GPU (see the module docstring)."""

    def __init__(self) -> None:
        self._conditions: dict[str, Condition] = {}

    def raise_(self, source: str, reason: str, now: float) -> bool:
        """Set ``source``'s condition; True if it is new or its reason changed (a
        condition raised again with the same reason keeps its ``since``)."""
        held = self._conditions.get(source)
        if held is not None and held.reason == reason:
            return False
        self._conditions[source] = Condition(source, reason, now)
        return True

    def clear(self, source: str) -> bool:
        """Drop ``source``'s condition; True if it had one."""
        return self._conditions.pop(source, None) is not None

    @property
    def available(self) -> bool:
        """No condition: the GPU may take new work."""
        return not self._conditions

    @property
    def conditions(self) -> Mapping[str, Condition]:
        """Source -> its condition (read-only; oldest first)."""
        return MappingProxyType(self._conditions)

    def __str__(self) -> str:
        if not self._conditions:
            return "ok"
        return "; ".join(c.reason for c in self._conditions.values())

    def __repr__(self) -> str:
        return f"GpuHealth({list(self._conditions.values())!r})"
