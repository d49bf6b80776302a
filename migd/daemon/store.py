"""Durable state in SQLite (WAL) under the state directory.

Tables: ``leases`` (every lease, its state and its full record as JSON),
``history`` (every decision and event, for ``migctl history``/``explain``),
``instances`` (MIG instances migd created, so a restart knows its own) and
``meta`` (schema version, GPU drain flags, demand counts).

A file that is not a database (``SQLITE_NOTADB``), that SQLite reports corrupt
(``SQLITE_CORRUPT``) or that fails ``PRAGMA quick_check`` is moved aside
(``migd.db.corrupt-<time>``) and a fresh one is started: nothing is lost that the
GPUs themselves cannot tell again, because start-up reconciliation re-adopts every
instance it finds and never destroys one with processes.

Every other failure is the disk's, not the file's (full, read-only, I/O error,
permissions): the file is left untouched and :class:`StateDiskError` is raised, at
start-up (the daemon exits non-zero and systemd's ``Restart=on-failure`` tries again)
and while running (the request fails with that typed error, :attr:`StateStore.failing`
says why, and the first write that succeeds again clears it; :meth:`StateStore.probe`
is that write for callers that want to find out without a request).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from migd.core.leases import LeaseState
from migd.core.scheduler import Lease, LeaseRequest
from migd.errors import StateDiskError, StateStoreError

# SQLite's primary result codes (sqlite3.h) that say the *file* is bad; only these (and a
# failed quick_check) justify moving the database aside. SQLITE_FULL (13), SQLITE_IOERR
# (10), SQLITE_READONLY (8), SQLITE_CANTOPEN (14) and SQLITE_PERM (3) are the disk's or the
# mount's: moving the file aside on them loses every lease for a condition that goes away.
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
_CORRUPTION_CODES = frozenset({_SQLITE_CORRUPT, _SQLITE_NOTADB})

# History kept, in bytes of event data (rows are pruned by count *and* by bytes, so a few
# large reports cannot grow the database without bound).
HISTORY_KEEP_BYTES = 64 * 1024 * 1024

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    state TEXT NOT NULL,
    created_s REAL NOT NULL,
    updated_s REAL NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS leases_state ON leases(state);
CREATE INDEX IF NOT EXISTS leases_job ON leases(job_id);
CREATE TABLE IF NOT EXISTS history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    t REAL NOT NULL,
    lease_id TEXT,
    job_id TEXT,
    event TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS history_job ON history(job_id);
CREATE INDEX IF NOT EXISTS history_lease ON history(lease_id);
CREATE TABLE IF NOT EXISTS instances (
    gpu_uuid TEXT NOT NULL,
    start INTEGER NOT NULL,
    profile_id INTEGER NOT NULL,
    mig_uuid TEXT,
    created_s REAL NOT NULL,
    PRIMARY KEY (gpu_uuid, start)
);
"""


@dataclass(frozen=True)
class HistoryRow:
    id: int
    t: float
    lease_id: str | None
    job_id: str | None
    event: str
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "t": self.t,
            "lease_id": self.lease_id,
            "job_id": self.job_id,
            "event": self.event,
            "data": self.data,
        }


def lease_to_json(lease: Lease) -> str:
    data = lease.to_dict()
    data["request"] = {
        "job_id": lease.request.job_id,
        "memory_mib": lease.request.memory_mib,
        "slot": lease.request.slot,
        "min_compute": lease.request.min_compute,
        "profile": lease.request.profile,
        "mode": lease.request.mode,
        "gpu_uuids": list(lease.request.gpu_uuids) if lease.request.gpu_uuids else None,
        "wait_s": lease.request.wait_s,
        "mps_clients": lease.request.mps_clients,
        "mps_thread_percentage": lease.request.mps_thread_percentage,
    }
    data["owner_start_s"] = lease.owner_start_s
    data["decision"] = lease.decision
    data["heartbeat_s"] = lease.heartbeat_s
    return json.dumps(data, sort_keys=True)


def lease_from_json(text: str) -> Lease:
    data = json.loads(text)
    req = data["request"]
    request = LeaseRequest(
        job_id=req["job_id"],
        memory_mib=req["memory_mib"],
        slot=req.get("slot", ""),
        min_compute=req.get("min_compute", 0),
        profile=req.get("profile"),
        mode=req.get("mode", "auto"),
        gpu_uuids=tuple(req["gpu_uuids"]) if req.get("gpu_uuids") else None,
        wait_s=req.get("wait_s"),
        mps_clients=req.get("mps_clients", 1),
        mps_thread_percentage=req.get("mps_thread_percentage"),
    )
    return Lease(
        lease_id=data["lease_id"],
        request=request,
        owner_uid=data["owner_uid"],
        owner_pid=data["owner_pid"],
        created_s=data["created_s"],
        owner_start_s=data.get("owner_start_s"),
        state=LeaseState(data["state"]),
        updated_s=data.get("updated_s", 0.0),
        gpu=data.get("gpu"),
        gpu_uuid=data.get("gpu_uuid"),
        mode=data.get("mode"),
        profile=data.get("profile"),
        start=data.get("start"),
        mig_uuid=data.get("mig_uuid"),
        memory_limit_mib=data.get("memory_limit_mib"),
        env=dict(data.get("env") or {}),
        decision=data.get("decision"),
        reason=data.get("reason", ""),
        heartbeat_s=data.get("heartbeat_s"),
        deadline_s=data.get("deadline_s"),
        mps_thread_percentage=data.get("mps_thread_percentage"),
        warning=data.get("warning", ""),
        warning_s=data.get("warning_s"),
    )


class _Corrupt(Exception):
    """The database file itself is bad (not the disk under it)."""


def _primary_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else int(code) & 0xFF


def _disk_state(directory: Path) -> str:
    """What the file system under ``directory`` says about itself: SQLite's own message
    for a read-only mount is only "unable to open database file"."""
    try:
        fs = os.statvfs(directory)
    except OSError as exc:
        return f"cannot stat the state directory: {exc.strerror}"
    if fs.f_flag & os.ST_RDONLY:
        return "the file system is mounted read-only"
    if fs.f_bavail == 0 or fs.f_favail == 0:
        return "the file system is full"
    return ""


def _disk_error(path: Path, exc: BaseException, doing: str) -> StateDiskError:
    what = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
    state = _disk_state(path.parent)
    return StateDiskError(
        f"cannot {doing} the state database {path}: {exc} ({what})"
        + (f"; {state}" if state else "")
        + "; the file is left as it is",
        path=str(path),
        sqlite_error=what,
        disk=state,
    )


class StateStore:
    """The SQLite state database. Not thread-safe: the daemon uses it from its event loop.

    Attributes:
        failing: why the last write failed on the disk (full, read-only, I/O), or None
            while writes succeed. A node-level condition for ``migctl status`` and the
            machine ad; cleared by the next write that succeeds (see :meth:`probe`).
        failing_since: wall-clock time of the first failed write of the current spell.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.recovered_from: Path | None = None
        self.corruption: str | None = None
        self.failing: str | None = None
        self.failing_since: float | None = None
        self._db = self._open()
        self._checkpointer: threading.Thread | None = None
        self._stop_checkpoints = threading.Event()
        # (WAL frames, frames checkpointed) from the background thread's last round.
        self.last_checkpoint: tuple[int, int] | None = None

    def checkpoint_in_background(self, interval_s: float = 2.0) -> None:
        """Move WAL checkpoints off the caller's thread.

        SQLite checkpoints the WAL inside whichever commit crosses 1000 pages, and a
        checkpoint syncs the database file: a ~5 ms stall on the daemon's event loop every
        few hundred lease changes, the whole p99 of a lease. Here a thread with its own
        connection checkpoints every ``interval_s`` instead (PASSIVE: it never blocks a
        writer, and the sqlite3 module drops the GIL while it waits on the disk).
        """
        if self._checkpointer is not None:
            return
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        self._stop_checkpoints.clear()
        self._checkpointer = threading.Thread(
            target=self._checkpoint_loop, args=(interval_s,), name="migd-wal", daemon=True
        )
        self._checkpointer.start()

    def _checkpoint_loop(self, interval_s: float) -> None:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA busy_timeout=5000")
            while not self._stop_checkpoints.wait(interval_s):
                try:
                    _busy, frames, done = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    self.last_checkpoint = (frames, done)
                except sqlite3.Error:
                    continue  # busy or a transient error: the next round catches up
        finally:
            db.close()

    def _open(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return self._connect()
        except _Corrupt as exc:
            self.corruption = str(exc)
        except OSError as exc:
            raise _disk_error(self.path, exc, "open") from exc
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        try:
            for suffix in ("", "-wal", "-shm"):
                src = Path(str(self.path) + suffix)
                if src.exists():
                    src.rename(Path(str(aside) + suffix))
            self.recovered_from = aside
            return self._connect()
        except (OSError, _Corrupt) as exc:
            raise _disk_error(self.path, exc, "replace the corrupt") from exc

    def _connect(self) -> sqlite3.Connection:
        """Open and check the database. Raises _Corrupt for a bad file, StateDiskError
        for a disk that refuses (the file untouched), StateStoreError for a newer schema."""
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise _disk_error(self.path, exc, "open") from exc
        try:
            self._prepare(db)
        except sqlite3.Error as exc:
            db.close()
            if _primary_code(exc) in _CORRUPTION_CODES:
                raise _Corrupt(str(exc)) from exc
            raise _disk_error(self.path, exc, "open") from exc
        except BaseException:
            db.close()
            raise
        return db

    def _prepare(self, db: sqlite3.Connection) -> None:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA busy_timeout=5000")
        check = db.execute("PRAGMA quick_check").fetchone()
        if not check or check[0] != "ok":
            raise _Corrupt(f"integrity check failed: {check}")
        db.executescript(_SCHEMA)
        row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            db.execute(
                "INSERT INTO meta(key, value) VALUES('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )
        elif int(row[0]) > SCHEMA_VERSION:
            raise StateStoreError(
                f"state db schema {row[0]} is newer than this migd ({SCHEMA_VERSION})",
                hint="run the newer migd, or move the state db aside",
            )

    # -- writes and the disk's health -------------------------------------------------------

    def _write(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        """One write statement; a disk that refuses it becomes StateDiskError."""
        try:
            cur = self._db.execute(sql, params)
        except sqlite3.Error as exc:
            raise self._failed(exc) from exc
        if self.failing is not None and not self._db.in_transaction:
            self._recovered()
        return cur

    def _failed(self, exc: sqlite3.Error) -> StateStoreError:
        if _primary_code(exc) in _CORRUPTION_CODES:
            return StateStoreError(
                f"the state database {self.path} is corrupt: {exc}",
                hint="restart migd: it moves the file aside and re-adopts leases from the GPUs",
            )
        what = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
        state = _disk_state(self.path.parent) or str(exc)
        if self.failing is None:
            self.failing_since = time.time()
        self.failing = f"the state disk refuses writes: {state} ({what})"
        return StateDiskError(
            f"migd cannot record changes in {self.path}: {state} ({exc}); the request "
            "changed nothing",
            path=str(self.path),
            sqlite_error=what,
            disk=state,
        )

    def _recovered(self) -> None:
        self.failing = None
        self.failing_since = None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Writes that land together or not at all (``BEGIN IMMEDIATE`` .. ``COMMIT``).

        On any error the transaction is rolled back and the error propagates (a disk
        error as StateDiskError), so the caller can undo its in-memory change too.
        """
        if self._db.in_transaction:  # nested: the outer transaction decides
            yield
            return
        self._write("BEGIN IMMEDIATE")
        try:
            yield
            self._write("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            raise
        if self.failing is not None:
            self._recovered()

    def require_writable(self) -> None:
        """Before a request changes anything: one small write, so a full or read-only
        state disk refuses the request while the books are still as they were.

        Raises:
            StateDiskError: the write failed (:attr:`failing` says why).
        """
        self._write(
            "INSERT OR REPLACE INTO meta(key, value) VALUES('disk_probe', ?)",
            (json.dumps(time.time()),),
        )

    def probe(self) -> bool:
        """Try one small write; True (and :attr:`failing` cleared) when the disk takes it."""
        try:
            self.require_writable()
        except StateStoreError:
            return False
        return True

    def close(self) -> None:
        if self._checkpointer is not None:
            self._stop_checkpoints.set()
            self._checkpointer.join(10)
            self._checkpointer = None
        # Fold the WAL into the database so the file is whole on its own; if that fails
        # the WAL stays and SQLite replays it on the next open.
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()

    # -- leases -----------------------------------------------------------------------------

    def save_lease(self, lease: Lease) -> None:
        self._write(
            "INSERT INTO leases(lease_id, job_id, state, created_s, updated_s, data) "
            "VALUES(?,?,?,?,?,?) ON CONFLICT(lease_id) DO UPDATE SET "
            "state=excluded.state, updated_s=excluded.updated_s, data=excluded.data",
            (
                lease.lease_id,
                lease.request.job_id,
                lease.state.value,
                lease.created_s,
                lease.updated_s,
                lease_to_json(lease),
            ),
        )

    def live_leases(self) -> list[Lease]:
        """Leases that were queued, preparing or active when the daemon last stopped."""
        rows = self._db.execute(
            "SELECT data FROM leases WHERE state IN (?,?,?) ORDER BY created_s",
            (LeaseState.QUEUED.value, LeaseState.PREPARING.value, LeaseState.ACTIVE.value),
        ).fetchall()
        out = []
        for (text,) in rows:
            try:
                out.append(lease_from_json(text))
            except (ValueError, KeyError, TypeError):
                continue  # one unreadable record must not stop the daemon; reconcile covers it
        return out

    def get_lease(self, lease_id: str) -> Lease | None:
        row = self._db.execute("SELECT data FROM leases WHERE lease_id=?", (lease_id,)).fetchone()
        return lease_from_json(row[0]) if row else None

    def leases_for_job(self, job_id: str) -> list[Lease]:
        rows = self._db.execute(
            "SELECT data FROM leases WHERE job_id=? ORDER BY created_s", (job_id,)
        ).fetchall()
        return [lease_from_json(r[0]) for r in rows]

    def job_ids_ending(self, cluster_proc: str) -> list[str]:
        """The GlobalJobIds (``schedd#cluster.proc#qdate``) of ``cluster_proc``, newest
        first: admins name jobs as ``condor_q`` shows them."""
        rows = self._db.execute(
            "SELECT job_id, MAX(created_s) AS t FROM leases WHERE job_id LIKE ? "
            "GROUP BY job_id ORDER BY t DESC",
            (f"%#{cluster_proc}#%",),
        ).fetchall()
        return [r[0] for r in rows]

    def recent_leases(self, limit: int = 100) -> list[Lease]:
        rows = self._db.execute(
            "SELECT data FROM leases ORDER BY updated_s DESC LIMIT ?", (limit,)
        ).fetchall()
        return [lease_from_json(r[0]) for r in rows]

    # -- history ----------------------------------------------------------------------------

    def record(
        self,
        event: str,
        data: dict[str, Any],
        *,
        lease_id: str | None = None,
        job_id: str | None = None,
        t: float | None = None,
    ) -> None:
        self._write(
            "INSERT INTO history(t, lease_id, job_id, event, data) VALUES(?,?,?,?,?)",
            (t if t is not None else time.time(), lease_id, job_id, event, json.dumps(data)),
        )

    def history(
        self,
        *,
        limit: int = 50,
        job_id: str | None = None,
        before_id: int | None = None,
        max_bytes: int | None = None,
    ) -> list[HistoryRow]:
        """Newest first: at most ``limit`` rows with ids below ``before_id`` (the cursor of
        the next page: the last row's id), and about ``max_bytes`` of rows as JSON (always
        at least one row), so one reply stays bounded however large the rows are."""
        where: list[str] = []
        params: list[Any] = []
        if job_id:
            where.append("job_id=?")
            params.append(job_id)
        if before_id is not None:
            where.append("id<?")
            params.append(before_id)
        clause = f"WHERE {' AND '.join(where)} " if where else ""
        cur = self._db.execute(
            "SELECT id, t, lease_id, job_id, event, data FROM history "
            f"{clause}ORDER BY id DESC LIMIT ?",
            (*params, limit),
        )
        out: list[HistoryRow] = []
        size = 0
        for r in cur:
            # The row as a reply carries it: its data, its names, and ~64 bytes of keys.
            size += len(r[5]) + len(r[4]) + len(r[3] or "") + len(r[2] or "") + 64
            if out and max_bytes is not None and size > max_bytes:
                break
            out.append(HistoryRow(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])))
        cur.close()
        return out

    def count_events(self, lease_id: str, prefix: str) -> int:
        """History rows of a lease whose event starts with ``prefix`` (e.g. ``wrapper.``)."""
        row = self._db.execute(
            "SELECT COUNT(*) FROM history WHERE lease_id=? AND event >= ? AND event < ?",
            (lease_id, prefix, prefix + "\U0010ffff"),
        ).fetchone()
        return int(row[0])

    def prune(self, keep: int, keep_bytes: int = HISTORY_KEEP_BYTES) -> int:
        """Drop the oldest history rows beyond ``keep`` rows or ``keep_bytes`` of event
        data, and ended leases older than the oldest row kept."""
        with self.transaction():
            cur = self._write(
                "DELETE FROM history WHERE id <= (SELECT MAX(id) FROM history) - ?", (keep,)
            )
            dropped = cur.rowcount
            # The newest row whose running total (newest first) passes the budget: it and
            # everything older goes.
            over = self._db.execute(
                "SELECT id FROM (SELECT id, SUM(length(data)) OVER (ORDER BY id DESC) AS total "
                "FROM history) WHERE total > ? ORDER BY id DESC LIMIT 1",
                (keep_bytes,),
            ).fetchone()
            if over is not None:
                dropped += self._write("DELETE FROM history WHERE id <= ?", (over[0],)).rowcount
            oldest = self._db.execute("SELECT MIN(t) FROM history").fetchone()[0]
            if oldest is not None:
                self._write(
                    "DELETE FROM leases WHERE state NOT IN (?,?,?) AND updated_s < ?",
                    (
                        LeaseState.QUEUED.value,
                        LeaseState.PREPARING.value,
                        LeaseState.ACTIVE.value,
                        oldest,
                    ),
                )
        return dropped

    # -- instances and meta -----------------------------------------------------------------

    def remember_instance(
        self, gpu_uuid: str, start: int, profile_id: int, mig_uuid: str | None
    ) -> None:
        self._write(
            "INSERT OR REPLACE INTO instances(gpu_uuid, start, profile_id, mig_uuid, created_s) "
            "VALUES(?,?,?,?,?)",
            (gpu_uuid, start, profile_id, mig_uuid, time.time()),
        )

    def forget_instance(self, gpu_uuid: str, start: int) -> None:
        self._write("DELETE FROM instances WHERE gpu_uuid=? AND start=?", (gpu_uuid, start))

    def own_instances(self, gpu_uuid: str) -> dict[int, tuple[int, str | None]]:
        rows = self._db.execute(
            "SELECT start, profile_id, mig_uuid FROM instances WHERE gpu_uuid=?", (gpu_uuid,)
        ).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def set_meta(self, key: str, value: Any) -> None:
        self._write(
            "INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (key, json.dumps(value))
        )
