"""The indexed request queue against the sorting one it replaced (the oracle in
queue_oracle.py): the same order, positions, passes and expiries under random pushes,
removals, restores (a failed placement's retry), passes and deadlines, for both schemes,
with and without aging, starvation and backfill.

Times are whole seconds and ``aging_s`` a power of two, so the oracle's
``rank - age / aging_s`` is exact in floating point and ties are real ties (the indexed
queue orders by the exact ``rank * aging_s + arrival``)."""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from migd.core.queueing import Miss, QueuedRequest, QueuePolicy, RequestQueue
from tests.property.queue_oracle import OracleQueue

SIZES = [1, 2, 3, 5, 8]
CLASSES: list[Hashable] = [None, "a", "b"]

op = st.one_of(
    st.tuples(
        st.just("push"),
        st.integers(0, 6),  # time step
        st.sampled_from(SIZES),
        st.sampled_from(CLASSES),
        st.one_of(st.none(), st.integers(0, 20)),  # wait_s
    ),
    st.tuples(st.just("remove"), st.integers(0, 40)),
    st.tuples(st.just("retry"), st.integers(0, 40)),
    st.tuples(st.just("pass"), st.integers(0, 6), st.integers(0, 12)),  # time step, free
    st.tuples(st.just("expire"), st.integers(0, 6)),
)


def idents(items: list[QueuedRequest[str]]) -> list[str]:
    return [i.ident for i in items]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(list(QueuePolicy)),
    aging_s=st.sampled_from([0.0, 0.5, 1.0, 4.0, 64.0]),
    starvation_s=st.sampled_from([0.0, 3.0, 10.0, 1e9]),
    backfill=st.sampled_from([None, True, False]),
    ops=st.lists(op, max_size=60),
)
# A size whose every request has starved has no rank: 3 MiB is one step above 1 MiB,
# not two, so at t=10 the 3 MiB request (9 s, one step of 4 s ahead) goes first.
@example(
    policy=QueuePolicy.SIZE,
    aging_s=4.0,
    starvation_s=10.0,
    backfill=None,
    ops=[
        ("push", 0, 2, None, None),
        ("push", 1, 3, None, None),
        ("push", 6, 1, None, None),
        ("expire", 3),
    ],
)
def test_indexed_queue_agrees_with_the_sorting_one(
    policy: QueuePolicy,
    aging_s: float,
    starvation_s: float,
    backfill: bool | None,
    ops: list[tuple[object, ...]],
) -> None:
    new: RequestQueue[str] = RequestQueue(policy, aging_s, starvation_s, backfill)
    old: OracleQueue[str] = OracleQueue(policy, aging_s, starvation_s, backfill)
    now = 0.0
    pushed: list[str] = []
    placed: dict[str, tuple[QueuedRequest[str], QueuedRequest[str]]] = {}
    for step in ops:
        kind = step[0]
        if kind == "push":
            _, dt, size, klass, wait = step
            now += float(dt)  # type: ignore[arg-type]
            ident = f"r{len(pushed)}"
            pushed.append(ident)
            a = new.push(
                ident,
                ident,
                now_s=now,
                memory_mib=size,
                wait_s=wait,
                klass=klass,  # type: ignore[arg-type]
            )
            b = old.push(ident, ident, now_s=now, memory_mib=size, wait_s=wait)  # type: ignore[arg-type]
            b.klass = klass  # the oracle ignores it; the placing function reads it
            assert a.seq == b.seq
        elif kind == "remove" and pushed:
            ident = pushed[int(step[1]) % len(pushed)]  # type: ignore[call-overload]
            a_gone, b_gone = new.remove(ident), old.remove(ident)
            assert (a_gone is None) == (b_gone is None)
        elif kind == "retry" and placed:
            # A placement that fell through: the request comes back with its arrival.
            ident = sorted(placed)[int(step[1]) % len(placed)]  # type: ignore[call-overload]
            a_item, b_item = placed.pop(ident)
            if ident not in new and ident not in old:
                new.restore(a_item)
                old.restore(b_item)
        elif kind == "pass":
            _, dt, free = step
            now += float(dt)  # type: ignore[arg-type]
            before = {i.ident: i for i in new._items.values()}
            before_old = {i.ident: i for i in old._items.values()}
            assert (
                new.schedule(now, placer(int(free), True)).__dict__
                == old.schedule(  # type: ignore[call-overload]
                    now,
                    placer(int(free), False),  # type: ignore[call-overload]
                ).__dict__
            )
            for ident in set(before) - set(new._items):
                placed[ident] = (before[ident], before_old[ident])
        elif kind == "expire":
            now += float(step[1])  # type: ignore[arg-type]
            assert sorted(idents(new.expired(now))) == sorted(idents(old.expired(now)))
        assert idents(new.order(now)) == idents(old.order(now))
        assert len(new) == len(old)
        for ident in list(old._items):
            assert new.position(ident, now) == old.position(ident, now), ident
        assert new.position("nobody", now) is None


def placer(free: int, classes: bool):  # type: ignore[no-untyped-def]
    """Place while ``free`` lasts, smallest first or not; a (size, class) that failed in
    this pass fails again (as the scheduler's shape memo has it). The indexed queue is
    told so for classed requests (Miss.CLASS), so it skips the rest of their bucket."""
    room = [free]
    failed: set[tuple[int, Hashable]] = set()

    def place(item: QueuedRequest[str]) -> bool | Miss:
        key = (item.memory_mib, item.klass)
        if key in failed or item.memory_mib > room[0]:
            failed.add(key)
            return Miss.CLASS if classes and item.klass is not None else False
        room[0] -= item.memory_mib
        return True

    return place
