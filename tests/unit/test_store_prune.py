"""The hourly history prune costs the rows it drops, not the table (issue 26 §4: a
running SUM over every history row held the event loop ~190 ms at 100,000 rows).

What SQLite reads is watched through the connection's statement trace; what is kept is
checked against an exact count of another connection's view after each prune.
"""

from __future__ import annotations

import json
import sqlite3

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migd.core.leases import LeaseState
from migd.daemon.store.state import StateStore
from migd.errors import StateStoreError


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
    # Nor does any other read of history walk the table (``SELECT MIN(id), MAX(id)`` in
    # one statement did: SQLite's min/max optimisation serves one aggregate only).
    scans = {
        x: detail
        for x in seen
        if x.startswith("SELECT")
        for *_, detail in store._db.execute(f"EXPLAIN QUERY PLAN {x}")
        if detail.startswith("SCAN history")
    }
    assert scans == {}


def test_deleted_content_is_zeroed_only_where_no_more_pages_are_written(
    store: StateStore,
) -> None:
    """secure_delete=FAST: distributions build SQLite with SECURE_DELETE, whose writes of
    every freed page made a prune step's commit 35 % longer."""
    assert store._db.execute("PRAGMA secure_delete").fetchone() == (2,)


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


@pytest.mark.parametrize("how", ["transaction", "batch"])
def test_rows_whose_writes_were_lost_are_not_counted_so_no_kept_row_goes_for_them(
    store: StateStore, how: str
) -> None:
    """The running count is exact or unknown: a prune over the byte budget trusts it to
    walk the oldest rows, so rows counted and then rolled back would cost kept rows."""
    add(store, 20, 1_000)
    store.prune(keep=100_000, keep_bytes=50_000)
    assert store._history_bytes == on_disk(store)[1]
    with pytest.raises(StateStoreError):
        if how == "transaction":
            with store.transaction():
                add(store, 100, 1_000)
                store._write("INSERT INTO meta(key, value) VALUES(NULL, NULL)")
        else:
            with store.batch():
                add(store, 100, 1_000)
                store._write("INSERT INTO meta(key, value) VALUES(NULL, NULL)")
    assert on_disk(store)[0] == 20  # (rolled back)
    assert store._history_bytes is None  # counted again by the next prune
    assert store.prune(keep=100_000, keep_bytes=50_000) == 0
    assert on_disk(store)[0] == 20 and store._history_bytes == on_disk(store)[1]


def history_ids(store: StateStore) -> list[int]:
    with sqlite3.connect(store.path) as other:
        return [r[0] for r in other.execute("SELECT id FROM history ORDER BY id")]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(1, 400), min_size=0, max_size=120),
    keep=st.integers(1, 80),
    keep_bytes=st.integers(1, 20_000),
    step=st.integers(1, 40),
)
def test_bounded_steps_until_none_is_due_keep_exactly_what_one_prune_keeps(
    tmp_path_factory: pytest.TempPathFactory,
    sizes: list[int],
    keep: int,
    keep_bytes: int,
    step: int,
) -> None:
    """Any row and byte budget, any step: each step drops at most ``step`` rows, the
    oldest, and the steps end on the newest rows one unbounded prune keeps."""
    runs = {}
    for bounded in (False, True):
        s = StateStore(tmp_path_factory.mktemp("prune") / "migd.db")
        try:
            with s.transaction():
                for n, size in enumerate(sizes):
                    s.record("wrapper.note", {"text": "y" * size}, lease_id=f"L{n}")
            if not bounded:
                s.prune(keep, keep_bytes)
            else:
                s.prune(10**9, 10**12)  # the first prune: counts the bytes
                before = history_ids(s)
                while s.history_due(keep, keep_bytes):
                    assert s.prune(keep, keep_bytes, max_rows=step) in range(1, step + 1)
                    after = history_ids(s)
                    assert after == before[len(before) - len(after) :]  # the oldest went
                    before = after
            runs[bounded] = history_ids(s)
            assert s._history_bytes == on_disk(s)[1] <= keep_bytes or not runs[bounded]
            assert len(runs[bounded]) <= keep
        finally:
            s.close()
    assert runs[True] == runs[False]


@pytest.mark.parametrize("max_rows", [None, 3])
def test_rows_that_fill_the_byte_budget_exactly_are_kept(
    store: StateStore, max_rows: int | None
) -> None:
    add(store, 10, 100)
    size = len(json.dumps({"text": "y" * 100}))
    store.prune(keep=100, keep_bytes=10**9)  # counts the bytes
    while store.history_due(keep=100, keep_bytes=6 * size):
        store.prune(keep=100, keep_bytes=6 * size, max_rows=max_rows)
    assert on_disk(store) == (6, 6 * size)


def lease(store: StateStore, n: int, state: LeaseState, t: float) -> None:
    """A lease record and its history rows at time ``t``."""
    store._write(
        "INSERT INTO leases VALUES(?,?,?,?,?,?)", (f"L{n}", f"{n}.0", state.value, t, t, "{}")
    )
    for event in ("submitted", "granted"):
        store.record(event, {}, lease_id=f"L{n}", job_id=f"{n}.0", t=t)


def leases_left(store: StateStore) -> set[str]:
    with sqlite3.connect(store.path) as other:
        return {r[0] for r in other.execute("SELECT lease_id FROM leases")}


def test_a_bounded_step_drops_the_ended_leases_of_its_rows_and_leaves_the_scan_to_the_last(
    store: StateStore,
) -> None:
    """Each step deletes the leases its rows name by their key; the scan of the leases
    table (for a lease whose rows all went while it was live) comes once, at the step
    that leaves nothing due."""
    with store.transaction():
        lease(store, 0, LeaseState.ACTIVE, 0.0)  # live: never pruned
        for n in range(1, 40):
            lease(store, n, LeaseState.RELEASED, float(n))
        # A lease that ended with no history row left (its rows went while it was live).
        store._write("INSERT INTO leases VALUES('S','9.0','released',0.5,0.5,'{}')")
    store.prune(10**9, 10**12)
    seen = statements(store)
    assert store.prune(keep=20, keep_bytes=1 << 20, max_rows=30) == 30  # L0 .. L14's rows
    assert not [x for x in seen if "state NOT IN" in x and "lease_id=" not in x]
    assert leases_left(store) == {"L0", "S"} | {f"L{n}" for n in range(15, 40)}
    assert store.history_due(keep=20, keep_bytes=1 << 20)
    seen.clear()
    assert store.prune(keep=20, keep_bytes=1 << 20, max_rows=30) == 30  # L15 .. L29's
    assert not store.history_due(keep=20, keep_bytes=1 << 20)
    assert len([x for x in seen if "state NOT IN" in x and "lease_id=" not in x]) == 1
    assert leases_left(store) == {"L0"} | {f"L{n}" for n in range(30, 40)}  # S too went


def test_a_prune_without_the_sweep_leaves_a_lease_none_of_its_rows_names(
    store: StateStore,
) -> None:
    with store.transaction():
        for n in range(10):
            lease(store, n, LeaseState.RELEASED, float(n))
        store._write("INSERT INTO leases VALUES('S','9.0','released',0.5,0.5,'{}')")
    store.prune(keep=10, keep_bytes=1 << 20, sweep=False)
    assert leases_left(store) == {"S"} | {f"L{n}" for n in range(5, 10)}
    store.prune(keep=10, keep_bytes=1 << 20)
    assert leases_left(store) == {f"L{n}" for n in range(5, 10)}


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
