"""Queue policies for requests that cannot be placed at once (pure).

Two orders, from [MIG-HT] (MIGM §4.3):

* ``fifo`` (scheme B): arrival order, head-of-line blocking. A request that
  cannot be placed stops the pass, so every later request waits behind it:
  fair, and nothing starves, at the price of idle slices.
* ``size`` (scheme A): smallest memory first, with **backfill**: a request that
  cannot be placed is skipped and smaller ones behind it may start. Scheme A
  batches same-sized work and so needs fewer reconfigurations.

Both age: a request's place in the ``size`` order improves with waiting time
(``aging_s`` per rank step). A request that has waited ``starvation_s`` is
*starved*: starved requests move to the front of the order (oldest first), and
a starved request that cannot be placed ends the pass, so nothing younger
passes it any more, smaller or not (a reservation): a large request under a
stream of small ones is placed as soon as capacity frees up, with or without
aging. ``starvation_s = 0`` makes every request starved at once: arrival order
without backfill. Deadlines (``wait_s`` of the request) expire queued requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

T = TypeVar("T")


class QueuePolicy(StrEnum):
    FIFO = "fifo"
    SIZE = "size"


@dataclass(slots=True)
class QueuedRequest(Generic[T]):
    """A waiting request. ``payload`` is whatever the caller needs to place it."""

    ident: str
    arrival_s: float  # monotonic
    memory_mib: int
    deadline_s: float | None  # monotonic; None waits forever
    payload: T
    seq: int = 0  # arrival tie-break

    def age_s(self, now_s: float) -> float:
        return max(0.0, now_s - self.arrival_s)


@dataclass
class ScheduleResult:
    placed: list[str] = field(default_factory=list)
    blocked_by: str | None = None  # ident of the request that stopped the pass


@dataclass
class RequestQueue(Generic[T]):
    """Waiting requests in policy order.

    Args:
        policy: ``fifo`` or ``size``.
        aging_s: seconds of waiting that count as one step up in the ``size`` order
            (0 disables aging).
        starvation_s: a request that has waited this long goes to the front and no
            younger request may pass it (0 = immediately: arrival order, no backfill).
        backfill: let requests behind a blocked one start (default: only for ``size``).
    """

    policy: QueuePolicy = QueuePolicy.FIFO
    aging_s: float = 600.0
    starvation_s: float = 1800.0
    backfill: bool | None = None
    _items: dict[str, QueuedRequest[T]] = field(default_factory=dict)
    _seq: int = 0

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[QueuedRequest[T]]:
        return iter(list(self._items.values()))

    def __contains__(self, ident: object) -> bool:
        return ident in self._items

    def push(
        self, ident: str, payload: T, *, now_s: float, memory_mib: int, wait_s: float | None
    ) -> QueuedRequest[T]:
        self._seq += 1
        item = QueuedRequest(
            ident=ident,
            arrival_s=now_s,
            memory_mib=memory_mib,
            deadline_s=None if wait_s is None else now_s + wait_s,
            payload=payload,
            seq=self._seq,
        )
        self._items[ident] = item
        return item

    def restore(self, item: QueuedRequest[T]) -> None:
        """Put back a request with its original arrival (daemon restart)."""
        self._seq = max(self._seq, item.seq)
        self._items[item.ident] = item

    def remove(self, ident: str) -> QueuedRequest[T] | None:
        return self._items.pop(ident, None)

    def expired(self, now_s: float) -> list[QueuedRequest[T]]:
        """Remove and return the requests whose deadline has passed."""
        gone = [
            i for i in self._items.values() if i.deadline_s is not None and now_s >= i.deadline_s
        ]
        for item in gone:
            del self._items[item.ident]
        return gone

    @property
    def _backfill(self) -> bool:
        return self.backfill if self.backfill is not None else self.policy is QueuePolicy.SIZE

    def order(self, now_s: float) -> list[QueuedRequest[T]]:
        """The order in which requests are tried now: starved ones first, oldest first."""

        def arrival(item: QueuedRequest[T]) -> tuple[float, int]:
            return (item.arrival_s, item.seq)

        if self.policy is QueuePolicy.FIFO:
            # Age only grows with earlier arrival: the starved requests already
            # lead the arrival order.
            return sorted(self._items.values(), key=arrival)
        starved: list[QueuedRequest[T]] = []
        items: list[QueuedRequest[T]] = []
        for item in self._items.values():
            (starved if item.age_s(now_s) >= self.starvation_s else items).append(item)
        starved.sort(key=arrival)
        sizes = sorted({i.memory_mib for i in items})
        rank = {size: n for n, size in enumerate(sizes)}

        def key(item: QueuedRequest[T]) -> tuple[float, float, int]:
            aged = item.age_s(now_s) / self.aging_s if self.aging_s > 0 else 0.0
            return (rank[item.memory_mib] - aged, item.arrival_s, item.seq)

        return starved + sorted(items, key=key)

    def schedule(
        self, now_s: float, try_place: Callable[[QueuedRequest[T]], bool]
    ) -> ScheduleResult:
        """One pass: try requests in order, remove those ``try_place`` placed.

        ``try_place`` returns True when it placed the request (and is responsible for
        what that means). The pass stops at a blocked request under ``fifo`` without
        backfill, or at a blocked starved one (waited ``starvation_s``): starved
        requests come first in :meth:`order`, so no younger request is tried before
        capacity has gone to them.
        """
        result = ScheduleResult()
        for item in self.order(now_s):
            if try_place(item):
                self._items.pop(item.ident, None)
                result.placed.append(item.ident)
                continue
            if not self._backfill or item.age_s(now_s) >= self.starvation_s:
                result.blocked_by = item.ident
                break
        return result

    def position(self, ident: str, now_s: float) -> int | None:
        """1-based place of ``ident`` in the current order (for status output)."""
        for n, item in enumerate(self.order(now_s), start=1):
            if item.ident == ident:
                return n
        return None
