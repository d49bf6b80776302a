"""A GPU's health: a set of conditions, each owned by the source that found it (pure).

Several parts of migd judge a GPU: the start-up checks (MIG mode, geometry, the
override), the resync that re-reads its instances, the MPS supervisor, the watchdog (a
hung NVML call), and (from other modules) XID events. Each raises
and clears only its own condition, so one source can never clear another's verdict::

    gpu.health.raise_(HealthSource.MPS, "MPS daemon cannot be restarted: GPU-1234", now)
    gpu.health.clear(HealthSource.MPS)          # the MPS supervisor's verdict only

A GPU is available for new work when it has no condition. ``str(health)`` is the
one-line summary ``migctl status`` and the ClassAd show ("ok", or the reasons).

The sources are :class:`HealthSource` (a ``StrEnum``: its values are what ``migctl
status`` and the state show). ``state_disk`` is a node-level condition, not a GPU's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType


class HealthSource(StrEnum):
    """Who judged a GPU unfit for new work (each raises and clears only its own)."""

    STARTUP = "startup"  # start-up checks: MIG mode, geometry, the [[gpu]] override
    RESYNC = "resync"  # the re-read of a GPU's instances found a layout it cannot use
    MPS = "mps"  # the MPS supervisor: a control daemon that cannot be restarted
    WATCHDOG = "watchdog"  # an NVML call hung
    XID = "xid"  # a critical NVML event (docs/operations.md, GPU health)


@dataclass(frozen=True)
class Condition:
    """Why a GPU takes no new work, as ``source`` judged it at ``since`` (wall clock)."""

    source: HealthSource
    reason: str
    since: float

    def to_dict(self) -> dict[str, str | float]:
        return {"source": str(self.source), "reason": self.reason, "since": self.since}


class GpuHealth:
    """The conditions of one GPU (see the module docstring)."""

    def __init__(self) -> None:
        self._conditions: dict[HealthSource, Condition] = {}

    def raise_(self, source: HealthSource, reason: str, now: float) -> bool:
        """Set ``source``'s condition; True if it is new or its reason changed (a
        condition raised again with the same reason keeps its ``since``)."""
        held = self._conditions.get(source)
        if held is not None and held.reason == reason:
            return False
        self._conditions[source] = Condition(source, reason, now)
        return True

    def clear(self, source: HealthSource) -> bool:
        """Drop ``source``'s condition; True if it had one."""
        return self._conditions.pop(source, None) is not None

    @property
    def available(self) -> bool:
        """No condition: the GPU may take new work."""
        return not self._conditions

    @property
    def conditions(self) -> Mapping[HealthSource, Condition]:
        """Source -> its condition (read-only; oldest first)."""
        return MappingProxyType(self._conditions)

    def __str__(self) -> str:
        if not self._conditions:
            return "ok"
        return "; ".join(c.reason for c in self._conditions.values())

    def __repr__(self) -> str:
        return f"GpuHealth({list(self._conditions.values())!r})"
