"""Durable state in SQLite (WAL) under the state directory: what is stored and the
queries over it.

Tables: ``leases`` (every lease, its state and its full record as JSON),
``history`` (every decision and event, for ``migctl history``/``explain``),
``instances`` (MIG instances migd created, so a restart knows its own) and
``meta`` (schema version, GPU drain flags, demand counts).

Opening the file, its schema, recovery from a corrupt file and the disk's failures are
:mod:`migd.daemon.store.database`'s (:class:`StateDatabase`, which :class:`StateStore` extends).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.daemon.store.database import WAL_LIMIT_BYTES, StateDatabase

# History kept, in bytes of event data (rows are pruned by count *and* by bytes, so a few
# large reports cannot grow the database without bound).
HISTORY_KEEP_BYTES = 64 * 1024 * 1024


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


# Stands for the decision while the rest of a record is encoded; the decision's own text
# is then put in its place (see _splice).
_DECISION_MARK = "\x00decision\x00"
_DECISION_MARK_JSON = json.dumps(_DECISION_MARK)


def _splice(text: str, decision_text: str) -> str | None:
    """``text`` with its one decision mark replaced by ``decision_text``; None when the
    mark occurs more than once (client text that holds it: encode the whole instead)."""
    if text.count(_DECISION_MARK_JSON) != 1:
        return None
    return text.replace(_DECISION_MARK_JSON, decision_text)


class DecisionText:
    """The JSON text of each live lease's decision, encoded once.

    A lease's decision (the planner's explanation, a few KB of mostly floats) is written
    with the lease at every change (preparing, active, released) and in the "granted"
    history row: three or four encodings of the same dict per lease, the largest single
    JSON cost of a lease cycle (issue 26 §4). The scheduler finishes a decision while it
    places the lease (the hybrid mode's ``explain`` adds keys and rewrites ``reason``);
    afterwards nothing changes it. The cached text is still only used while the lease's
    decision is the same object with the same number of keys and the same reason, and
    the entry goes when the lease ends (so the cache holds live leases only).
    """

    MAX_ENTRIES = 4096  # a bound against a caller that never ends its leases

    def __init__(self) -> None:
        self._texts: dict[str, tuple[dict[str, Any], int, Any, str]] = {}

    def text(self, lease_id: str, decision: dict[str, Any]) -> str:
        hit = self._texts.get(lease_id)
        if (
            hit is not None
            and hit[0] is decision
            and hit[1] == len(decision)
            and hit[2] == decision.get("reason")
        ):
            return hit[3]
        text = json.dumps(decision, sort_keys=True)
        if hit is None and len(self._texts) >= self.MAX_ENTRIES:
            self._texts.pop(next(iter(self._texts)))
        self._texts[lease_id] = (decision, len(decision), decision.get("reason"), text)
        return text

    def forget(self, lease_id: str) -> None:
        self._texts.pop(lease_id, None)

    def __len__(self) -> int:
        return len(self._texts)


def lease_to_json(lease: Lease, decisions: DecisionText | None = None) -> str:
    """The lease's full record (sorted keys); with ``decisions``, its decision's text is
    taken from there (the same bytes as encoding it here)."""
    # The view plus what only the state db keeps (the request whole, the holder's start).
    data: dict[str, Any] = {**lease.to_dict()}
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
    data["heartbeat_s"] = lease.heartbeat_s
    decision = lease.decision
    if decisions is None or not isinstance(decision, dict):
        data["decision"] = decision
        return json.dumps(data, sort_keys=True)
    data["decision"] = _DECISION_MARK
    spliced = _splice(json.dumps(data, sort_keys=True), decisions.text(lease.lease_id, decision))
    if spliced is None:
        data["decision"] = decision
        return json.dumps(data, sort_keys=True)
    return spliced


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
        end_reason=data.get("end_reason"),
    )


class StateStore(StateDatabase):
    """The state database's leases, history, own MIG instances and meta values."""

    def __init__(self, path: Path, wal_limit_bytes: int = WAL_LIMIT_BYTES) -> None:
        super().__init__(path, wal_limit_bytes)
        self.decisions = DecisionText()
        # Bytes of event data in history, counted as rows are added, so that the hourly
        # prune learns whether the table is over its byte budget without a scan: the
        # running SUM over every row it used held the event loop ~190 ms at 100,000 rows.
        # None until the first prune counts them; an over-count (an insert rolled back)
        # costs only an exact count at the next prune, never a row.
        self._history_bytes: int | None = None
        # History rows, counted as they are added (history_overdue): from the id span
        # (ids are never reused, and only the oldest rows are deleted), two index reads.
        self._history_rows = self._history_span()

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
                lease_to_json(lease, self.decisions),
            ),
        )
        if lease.state.terminal:
            self.decisions.forget(lease.lease_id)

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
        text = self._event_json(data, lease_id)
        self._write(
            "INSERT INTO history(t, lease_id, job_id, event, data) VALUES(?,?,?,?,?)",
            (t if t is not None else time.time(), lease_id, job_id, event, text),
        )
        if self._history_bytes is not None:
            self._history_bytes += len(text)  # SQLite's length(): characters, as len()
        self._history_rows += 1

    def _event_json(self, data: dict[str, Any], lease_id: str | None) -> str:
        """``data`` as JSON; a lease's decision in it (the "granted" row) as the lease's
        cached text (:class:`DecisionText`: the same dict, its keys sorted)."""
        decision = data.get("decision")
        if lease_id is None or not isinstance(decision, dict):
            return json.dumps(data)
        text = json.dumps({**data, "decision": _DECISION_MARK})
        spliced = _splice(text, self.decisions.text(lease_id, decision))
        return json.dumps(data) if spliced is None else spliced

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
        data, and ended leases older than the oldest row kept.

        Costs the rows it drops, not the table: the bytes of the rows beyond ``keep`` are
        summed over their id range, the table's total comes from the running count
        (:attr:`_history_bytes`), and only a table over its byte budget by that count is
        summed whole (to correct an over-count) and, if it truly is over, walked newest
        first to find where the budget ends."""
        with self.transaction():
            cut = self._db.execute("SELECT MAX(id) FROM history").fetchone()[0]
            cut = -1 if cut is None else cut - keep
            (going,) = self._db.execute(
                "SELECT COALESCE(SUM(length(data)), 0) FROM history WHERE id <= ?", (cut,)
            ).fetchone()
            dropped = self._write("DELETE FROM history WHERE id <= ?", (cut,)).rowcount
            if self._history_bytes is None or self._history_bytes - going > keep_bytes:
                # The first prune counts the bytes once; a count over the budget is
                # checked by an exact one (it may over-count, never under-count).
                total = self._history_total()
            else:
                total = self._history_bytes - going
            if total > keep_bytes:
                # The newest row whose running total (newest first) passes the budget: it
                # and everything older goes.
                over = self._db.execute(
                    "SELECT id FROM (SELECT id, SUM(length(data)) OVER (ORDER BY id DESC) "
                    "AS total FROM history) WHERE total > ? ORDER BY id DESC LIMIT 1",
                    (keep_bytes,),
                ).fetchone()
                if over is not None:
                    dropped += self._write("DELETE FROM history WHERE id <= ?", (over[0],)).rowcount
                total = self._history_total()
            # The oldest row kept is the one with the smallest id (the primary key): no
            # scan of the unindexed t column.
            oldest = self._db.execute("SELECT t FROM history ORDER BY id LIMIT 1").fetchone()
            if oldest is not None:
                self._write(
                    "DELETE FROM leases WHERE state NOT IN (?,?,?) AND updated_s < ?",
                    (
                        LeaseState.QUEUED.value,
                        LeaseState.PREPARING.value,
                        LeaseState.ACTIVE.value,
                        oldest[0],
                    ),
                )
        self._history_bytes = total  # only once the prune is committed
        self._history_rows = self._history_span()
        return dropped

    def _history_span(self) -> int:
        """History rows at most: the span of their ids (an upper bound: a gap, if any,
        only brings a prune forward)."""
        row = self._db.execute("SELECT MAX(id) - MIN(id) + 1 FROM history").fetchone()
        return int(row[0] or 0)

    def history_overdue(self, keep: int, keep_bytes: int) -> bool:
        """Whether history holds half again its budget of rows, or of bytes by the running
        count (known from the first prune on, which the daemon runs 10 s after it starts):
        a prune not to leave to the hourly one. At saturation the database file grew
        2.6 MB/s (155 MiB in a minute, bench/results/wal_growth.md): history rows, and the
        ended leases only a history prune removes; pruned hourly, that is gigabytes. Costs
        no query."""
        if self._history_rows > keep * 3 // 2:
            return True
        return self._history_bytes is not None and self._history_bytes > keep_bytes * 3 // 2

    def _history_total(self) -> int:
        """The bytes of event data in history, summed over every row."""
        return int(
            self._db.execute("SELECT COALESCE(SUM(length(data)), 0) FROM history").fetchone()[0]
        )

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
