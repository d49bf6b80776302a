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

Cost: nothing is ever sorted on the way of a request. The ``size`` key
``rank - age / aging_s`` is, times ``aging_s``, ``rank * aging_s + arrival - now``, and
``now`` is the same for every request: the order among requests of one size never
changes as time passes. So the queue keeps its requests in arrival order once overall
(starved ones are a prefix of it, as is the whole order under ``fifo``) and once per
bucket of equal size and placement class (``klass``, given by the caller), and a pass
merges the bucket heads from a heap, ranks taken once per pass. Push, removal and
expiry (a heap of deadlines) cost O(log n); a pass costs O(log n) per request it places
and per bucket it finds blocked (``try_place`` answering :attr:`Miss.CLASS` skips the
rest of a bucket) plus O(buckets) to rank the sizes; :meth:`RequestQueue.position`
costs O(buckets x log n). Only :meth:`RequestQueue.order` (status output) sorts.
tests/property/test_queue_order.py holds the queue to the sorting implementation it
replaced.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Generic, TypeVar

T = TypeVar("T")


class QueuePolicy(StrEnum):
    FIFO = "fifo"
    SIZE = "size"


class Miss(Enum):
    """What ``try_place`` returns, besides True (placed) and False (not placed)."""

    #: Not placed, and no request of the same class (``QueuedRequest.klass``) can be
    #: placed in this pass either: the pass skips the rest of that class without asking.
    CLASS = "class"


@dataclass(slots=True)
class QueuedRequest(Generic[T]):
    """A waiting request. ``payload`` is whatever the caller needs to place it."""

    ident: str
    arrival_s: float  # monotonic
    memory_mib: int
    deadline_s: float | None  # monotonic; None waits forever
    payload: T
    seq: int = 0  # arrival tie-break
    #: Requests of one class and size are placed alike (the caller says which are); see
    #: :attr:`Miss.CLASS`. None: a class of its own kind, shared by every request
    #: pushed without one.
    klass: Hashable = None

    def age_s(self, now_s: float) -> float:
        return max(0.0, now_s - self.arrival_s)


def _arrival(item: QueuedRequest[T]) -> tuple[float, int]:
    return (item.arrival_s, item.seq)


class _Sorted(Generic[T]):
    """Queued requests in arrival order: a list of sorted chunks (at most ``2 * LOAD``
    each) with each chunk's last key, so insert, remove and look-ups cost a bisection
    over the chunks and one inside a chunk (O(log n) comparisons; the moves stay within
    a chunk). Arrival order is the order of pushes, so a push appends."""

    LOAD = 512

    __slots__ = ("_chunks", "_len", "_maxes")

    def __init__(self) -> None:
        self._chunks: list[list[QueuedRequest[T]]] = []
        self._maxes: list[tuple[float, int]] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[QueuedRequest[T]]:
        for chunk in self._chunks:
            yield from chunk

    def add(self, item: QueuedRequest[T]) -> None:
        key = _arrival(item)
        self._len += 1
        if not self._chunks:
            self._chunks.append([item])
            self._maxes.append(key)
            return
        i = bisect_left(self._maxes, key)
        if i == len(self._chunks):
            i -= 1
            self._chunks[i].append(item)
        else:
            insort(self._chunks[i], item, key=_arrival)
        chunk = self._chunks[i]
        self._maxes[i] = _arrival(chunk[-1])
        if len(chunk) > 2 * self.LOAD:
            half = len(chunk) // 2
            self._chunks[i : i + 1] = [chunk[:half], chunk[half:]]
            self._maxes[i : i + 1] = [_arrival(chunk[half - 1]), _arrival(chunk[-1])]

    def remove(self, item: QueuedRequest[T]) -> None:
        key = _arrival(item)
        i = bisect_left(self._maxes, key)
        chunk = self._chunks[i]
        j = bisect_left(chunk, key, key=_arrival)
        assert chunk[j] is item, "a queued request is in the arrival index once"
        del chunk[j]
        self._len -= 1
        if chunk:
            self._maxes[i] = _arrival(chunk[-1])
        else:
            del self._chunks[i], self._maxes[i]

    def first(self) -> QueuedRequest[T] | None:
        return self._chunks[0][0] if self._chunks else None

    def last(self) -> QueuedRequest[T] | None:
        return self._chunks[-1][-1] if self._chunks else None

    def after(self, key: tuple[float, int]) -> QueuedRequest[T] | None:
        """The first request that arrived after ``key`` (``(arrival_s, seq)``)."""
        i = bisect_right(self._maxes, key)
        if i == len(self._chunks):
            return None
        chunk = self._chunks[i]
        return chunk[bisect_right(chunk, key, key=_arrival)]

    def count_while(self, pred: Callable[[QueuedRequest[T]], bool]) -> int:
        """How many leading requests ``pred`` holds for; ``pred`` must hold for a prefix
        of the arrival order (true, then false for good)."""
        chunks = self._chunks
        lo, hi = 0, len(chunks)
        while lo < hi:  # the first chunk whose last request fails pred
            mid = (lo + hi) // 2
            if pred(chunks[mid][-1]):
                lo = mid + 1
            else:
                hi = mid
        before = sum(map(len, chunks[:lo]))  # chunk lengths: n / LOAD additions
        if lo == len(chunks):
            return before
        chunk = chunks[lo]
        a, b = 0, len(chunk)
        while a < b:
            mid = (a + b) // 2
            if pred(chunk[mid]):
                a = mid + 1
            else:
                b = mid
        return before + a


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

    Nothing is sorted on the way of a request (see the module docstring, "Cost"):
    push, remove and expiry are O(log n); a pass costs O(log n) per request it places
    and per bucket it finds blocked.
    """

    policy: QueuePolicy = QueuePolicy.FIFO
    aging_s: float = 600.0
    starvation_s: float = 1800.0
    backfill: bool | None = None
    _items: dict[str, QueuedRequest[T]] = field(default_factory=dict)
    _seq: int = 0
    # Every request in arrival order; and per (size, class) bucket, in arrival order.
    _arrivals: _Sorted[T] = field(default_factory=_Sorted)
    _buckets: dict[int, dict[Hashable, _Sorted[T]]] = field(default_factory=dict)
    # The sizes queued, ascending (a size's rank in the size order is its place here,
    # less the sizes whose every request has starved).
    _sizes: list[int] = field(default_factory=list)
    # (deadline, seq, request): a heap; entries of requests that left stay until they
    # come up (or until they are most of it, then it is rebuilt).
    _deadlines: list[tuple[float, int, QueuedRequest[T]]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[QueuedRequest[T]]:
        return iter(list(self._items.values()))

    def __contains__(self, ident: object) -> bool:
        return ident in self._items

    def push(
        self,
        ident: str,
        payload: T,
        *,
        now_s: float,
        memory_mib: int,
        wait_s: float | None,
        klass: Hashable = None,
    ) -> QueuedRequest[T]:
        self._seq += 1
        item = QueuedRequest(
            ident=ident,
            arrival_s=now_s,
            memory_mib=memory_mib,
            deadline_s=None if wait_s is None else now_s + wait_s,
            payload=payload,
            seq=self._seq,
            klass=klass,
        )
        self._add(item)
        return item

    def restore(self, item: QueuedRequest[T]) -> None:
        """Put back a request with its original arrival (daemon restart)."""
        self._seq = max(self._seq, item.seq)
        self._add(item)

    def _add(self, item: QueuedRequest[T]) -> None:
        old = self._items.get(item.ident)
        if old is not None:
            self._unindex(old)
        self._items[item.ident] = item
        self._arrivals.add(item)
        by_class = self._buckets.get(item.memory_mib)
        if by_class is None:
            by_class = self._buckets[item.memory_mib] = {}
            insort(self._sizes, item.memory_mib)
        bucket = by_class.get(item.klass)
        if bucket is None:
            bucket = by_class[item.klass] = _Sorted()
        bucket.add(item)
        if item.deadline_s is not None:
            heapq.heappush(self._deadlines, (item.deadline_s, item.seq, item))

    def _unindex(self, item: QueuedRequest[T]) -> None:
        self._arrivals.remove(item)
        by_class = self._buckets[item.memory_mib]
        bucket = by_class[item.klass]
        bucket.remove(item)
        if not bucket:
            del by_class[item.klass]
            if not by_class:
                del self._buckets[item.memory_mib]
                del self._sizes[bisect_left(self._sizes, item.memory_mib)]

    def remove(self, ident: str) -> QueuedRequest[T] | None:
        item = self._items.pop(ident, None)
        if item is not None:
            self._unindex(item)
            if item.deadline_s is not None and len(self._deadlines) > 2 * len(self._items) + 64:
                self._compact_deadlines()
        return item

    def _compact_deadlines(self) -> None:
        live = self._items
        self._deadlines = [e for e in self._deadlines if live.get(e[2].ident) is e[2]]
        heapq.heapify(self._deadlines)

    def expired(self, now_s: float) -> list[QueuedRequest[T]]:
        """Remove and return the requests whose deadline has passed."""
        gone: list[QueuedRequest[T]] = []
        heap = self._deadlines
        while heap and now_s >= heap[0][0]:
            _, _, item = heapq.heappop(heap)
            if self._items.get(item.ident) is item:
                self.remove(item.ident)
                gone.append(item)
        gone.sort(key=_arrival)
        return gone

    @property
    def _backfill(self) -> bool:
        return self.backfill if self.backfill is not None else self.policy is QueuePolicy.SIZE

    @property
    def backfills(self) -> bool:
        """Whether a pass goes on past a blocked request (that has not starved)."""
        return self._backfill

    def _starved(self, now_s: float) -> Callable[[QueuedRequest[T]], bool]:
        starvation_s = self.starvation_s
        return lambda item: item.age_s(now_s) >= starvation_s

    def _rank_key(
        self, now_s: float
    ) -> Callable[[QueuedRequest[T], int], tuple[float, float, int]]:
        """The order among requests that have not starved, as a key of (request, rank of
        its size). ``size`` orders by ``rank - age / aging_s``; times ``aging_s`` that is
        ``rank * aging_s + min(arrival, now) - now``, and ``now`` is the same for every
        request: a key that does not change as time passes."""
        if self.policy is QueuePolicy.FIFO:
            return lambda item, rank: (0.0, item.arrival_s, item.seq)
        aging_s = self.aging_s
        if aging_s <= 0:
            return lambda item, rank: (float(rank), item.arrival_s, item.seq)
        return lambda item, rank: (
            rank * aging_s + min(item.arrival_s, now_s),
            item.arrival_s,
            item.seq,
        )

    def _ranks(self, starved: Callable[[QueuedRequest[T]], bool]) -> dict[int, int]:
        """Rank of each size among requests that have not starved (a size whose every
        request starved has none): O(buckets), not O(requests)."""
        ranks: dict[int, int] = {}
        for size in self._sizes:
            for bucket in self._buckets[size].values():
                last = bucket.last()
                if last is not None and not starved(last):
                    ranks[size] = len(ranks)
                    break
        return ranks

    def order(self, now_s: float) -> list[QueuedRequest[T]]:
        """The order in which requests are tried now: starved ones first, oldest first.

        For status output: this one sorts (O(n log n)); the pass and :meth:`position`
        do not."""
        if self.policy is QueuePolicy.FIFO:
            # Age only grows with earlier arrival: the starved requests already
            # lead the arrival order.
            return list(self._arrivals)
        starved = self._starved(now_s)
        n_starved = self._arrivals.count_while(starved)
        head: list[QueuedRequest[T]] = []
        for item in self._arrivals:
            if len(head) == n_starved:
                break
            head.append(item)
        ranks = self._ranks(starved)
        key = self._rank_key(now_s)
        rest = [i for i in self._arrivals if not starved(i)]
        return head + sorted(rest, key=lambda i: key(i, ranks[i.memory_mib]))

    def schedule(
        self, now_s: float, try_place: Callable[[QueuedRequest[T]], bool | Miss]
    ) -> ScheduleResult:
        """One pass: try requests in order, remove those ``try_place`` placed.

        ``try_place`` returns True when it placed the request (and is responsible for
        what that means), False when it did not, or :attr:`Miss.CLASS` when no request
        of the same size and class can be placed in this pass (the rest of them are
        skipped unasked). The pass stops at a blocked request under ``fifo`` without
        backfill, or at a blocked starved one (waited ``starvation_s``): starved
        requests come first in :meth:`order`, so no younger request is tried before
        capacity has gone to them.

        Cost: O(log n) per request placed and per (size, class) found blocked, plus
        O(buckets) to rank the sizes; requests skipped by :attr:`Miss.CLASS` or behind
        the end of the pass cost nothing.
        """
        result = ScheduleResult()
        starved = self._starved(now_s)
        in_arrival_order = self.policy is QueuePolicy.FIFO and not self._backfill
        # Starved requests first, oldest first; one not placed ends the pass (under fifo
        # without backfill every request goes this way).
        while (head := self._arrivals.first()) is not None and (in_arrival_order or starved(head)):
            if try_place(head) is True:
                self.remove(head.ident)
                result.placed.append(head.ident)
                continue
            result.blocked_by = head.ident
            return result
        if head is None:
            return result
        # Nobody has starved: merge the buckets (each in arrival order) by the policy's
        # key, from one heap of their heads.
        ranks = self._ranks(starved)
        key = self._rank_key(now_s)
        heap: list[tuple[tuple[float, float, int], QueuedRequest[T], int, _Sorted[T]]] = []
        for size, rank in ranks.items():
            for bucket in self._buckets[size].values():
                first = bucket.first()
                assert first is not None
                heap.append((key(first, rank), first, rank, bucket))
        heapq.heapify(heap)
        while heap:
            _, item, rank, bucket = heapq.heappop(heap)
            placed = try_place(item)
            if placed is True:
                self.remove(item.ident)
                result.placed.append(item.ident)
            elif not self._backfill:
                result.blocked_by = item.ident
                break
            elif placed is Miss.CLASS:
                continue  # the rest of the bucket would not be placed either
            following = bucket.after(_arrival(item))
            if following is not None:
                heapq.heappush(heap, (key(following, rank), following, rank, bucket))
        return result

    def position(self, ident: str, now_s: float) -> int | None:
        """1-based place of ``ident`` in the current order (for status output), counted
        per bucket without sorting: O(buckets x log n)."""
        item = self._items.get(ident)
        if item is None:
            return None
        starved = self._starved(now_s)
        mine = _arrival(item)
        if self.policy is QueuePolicy.FIFO or starved(item):
            return self._arrivals.count_while(lambda i: _arrival(i) < mine) + 1
        ranks = self._ranks(starved)
        key = self._rank_key(now_s)
        kx = key(item, ranks[item.memory_mib])
        ahead = self._arrivals.count_while(starved)
        for size, rank in ranks.items():
            for bucket in self._buckets[size].values():
                before = bucket.count_while(lambda i: key(i, rank) < kx)  # noqa: B023
                if before:
                    ahead += max(0, before - bucket.count_while(starved))
        return ahead + 1
