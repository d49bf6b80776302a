"""Durable state in SQLite (WAL) under the state directory.

Tables: ``leases`` (every lease, its state and its full record as JSON),
``history`` (every decision and event, for ``migctl history``/``explain``),
``instances`` (MIG instances migd created, so a restart knows its own) and
``meta`` (schema version, GPU drain flags, demand counts).

A file that SQLite cannot read, or that fails ``PRAGMA quick_check``, is moved
aside (``migd.db.corrupt-<time>``) and a fresh one is started: nothing is lost
that the GPUs themselves cannot tell again, because start-up reconciliation
re-adopts every instance it finds and never destroys one with processes.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from migd.core.leases import LeaseState
from migd.core.scheduler import Lease, LeaseRequest
from migd.errors import StateStoreError

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


class StateStore:
    """The SQLite state database. Not thread-safe: the daemon uses it from its event loop."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.recovered_from: Path | None = None
        self.corruption: str | None = None
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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            db = self._connect()
        except (sqlite3.DatabaseError, StateStoreError) as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            for suffix in ("", "-wal", "-shm"):
                src = Path(str(self.path) + suffix)
                if src.exists():
                    src.rename(Path(str(aside) + suffix))
            self.recovered_from = aside
            self.corruption = str(exc)
            db = self._connect()
        return db

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=5000")
            check = db.execute("PRAGMA quick_check").fetchone()
            if not check or check[0] != "ok":
                raise StateStoreError(f"integrity check failed: {check}")
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
        except Exception:
            db.close()
            raise
        return db

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
        self._db.execute(
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
        self._db.execute(
            "INSERT INTO history(t, lease_id, job_id, event, data) VALUES(?,?,?,?,?)",
            (t if t is not None else time.time(), lease_id, job_id, event, json.dumps(data)),
        )

    def history(self, *, limit: int = 50, job_id: str | None = None) -> list[HistoryRow]:
        if job_id:
            rows = self._db.execute(
                "SELECT id, t, lease_id, job_id, event, data FROM history WHERE job_id=? "
                "ORDER BY id DESC LIMIT ?",
                (job_id, limit),
            ).fetchall()
        else:
            rows = self._db.execute(
                "SELECT id, t, lease_id, job_id, event, data FROM history ORDER BY id DESC LIMIT ?",
                (limit,),
            ).fetchall()
        return [HistoryRow(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]

    def prune(self, keep: int) -> int:
        """Drop the oldest history rows beyond ``keep`` and ended leases older than them."""
        cur = self._db.execute(
            "DELETE FROM history WHERE id <= (SELECT MAX(id) FROM history) - ?", (keep,)
        )
        oldest = self._db.execute("SELECT MIN(t) FROM history").fetchone()[0]
        if oldest is not None:
            self._db.execute(
                "DELETE FROM leases WHERE state NOT IN (?,?,?) AND updated_s < ?",
                (
                    LeaseState.QUEUED.value,
                    LeaseState.PREPARING.value,
                    LeaseState.ACTIVE.value,
                    oldest,
                ),
            )
        return cur.rowcount

    # -- instances and meta -----------------------------------------------------------------

    def remember_instance(
        self, gpu_uuid: str, start: int, profile_id: int, mig_uuid: str | None
    ) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO instances(gpu_uuid, start, profile_id, mig_uuid, created_s) "
            "VALUES(?,?,?,?,?)",
            (gpu_uuid, start, profile_id, mig_uuid, time.time()),
        )

    def forget_instance(self, gpu_uuid: str, start: int) -> None:
        self._db.execute("DELETE FROM instances WHERE gpu_uuid=? AND start=?", (gpu_uuid, start))

    def own_instances(self, gpu_uuid: str) -> dict[int, tuple[int, str | None]]:
        rows = self._db.execute(
            "SELECT start, profile_id, mig_uuid FROM instances WHERE gpu_uuid=?", (gpu_uuid,)
        ).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def set_meta(self, key: str, value: Any) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (key, json.dumps(value))
        )
