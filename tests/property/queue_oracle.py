"""The request queue as it was before it was indexed (every pass, position and log line
sorted the whole queue): kept as the oracle the indexed queue must agree with
(tests/property/test_queue_order.py). Copied from migd/core/queueing.py at d038e64; do
not "fix" it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from migd.core.queueing import QueuedRequest, QueuePolicy, ScheduleResult

T = TypeVar("T")


@dataclass
class OracleQueue(Generic[T]):
    policy: QueuePolicy = QueuePolicy.FIFO
    aging_s: float = 600.0
    starvation_s: float = 1800.0
    backfill: bool | None = None
    _items: dict[str, QueuedRequest[T]] = field(default_factory=dict)
    _seq: int = 0

    def __len__(self) -> int:
        return len(self._items)

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
        self._seq = max(self._seq, item.seq)
        self._items[item.ident] = item

    def remove(self, ident: str) -> QueuedRequest[T] | None:
        return self._items.pop(ident, None)

    def expired(self, now_s: float) -> list[QueuedRequest[T]]:
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
        def arrival(item: QueuedRequest[T]) -> tuple[float, int]:
            return (item.arrival_s, item.seq)

        if self.policy is QueuePolicy.FIFO:
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
        for n, item in enumerate(self.order(now_s), start=1):
            if item.ident == ident:
                return n
        return None
