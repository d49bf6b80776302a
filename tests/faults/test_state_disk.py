"""Item 1/2 of the hardening issue: a full or read-only state disk is not corruption."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from migd.daemon.store.state import StateStore
from migd.errors import StateDiskError, StateStoreError
from tests.faults.conftest import SmallDisk
from tests.unit.test_daemon_parts import _lease


def _three_leases(disk: SmallDisk) -> Path:
    path = disk.path / "migd.db"
    store = StateStore(path)
    for n in (1, 2, 3):
        store.save_lease(_lease(n))
    store.close()
    return path


def _health(store: StateStore) -> tuple[str | None, float | None]:
    return store.failing, store.failing_since


def _untouched(disk: SmallDisk, path: Path, before: bytes) -> None:
    """The database is where it was, byte for byte, and nothing was moved aside (SQLite's
    own empty -wal/-shm files may appear)."""
    assert path.read_bytes() == before
    assert not [name for name in disk.files() if "corrupt" in name]


def test_full_disk_at_start_is_a_disk_error_and_the_file_stays(small_disk: SmallDisk) -> None:
    path = _three_leases(small_disk)
    before = path.read_bytes()
    small_disk.fill()
    with pytest.raises(StateDiskError) as caught:
        StateStore(path)
    assert "full" in caught.value.message
    assert "free space" in caught.value.hint
    _untouched(small_disk, path, before)
    small_disk.free()
    assert [lease.lease_id for lease in StateStore(path).live_leases()] == ["L1", "L2", "L3"]


def test_read_only_disk_at_start_is_a_disk_error_and_the_file_stays(
    small_disk: SmallDisk,
) -> None:
    path = _three_leases(small_disk)
    before = path.read_bytes()
    small_disk.read_only()
    with pytest.raises(StateDiskError) as caught:
        StateStore(path)
    assert "read-only" in caught.value.message or "readonly" in caught.value.message.lower()
    small_disk.read_only(False)
    _untouched(small_disk, path, before)
    assert len(StateStore(path).live_leases()) == 3


def test_newer_schema_is_refused_not_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "migd.db"
    StateStore(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    db.commit()
    db.close()
    with pytest.raises(StateStoreError, match="newer"):
        StateStore(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["migd.db"]


def test_truncated_database_is_still_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "migd.db"
    store = StateStore(path)
    for n in range(1, 200):
        store.save_lease(_lease(n))
    store.close()
    data = path.read_bytes()
    path.write_bytes(data[:4096] + b"\xff" * (len(data) - 4096))  # pages overwritten
    store = StateStore(path)
    assert store.recovered_from is not None and store.recovered_from.exists()
    assert store.live_leases() == []


def test_full_disk_while_running_fails_typed_keeps_reads_and_recovers(
    small_disk: SmallDisk,
) -> None:
    path = _three_leases(small_disk)
    store = StateStore(path)
    small_disk.fill()
    with pytest.raises(StateDiskError):
        for n in range(4, 2000):  # the WAL's free frames run out within a few pages
            store.save_lease(_lease(n))
    assert store.failing is not None and "full" in store.failing
    assert store.failing_since is not None
    assert {"L1", "L2", "L3"} <= {lease.lease_id for lease in store.live_leases()}  # reads
    assert store.probe() is False
    small_disk.free()
    assert store.probe() is True
    assert _health(store) == (None, None)
    store.save_lease(_lease(5000))
    store.close()
    assert "L5000" in {lease.lease_id for lease in StateStore(path).live_leases()}


def test_a_failed_transaction_leaves_nothing_behind(small_disk: SmallDisk) -> None:
    path = _three_leases(small_disk)
    store = StateStore(path)
    small_disk.fill()
    big = {"blob": "x" * 200_000}  # more than the WAL has room for
    with pytest.raises(StateDiskError), store.transaction():
        store.save_lease(_lease(7))
        store.record("granted", big, lease_id="L7", job_id="7.0")
    small_disk.free()
    assert store.get_lease("L7") is None
    assert store.history(job_id="7.0") == []
    assert store.probe()


def test_a_batch_the_full_disk_refuses_lands_nothing_and_says_so(small_disk: SmallDisk) -> None:
    """One commit for a request's writes (issue 26 §4): on a full disk the commit fails,
    none of them land, the body is not interrupted, and the batch says it was lost."""
    path = _three_leases(small_disk)
    store = StateStore(path)
    small_disk.fill()
    big = {"blob": "x" * 200_000}  # more than the WAL has room for
    with store.batch() as batch:
        store.save_lease(_lease(7))
        store.record("granted", big, lease_id="L7", job_id="7.0")
        reached_the_end = True
    assert reached_the_end
    assert isinstance(batch.lost, StateDiskError) and "full" in batch.lost.message
    assert store.failing is not None
    small_disk.free()
    assert store.get_lease("L7") is None
    assert store.history(job_id="7.0") == []
    with store.batch() as again:
        store.save_lease(_lease(7))
    assert again.lost is None and store.failing is None
    assert store.get_lease("L7") is not None


def test_history_is_pruned_by_bytes_and_paged(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "migd.db")
    for _ in range(100):
        store.record("wrapper.note", {"text": "y" * 10_000}, lease_id="L1", job_id="1.0")
    assert store.count_events("L1", "wrapper.") == 100
    assert store.count_events("L1", "granted") == 0
    store.prune(keep=100_000, keep_bytes=250_000)
    rows = store.history(limit=1000)
    assert 20 <= len(rows) <= 25  # bounded by bytes although far below the row count
    page = store.history(limit=1000, max_bytes=50_000)
    assert len(page) == 4  # 4 x ~10 KB: the fifth would pass the reply's byte budget
    rest = store.history(limit=1000, before_id=page[-1].id)
    assert rest[0].id == page[-1].id - 1
    assert store.history(limit=5, max_bytes=10)[0].id == rows[0].id  # always one row
