"""The state database's deferred commits (``StateDatabase.defer_commits``, issue 26 §4):
the batches of one turn of the event loop share one commit, settled together; nothing
else joins them, and nothing is left uncommitted at close.

What another connection reads is what is on disk (WAL readers see committed
transactions only), so each test checks what landed through one.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import structlog.testing

from migd.daemon.api.server import ApiServer
from migd.daemon.context import DaemonContext
from migd.daemon.store.database import Batch
from migd.daemon.store.state import StateStore
from migd.errors import StateDiskError, StateStoreError
from tests.unit.test_daemon_parts import _lease
from tests.unit.test_daemon_steps import _Commits


class Turn:
    """What the event loop's ``call_soon`` would be: the commits asked for, run by hand."""

    def __init__(self) -> None:
        self.asked: list[Callable[[], None]] = []

    def __call__(self, fn: Callable[[], None]) -> None:
        self.asked.append(fn)

    def end(self) -> None:
        asked, self.asked = self.asked, []
        for fn in asked:
            fn()


@pytest.fixture
def turn(store: StateStore) -> Turn:
    t = Turn()
    store.defer_commits(t)
    return t


def on_disk(store: StateStore) -> set[str]:
    """The lease ids another connection sees (committed ones only)."""
    other = sqlite3.connect(store.path)
    try:
        return {row[0] for row in other.execute("SELECT lease_id FROM leases")}
    finally:
        other.close()


def test_the_batches_of_one_turn_share_one_commit_and_settle_at_it(
    store: StateStore, turn: Turn
) -> None:
    settled: list[tuple[str, object]] = []
    batches: list[Batch] = []
    for n in (1, 2, 3):
        with store.batch() as batch:
            store.save_lease(_lease(n))
        batch.then(lambda lost, n=n: settled.append((f"L{n}", lost)))
        batches.append(batch)
    assert len(turn.asked) == 1  # one commit asked for, by the group's first batch
    assert not any(b.settled for b in batches) and settled == []
    assert on_disk(store) == set()  # nothing committed yet
    turn.end()
    assert on_disk(store) == {"L1", "L2", "L3"}
    assert settled == [("L1", None), ("L2", None), ("L3", None)]
    assert all(b.settled and b.lost is None for b in batches)
    with store.batch() as empty:
        pass  # wrote nothing, no group open: settled at its end, no commit asked for
    assert empty.settled and turn.asked == []


def test_when_committed_waits_for_the_group_and_only_while_one_waits(
    store: StateStore, turn: Turn
) -> None:
    told: list[str] = []
    assert not store.when_committed(lambda: told.append("never"))
    with store.batch():
        store.save_lease(_lease(1))
    assert store.when_committed(lambda: told.append("landed"))
    assert told == []
    turn.end()
    assert told == ["landed"] and on_disk(store) == {"L1"}
    assert not store.when_committed(lambda: told.append("never"))


def test_a_write_of_its_own_and_a_transaction_commit_the_waiting_group_first(
    store: StateStore, turn: Turn
) -> None:
    with store.batch() as first:
        store.save_lease(_lease(1))
    store.set_meta("draining", ["GPU-1"])  # a write outside any batch
    assert first.settled and first.lost is None
    assert on_disk(store) == {"L1"}

    with store.batch() as second:
        store.save_lease(_lease(2))
    with pytest.raises(RuntimeError), store.transaction():
        store.save_lease(_lease(3))
        raise RuntimeError("the transaction's body fails")
    # The transaction rolled back its own write only: the batch before it had landed.
    assert second.settled and second.lost is None
    assert on_disk(store) == {"L1", "L2"}
    turn.end()  # the commit asked for finds nothing left to do
    assert on_disk(store) == {"L1", "L2"}


def test_a_batch_in_a_transaction_is_the_transactions(store: StateStore, turn: Turn) -> None:
    with store.transaction():
        with store.batch() as inner:
            store.save_lease(_lease(1))
        assert inner.settled and inner.lost is None  # the outer one commits
        assert on_disk(store) == set()
    assert on_disk(store) == {"L1"} and turn.asked == []


def test_close_commits_what_waits(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "migd.db")
    turn = Turn()
    store.defer_commits(turn)
    with store.batch() as batch:
        store.save_lease(_lease(1))
    store.close()  # the loop stopped before the turn ended
    assert batch.settled and batch.lost is None
    again = StateStore(tmp_path / "migd.db")
    try:
        assert again.get_lease("L1") is not None
    finally:
        again.close()


def test_a_group_whose_commit_fails_is_lost_whole_and_the_next_one_lands(
    store: StateStore, turn: Turn
) -> None:
    conn = _Commits(store._db)
    store._db = conn  # type: ignore[assignment]
    batches = []
    for n in (1, 2):
        with store.batch() as batch:
            store.save_lease(_lease(n))
        batches.append(batch)
    conn.fail = True
    turn.end()
    conn.fail = False
    assert all(isinstance(b.lost, StateDiskError) for b in batches)
    assert store.failing is not None
    assert on_disk(store) == set()
    with store.batch() as again:
        store.save_lease(_lease(1))
    turn.end()
    assert again.lost is None and store.failing is None
    assert on_disk(store) == {"L1"}


def test_a_group_sqlite_rolled_back_on_its_own_is_lost_not_taken_for_landed(
    store: StateStore, turn: Turn
) -> None:
    """SQLite rolls an open transaction back itself after some failed statements (an
    I/O error, no memory), reads included: the batches waiting in it are lost, and the
    next batch does not join a group whose writes are gone."""
    with store.batch() as first:
        store.save_lease(_lease(1))
    store._db.execute("ROLLBACK")  # what SQLite does after such a failure
    with store.batch() as second:
        store.save_lease(_lease(2))
    assert first.settled and isinstance(first.lost, StateStoreError)
    assert "rolled back" in first.lost.message
    assert not second.settled
    turn.end()
    assert second.settled and second.lost is None
    assert on_disk(store) == {"L2"}


def test_a_failing_callback_does_not_keep_the_others_from_the_commit(
    store: StateStore, turn: Turn
) -> None:
    told: list[str] = []

    def broken(_lost: object) -> None:
        raise RuntimeError("a bug in one listener")

    with store.batch() as first:
        store.save_lease(_lease(1))
    first.then(broken)
    with store.batch() as second:
        store.save_lease(_lease(2))
    second.then(lambda lost: told.append(f"second {lost}"))
    with structlog.testing.capture_logs() as logs:
        turn.end()
    assert told == ["second None"]
    assert [e["event"] for e in logs] == ["state_db.batch_callback_failed"]


class _Writer:
    """The two things ``ApiServer._send`` uses of a StreamWriter: write, and a transport
    that took everything (nothing buffered); what was written, and when."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.transport = self
        self.closed = False

    def write(self, data: bytes) -> None:
        self.log.append(f"wrote {data.decode()}")

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


def test_a_reply_is_written_at_the_commit_itself_not_a_turn_of_the_loop_later(
    store: StateStore,
) -> None:
    """Issue 26 §4: a reply that waits for the group's commit is written in the commit's
    callback. Resuming the replying coroutine first would take one more turn of the loop,
    after every request that came in meanwhile (here: a callback the loop already
    holds when the commit runs), and put that turn's work into each reply's latency."""
    log: list[str] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        store.defer_commits(loop.call_soon)
        api = SimpleNamespace(send_timeout_s=5.0)
        ctx = cast(DaemonContext, SimpleNamespace(store=store, config=SimpleNamespace(api=api)))
        server = ApiServer(ctx, lambda _id: None, asyncio.Event())  # type: ignore[arg-type,return-value]
        writer = _Writer(log)

        async def request() -> None:
            with store.batch():
                store.save_lease(_lease(1))  # the request's write: its commit is asked for
            await server._send(writer, b"granted", 1000)  # type: ignore[arg-type]

        sending = asyncio.create_task(request())
        await asyncio.sleep(0)  # the request runs up to its wait for the commit
        assert log == [] and on_disk(store) == set()
        # What the loop serves next: the commit, then this (a request that came meanwhile).
        loop.call_soon(lambda: log.append(f"next request; on disk {sorted(on_disk(store))}"))
        await sending
        assert writer.closed and server.unsent.total == 0

    asyncio.run(scenario())
    assert log == ["wrote granted", "next request; on disk ['L1']"]
