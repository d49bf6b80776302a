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
# The states of a lease not yet ended (its record is never pruned).
_LIVE = (LeaseState.QUEUED.value, LeaseState.PREPARING.value, LeaseState.ACTIVE.value)


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
        # Bytes of event data in history, counted as rows are added, so that a prune
        # learns whether the table is over its byte budget without a scan: the running
        # SUM over every row it used held the event loop ~190 ms at 100,000 rows. Exact
        # or None: None until the first prune counts them, and again after writes are
        # lost (_writes_lost; the next prune counts again), so a prune by bytes never
        # drops a row on an over-count.
        self._history_bytes: int | None = None
        # A count of those bytes in bounded steps (count_history_step): (the last id
        # counted, the bytes up to it, the last id when the count began). None: none
        # under way.
        self._counting: tuple[int, int, int] | None = None
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
            _LIVE,
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

    def prune(
        self,
        keep: int,
        keep_bytes: int = HISTORY_KEEP_BYTES,
        *,
        max_rows: int | None = None,
    ) -> int:
        """Drop the oldest history rows beyond ``keep`` rows or ``keep_bytes`` of event
        data, at most ``max_rows`` of them (None: every one due), and the ended leases
        they name that are older than the oldest row kept; the number of rows dropped.
        With ``max_rows``, :meth:`history_due` says whether rows are left to drop.

        Costs the rows it drops, not the table: the rows beyond ``keep`` are summed over
        their id range, the table's bytes come from the running count
        (:attr:`_history_bytes`), and rows over the byte budget are walked oldest first
        until what is left fits. With the count unknown (the first prune of the store's
        life, and the first after lost writes) it sums the table, unless
        :meth:`count_history_step` has counted it first, as the daemon does.

        Ended leases go by the ids of the rows dropped, each a primary-key delete. A
        lease whose rows all went while it was still live is left to
        :meth:`sweep_ended_leases_step`, which the daemon runs once an hour.
        """
        with self.transaction():
            total = self._history_total() if self._history_bytes is None else self._history_bytes
            ids = self._ids()
            going = dropped = 0
            if ids is not None:
                first, last = ids
                # Rows go oldest first, ids first..stop: those beyond ``keep`` rows, then
                # as many more as the bytes over budget need, at most ``max_rows``.
                bound = last if max_rows is None else first + max_rows - 1
                stop = max(first - 1, min(last - keep, bound))
                going = self._bytes_between(first - 1, stop)
                if stop < bound and total - going > keep_bytes:
                    stop, going = self._byte_cut(stop, bound, total - keep_bytes, going)
                if stop >= first:
                    # The oldest row kept: the ended leases of the rows that go and older
                    # than it go too (read before their rows go; none when no row stays).
                    oldest = self._db.execute(
                        "SELECT t FROM history WHERE id > ? ORDER BY id LIMIT 1", (stop,)
                    ).fetchone()
                    if oldest is not None:
                        self._drop_ended_leases(stop, oldest[0])
                    dropped = self._write("DELETE FROM history WHERE id <= ?", (stop,)).rowcount
        self._history_bytes = total - going  # only once the prune is committed
        self._history_rows = self._history_span()
        return dropped

    def count_history_step(self, max_rows: int) -> bool:
        """One bounded step of counting the history's bytes: whether they are known now
        (at once when they are). A prune with the count unknown sums the whole table in
        one statement, which held the event loop 39-67 ms at 100,000 rows
        (bench/results/history_prune.md); the daemon counts first, in steps of
        ``max_rows`` rows by id, and prunes once the count is known.

        Rows added between two steps have ids past the last one when the count began;
        the last step sums them too. Lost writes start the count over
        (:meth:`_writes_lost`); a prune meanwhile ends it (it counts the bytes itself)."""
        if self._history_bytes is not None:
            return True
        if self._counting is None:
            ids = self._ids()
            if ids is None:
                self._history_bytes = 0
                return True
            self._counting = (ids[0] - 1, 0, ids[1])
        done, counted, last = self._counting
        stop = min(last, done + max_rows)
        counted += self._bytes_between(done, stop)
        if stop < last:
            self._counting = (stop, counted, last)
            return False
        self._history_bytes = counted + self._bytes_between(last, None)
        self._counting = None
        return True

    def _bytes_between(self, after: int, upto: int | None) -> int:
        """Bytes of event data in the history rows with ids after ``after``, up to
        ``upto`` (None: the newest): a range of the primary key."""
        sql = "SELECT COALESCE(SUM(length(data)), 0) FROM history WHERE id > ?"
        args: tuple[int, ...] = (after,)
        if upto is not None:
            sql, args = sql + " AND id <= ?", (after, upto)
        return int(self._db.execute(sql, args).fetchone()[0])

    def sweep_ended_leases_step(self, after: int, max_rows: int) -> int | None:
        """One bounded step of the sweep of the leases table: of the ``max_rows`` leases
        after rowid ``after`` (0: the first step), those that ended before the oldest
        history row (a lease whose rows all went while it was live, which no keyed
        delete of :meth:`prune` names). The rowid to go on after; None once the table is
        done, or when no history row is left (then nothing is swept: with no row, no
        lease is known to be older than what history keeps).

        The sweep in one statement scans the table, ~70 ms at 50,000 leases
        (bench/results/history_prune.md), once an hour; a step reads its ``max_rows``
        rows by rowid. A lease updated or added between two steps is judged by the same
        rule, and is newer than the oldest row: it stays."""
        with self.transaction():
            oldest = self._db.execute(
                "SELECT t FROM history WHERE id = (SELECT MIN(id) FROM history)"
            ).fetchone()
            if oldest is None:
                return None
            # One read of the step's leases says which go (a second, a DELETE over their
            # rowid range, doubled the step's time: a lease fills a page).
            rows = self._db.execute(
                "SELECT rowid, state NOT IN (?,?,?) AND updated_s < ? FROM leases "
                "WHERE rowid > ? ORDER BY rowid LIMIT ?",
                (*_LIVE, oldest[0], after, max_rows),
            ).fetchall()
            if not rows:
                return None
            gone = [(rowid,) for rowid, ended in rows if ended]
            if gone:
                self._write_many("DELETE FROM leases WHERE rowid = ?", gone)
        return int(rows[-1][0])

    def _byte_cut(self, after: int, bound: int, excess: int, going: int) -> tuple[int, int]:
        """Past the row budget's cut ``after``, the oldest rows up to id ``bound`` whose
        bytes cover ``excess`` (bytes over budget; ``going`` of them are already cut):
        the new cut and the bytes it drops."""
        stop = after
        cur = self._db.execute(
            "SELECT id, length(data) FROM history WHERE id > ? AND id <= ? ORDER BY id",
            (after, bound),
        )
        for row_id, size in cur:
            stop, going = row_id, going + size
            if going >= excess:
                break
        cur.close()
        return stop, going

    def _drop_ended_leases(self, stop: int, oldest_t: float) -> None:
        """The ended leases with history rows up to id ``stop`` that are older than
        ``oldest_t``, the first row kept."""
        ids = [
            (lease_id, *_LIVE, oldest_t)
            for (lease_id,) in self._db.execute(
                "SELECT DISTINCT lease_id FROM history WHERE id <= ? AND lease_id IS NOT NULL",
                (stop,),
            )
        ]
        if ids:
            self._write_many(
                "DELETE FROM leases WHERE lease_id=? AND state NOT IN (?,?,?) AND updated_s < ?",
                ids,
            )

    def _ids(self) -> tuple[int, int] | None:
        """The smallest and largest history id (None: no rows): two index reads. (One
        statement asking for both, ``SELECT MIN(id), MAX(id)``, is not what SQLite's
        min/max optimisation serves: it scans the table, 12 ms at 100,000 rows.)"""
        first, last = self._db.execute(
            "SELECT (SELECT MIN(id) FROM history), (SELECT MAX(id) FROM history)"
        ).fetchone()
        return None if last is None else (int(first), int(last))

    def _history_span(self) -> int:
        """History rows at most: the span of their ids (an upper bound: a gap, if any,
        only brings a prune forward)."""
        ids = self._ids()
        return 0 if ids is None else ids[1] - ids[0] + 1

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

    def history_due(self, keep: int, keep_bytes: int) -> bool:
        """Whether history holds more than ``keep`` rows or, by the running count, more
        than ``keep_bytes``: what a prune bounded by ``max_rows`` may have left. Costs no
        query."""
        if self._history_rows > keep:
            return True
        return self._history_bytes is not None and self._history_bytes > keep_bytes

    def _writes_lost(self) -> None:
        # Rows counted may not have landed: the next prune counts the bytes again.
        self._history_bytes = None
        self._counting = None

    def _history_total(self) -> int:
        """The bytes of event data in history, summed over every row (ids start at 1)."""
        return self._bytes_between(0, None)

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
