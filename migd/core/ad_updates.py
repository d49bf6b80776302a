"""When ``condor-ad --watch`` sends the node's ad to the collector (pure).

The startd merges a cron ad into its internal slot ads as soon as it is read: ``START`` at
claim time sees the newest values whether or not the collector has them. The collector only
matters to the negotiator, and every ``- <tag> update:true`` line makes the startd send *every
slot ad it merges into* (the partitionable slot and each dynamic slot: about 25 per node of
8 GPUs) to the collector at once. A 60-second forced heartbeat on 1,250 nodes is about 520
slot-ad updates per second (docs/htcondor-notes.md (w)); the startd's own periodic update
(``UPDATE_INTERVAL``, 300 s by default, well under the collector's 900 s ``CLASSAD_LIFETIME``)
already carries the merged attributes.

So :class:`AdUpdates` forces an update only when an attribute a matcher reads has changed
(:data:`MATCHED`: health, placeable memory, modes), at most once per ``min_gap_s`` (a burst of
lease changes becomes one update), and as a keep-alive after ``keepalive_s`` without one,
shortened by a random part of ``jitter`` so nodes started together do not keep updating
together. Other changes (``MigdFreeMB``, ``MigdQueued``...) are written without
``update:true``: the startd has them at once, the collector at the startd's next update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: Attributes of migd's ads that the shipped ``START`` or the negotiator's matching read; a
#: change to any of them is worth a collector update. ``SlotMergeConstraint`` decides where
#: a per-GPU ad goes.
MATCHED = frozenset(
    {
        "MigdHealthy",
        "MigdHealthyGpus",
        "MigdLargestPlaceableMB",
        "MigdModes",
        "MigdGpuHealthy",
        "MigdGpuMode",
        "MigdGpuLargestPlaceableMB",
        "MigdGpuLargestPlaceableProfile",
        "SlotMergeConstraint",
    }
)


def matched_part(ad: str) -> str:
    """The lines of a cron ad (``Name = value`` lines, ``-`` separators) matchers read."""
    keep = []
    for line in ad.splitlines():
        name = line.partition("=")[0].strip()
        if line.startswith("-") or name in MATCHED:
            keep.append(line)
    return "\n".join(keep)


@dataclass(frozen=True)
class Publish:
    """Write ``ad``; with ``update`` its last separator gets ``update:true``."""

    ad: str
    update: bool
    why: str


class AdUpdates:
    """Decides, at each look at migd, what the publisher writes (times in seconds, any clock).

    ``rand`` returns a number in [0, 1): the jitter source, passed in so tests fix it.
    """

    def __init__(
        self,
        *,
        rand: Callable[[], float],
        min_gap_s: float = 1.0,
        keepalive_s: float = 600.0,
        jitter: float = 0.2,
    ) -> None:
        if min_gap_s < 0 or keepalive_s <= 0 or not 0 <= jitter < 1:
            raise ValueError("min_gap_s >= 0, keepalive_s > 0 and 0 <= jitter < 1")
        self._rand = rand
        self.min_gap_s = min_gap_s
        self.keepalive_s = keepalive_s
        self.jitter = jitter
        self._written: str | None = None  # the ad the startd has
        self._sent: str | None = None  # matched part of the ad the collector last got
        self._sent_at = float("-inf")
        self._keepalive_at = float("-inf")

    def look(self, ad: str, now: float) -> Publish | None:
        matched = matched_part(ad)
        if matched != self._sent:
            if now - self._sent_at >= self.min_gap_s:
                return self._force(ad, matched, now, "changed")
            # Too soon after the last update: the startd gets the ad now (START sees it),
            # the collector at the first look after the gap.
            return self._write(ad)
        if now >= self._keepalive_at:
            return self._force(ad, matched, now, "keep-alive")
        return self._write(ad)

    def _force(self, ad: str, matched: str, now: float, why: str) -> Publish:
        self._written, self._sent, self._sent_at = ad, matched, now
        self._keepalive_at = now + self.keepalive_s * (1.0 - self.jitter * self._rand())
        return Publish(ad, True, why)

    def _write(self, ad: str) -> Publish | None:
        if ad == self._written:
            return None
        self._written = ad
        return Publish(ad, False, "local")
