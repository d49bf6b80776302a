"""The hourly history prune costs the rows it drops, not the table (issue 26 §4: a
running SUM over every history row held the event loop ~190 ms at 100,000 rows).

What SQLite reads is watched through the connection's statement trace; what is kept is
checked against an exact count of another connection's view after each prune.
"""

from __future__ import annotations

import json
import sqlite3

from migd.daemon.store.state import StateStore


def add(store: StateStore, rows: int, size: int) -> None:
    with store.transaction():
        for n in range(rows):
            store.record("wrapper.note", {"text": "y" * size}, lease_id=f"L{n}", job_id=f"{n}.0")


def on_disk(store: StateStore) -> tuple[int, int]:
    """(rows, bytes of event data) of history, as another connection sees them."""
    with sqlite3.connect(store.path) as other:
        rows, size = other.execute(
            "SELECT COUNT(*), COALESCE(SUM(length(data)), 0) FROM history"
        ).fetchone()
    return int(rows), int(size)


def statements(store: StateStore) -> list[str]:
    seen: list[str] = []
    store._db.set_trace_callback(seen.append)
    return seen


def test_a_prune_under_the_byte_budget_reads_only_the_rows_it_drops(store: StateStore) -> None:
    add(store, 300, 100)
    store.prune(keep=200, keep_bytes=1 << 20)  # the first prune counts the table once
    assert on_disk(store)[0] == 200
    add(store, 50, 100)
    seen = statements(store)
    assert store.prune(keep=200, keep_bytes=1 << 20) == 50
    # Nothing sums every row (the window SUM, the total) or scans for MIN(t): the sum is
    # over the id range that goes, the oldest row kept is read by its primary key.
    summed = [x for x in seen if "SUM(length(data))" in x and "WHERE id <=" not in x]
    assert summed == [] and not [x for x in seen if "MIN(t)" in x]
    assert store._history_bytes == on_disk(store)[1]


def test_the_byte_budget_still_drops_the_oldest_rows_and_the_count_stays_exact(
    store: StateStore,
) -> None:
    add(store, 100, 10_000)
    store.prune(keep=100_000, keep_bytes=250_000)
    rows, size = on_disk(store)
    assert 20 <= rows <= 25 and size <= 250_000
    assert store._history_bytes == size
    add(store, 10, 10_000)  # counted as they are added: over the budget again
    assert store._history_bytes == size + 10 * len(json.dumps({"text": "y" * 10_000}))
    store.prune(keep=100_000, keep_bytes=250_000)
    assert on_disk(store)[1] <= 250_000 and store._history_bytes == on_disk(store)[1]
    newest = store.history(limit=1)[0]
    assert newest.lease_id == "L9"  # the newest rows are the ones kept


def test_an_over_count_from_a_lost_write_costs_a_recount_not_a_row(store: StateStore) -> None:
    add(store, 20, 1_000)
    store.prune(keep=100_000, keep_bytes=50_000)
    assert store._history_bytes is not None
    store._history_bytes += 10**9  # as if inserts that were counted rolled back
    assert store.prune(keep=100_000, keep_bytes=50_000) == 0
    assert on_disk(store)[0] == 20 and store._history_bytes == on_disk(store)[1]


def test_history_is_overdue_once_half_again_over_its_rows_or_bytes(store: StateStore) -> None:
    """What lets the 10 s housekeeping prune a busy node's history before the hour
    (Timers.step): counted as rows are added, no scan."""
    add(store, 300, 10)
    assert not store.history_overdue(keep=200, keep_bytes=1 << 20)  # 300 rows: 1.5 x 200
    add(store, 1, 10)
    assert store.history_overdue(keep=200, keep_bytes=1 << 20)
    reopened = StateStore(store.path)  # counted from the ids, not from what it added
    try:
        assert reopened.history_overdue(keep=200, keep_bytes=1 << 20)
        assert not reopened.history_overdue(keep=201, keep_bytes=1 << 20)
    finally:
        reopened.close()
    store.prune(keep=200, keep_bytes=1 << 20)
    assert not store.history_overdue(keep=200, keep_bytes=1 << 20)
    add(store, 100, 10)  # back to 300 rows
    assert not store.history_overdue(keep=200, keep_bytes=1 << 20)
    add(store, 4, 4000)  # few rows, but 16 kB of data on top of 3 kB: past 1.5 x 10 kB
    assert store.history_overdue(keep=400, keep_bytes=10_000)
    store.prune(keep=400, keep_bytes=10_000)
    assert not store.history_overdue(keep=400, keep_bytes=10_000)
    assert on_disk(store)[1] <= 10_000
