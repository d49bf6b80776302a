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
    summed = [x for x in seen if "SUM(length(data))" in x and "AND id <=" not in x]
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


def sweep(store: StateStore, max_rows: int = 1_000) -> int:
    """The whole sweep, in steps; how many."""
    cursor: int | None = 0
    steps = 0
    while cursor is not None:
        cursor = store.sweep_ended_leases_step(cursor, max_rows)
        steps += 1
    return steps


def test_a_prune_drops_the_ended_leases_of_its_rows_by_key_and_the_sweep_the_rest(
    store: StateStore,
) -> None:
    """Each step deletes the leases its rows name by their key, never scanning the
    leases table; a lease whose rows all went while it was live waits for the sweep."""
    with store.transaction():
        lease(store, 0, LeaseState.ACTIVE, 0.0)  # live: never pruned
        for n in range(1, 40):
            lease(store, n, LeaseState.RELEASED, float(n))
        # A lease that ended with no history row left (its rows went while it was live).
        store._write("INSERT INTO leases VALUES('S','9.0','released',0.5,0.5,'{}')")
    store.prune(10**9, 10**12)
    seen = statements(store)
    assert store.prune(keep=20, keep_bytes=1 << 20, max_rows=30) == 30  # L0 .. L14's rows
    assert leases_left(store) == {"L0", "S"} | {f"L{n}" for n in range(15, 40)}
    assert store.history_due(keep=20, keep_bytes=1 << 20)
    assert store.prune(keep=20, keep_bytes=1 << 20, max_rows=30) == 30  # L15 .. L29's
    assert not store.history_due(keep=20, keep_bytes=1 << 20)
    assert leases_left(store) == {"L0", "S"} | {f"L{n}" for n in range(30, 40)}
    assert not [x for x in seen if "state NOT IN" in x and "lease_id=" not in x]
    assert store.prune(keep=20, keep_bytes=1 << 20) == 0
    assert sweep(store) == 2
    assert leases_left(store) == {"L0"} | {f"L{n}" for n in range(30, 40)}  # S went


def test_an_unbounded_prune_drops_its_rows_leases_and_leaves_the_rest_to_the_sweep(
    store: StateStore,
) -> None:
    with store.transaction():
        for n in range(10):
            lease(store, n, LeaseState.RELEASED, float(n))
        store._write("INSERT INTO leases VALUES('S','9.0','released',0.5,0.5,'{}')")
    store.prune(keep=10, keep_bytes=1 << 20)
    assert leases_left(store) == {"S"} | {f"L{n}" for n in range(5, 10)}
    sweep(store, 4)
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


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=0, max_size=80),
    between=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    step=st.integers(1, 25),
    pruned_first=st.integers(0, 20),
)
def test_the_byte_count_in_steps_ends_on_the_exact_bytes_whatever_is_added_between(
    tmp_path_factory: pytest.TempPathFactory,
    sizes: list[int],
    between: list[int],
    step: int,
    pruned_first: int,
) -> None:
    """The first prune's count, in bounded steps by id (Timers.COUNT_STEP_ROWS): rows
    added between two steps (``between``: how many before each step) and ids that do not
    start at 1 (rows pruned before a restart) still end on what SQLite sums."""
    s = StateStore(tmp_path_factory.mktemp("count") / "migd.db")
    try:
        add(s, pruned_first, 10)
        s.prune(keep=1, keep_bytes=10**9)
        reopened = StateStore(s.path)  # a start: the count is unknown
        s.close()
        s = reopened
        with s.transaction():
            for n, size in enumerate(sizes):
                s.record("wrapper.note", {"text": "y" * size}, lease_id=f"L{n}")
        seen = statements(s)
        steps = 0
        while True:
            more = between[steps] if steps < len(between) else 0
            add(s, more, 50)
            before = len(seen)
            done = s.count_history_step(step)
            # A step sums at most ``step`` rows by their ids (and its last step the rows
            # added since it began), never the table.
            summed = [x for x in seen[before:] if "SUM(length(data))" in x]
            assert all("WHERE id >" in x for x in summed)
            steps += 1
            if done:
                break
            assert steps <= (pruned_first + len(sizes) + sum(between)) // step + 2
        assert s._history_bytes == on_disk(s)[1]
        read = len(seen)
        assert s.count_history_step(step) and len(seen) == read  # known: no read
    finally:
        s.close()


def test_writes_lost_while_counting_start_the_count_over(store: StateStore) -> None:
    add(store, 30, 100)
    assert not store.count_history_step(10)
    with pytest.raises(StateStoreError), store.transaction():
        add(store, 5, 100)
        store._write("INSERT INTO meta(key, value) VALUES(NULL, NULL)")
    assert store._counting is None  # begun again, from the ids as they are now
    while not store.count_history_step(10):
        pass
    assert store._history_bytes == on_disk(store)[1]


def test_a_prune_while_counting_ends_the_count_with_its_own(store: StateStore) -> None:
    add(store, 30, 100)
    assert not store.count_history_step(10)
    store.prune(keep=10, keep_bytes=10**9)
    assert store.count_history_step(10)
    assert store._history_bytes == on_disk(store)[1]


def ended(store: StateStore, name: str, t: float, state: LeaseState = LeaseState.RELEASED) -> None:
    store._write(
        "INSERT INTO leases VALUES(?,?,?,?,?,?) ON CONFLICT(lease_id) DO UPDATE SET "
        "state=excluded.state, updated_s=excluded.updated_s",
        (name, "1.0", state.value, t, t, "{}"),
    )


def test_the_sweep_in_steps_removes_what_the_whole_sweep_removes(store: StateStore) -> None:
    """The hourly sweep by rowid, ``max_rows`` leases a step: the ended leases older than
    the oldest history row go, live ones and newer ones stay; a lease that ends or comes
    between two steps is judged by the same rule (it is newer: it stays)."""
    with store.transaction():
        for n in range(23):
            state = LeaseState.ACTIVE if n % 5 == 0 else LeaseState.RELEASED
            ended(store, f"E{n}", float(n), state)
        store.record("wrapper.note", {}, t=15.5)  # the oldest history row
        for n in range(23, 30):
            ended(store, f"E{n}", float(n))
    seen = statements(store)
    cursor: int | None = 0
    steps = 0
    while cursor is not None:
        cursor = store.sweep_ended_leases_step(cursor, 4)
        steps += 1
        if steps == 3:
            ended(store, "E14", 100.0)  # not yet swept (rowid 15): it ends again
            ended(store, "N", 100.0)  # a new lease, past the cursor
    assert steps == 31 // 4 + 1 + 1  # 31 leases 4 a step, and the one that finds none
    left = leases_left(store)
    live = {f"E{n}" for n in range(0, 23, 5)}
    assert left == live | {"E14", "N"} | {f"E{n}" for n in range(16, 30)}
    plans = {
        x: detail
        for x in seen
        if x.startswith(("SELECT", "DELETE"))
        for *_, detail in store._db.execute(f"EXPLAIN QUERY PLAN {x}")
        if detail.startswith("SCAN")
    }
    assert plans == {}  # by rowid, never the table


def test_no_history_row_left_means_no_sweep(store: StateStore) -> None:
    ended(store, "E0", 0.0)
    assert store.sweep_ended_leases_step(0, 10) is None
    assert leases_left(store) == {"E0"}
