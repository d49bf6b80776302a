"""The SQLite state database file: its schema, opening it, and telling a bad file from a
bad disk.

A file that is not a database (``SQLITE_NOTADB``), that SQLite reports corrupt
(``SQLITE_CORRUPT``) or that fails ``PRAGMA quick_check`` is moved aside
(``migd.db.corrupt-<time>``) and a fresh one is started: nothing is lost that the
GPUs themselves cannot tell again, because start-up reconciliation re-adopts every
instance it finds and never destroys one with processes.

Every other failure is the disk's, not the file's (full, read-only, I/O error,
permissions): the file is left untouched and :class:`StateDiskError` is raised, at
start-up (the daemon exits non-zero and systemd's ``Restart=on-failure`` tries again)
and while running (the request fails with that typed error, :attr:`StateDatabase.failing`
says why, and the first write that succeeds again clears it; :meth:`StateDatabase.probe`
is that write for callers that want to find out without a request).

What is stored and how it is queried is :mod:`migd.daemon.store.state`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import structlog

from migd.errors import StateDiskError, StateStoreError

log = structlog.get_logger("migd")

#: The WAL file's bound (see :meth:`StateDatabase.checkpoint_in_background`): some six
#: seconds of commits at the daemon's saturation on a 2-core node (bench/results/wal_growth.md).
WAL_LIMIT_BYTES = 64 * 1024 * 1024
#: PASSIVE rounds the checkpointer runs back to back before the writer's restart, and
#: the frames committed during one that are few enough to leave to it.
_CATCH_UP_ROUNDS = 8
_CATCH_UP_FRAMES = 64
#: Bytes of a WAL frame besides its page (sqlite.org/fileformat.html, "WAL Frame Format").
_WAL_FRAME_HEADER = 24

# SQLite's primary result codes (sqlite3.h) that say the *file* is bad; only these (and a
# failed quick_check) justify moving the database aside. SQLITE_FULL (13), SQLITE_IOERR
# (10), SQLITE_READONLY (8), SQLITE_CANTOPEN (14) and SQLITE_PERM (3) are the disk's or the
# mount's: moving the file aside on them loses every lease for a condition that goes away.
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
_CORRUPTION_CODES = frozenset({_SQLITE_CORRUPT, _SQLITE_NOTADB})

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


class Batch:
    """What became of the writes of one :meth:`StateDatabase.batch`, known once they are
    committed: at the batch's end, or, with commits deferred
    (:meth:`StateDatabase.defer_commits`), at the commit of the group it joined.

    Attributes:
        lost: why none of the batch's writes landed (a write in it or its commit failed:
            SQLite may roll back a whole transaction on a full disk or an I/O error, so
            none is taken to have landed), or None when they all did.
        settled: whether ``lost`` is final.
    """

    lost: StateStoreError | None = None
    settled: bool = False

    def __init__(self) -> None:
        self._then: list[Callable[[StateStoreError | None], None]] = []

    def then(self, fn: Callable[[StateStoreError | None], None]) -> None:
        """Call ``fn(lost)`` once the batch is settled (at once if it is)."""
        if self.settled:
            fn(self.lost)
        else:
            self._then.append(fn)

    def _settle(self, lost: StateStoreError | None) -> None:
        if self.lost is None:
            self.lost = lost
        self.settled = True
        callbacks, self._then = self._then, []
        for fn in callbacks:
            # One failing callback must not keep the others (a reply waiting for the
            # commit, a lease's bookkeeping) from hearing of the commit.
            try:
                fn(self.lost)
            except Exception:
                log.exception("state_db.batch_callback_failed")


class StateDatabase:
    """The SQLite state database file: opening, writes, transactions and the disk's health.
    Not thread-safe: the daemon uses it from its event loop.

    Attributes:
        failing: why the last write failed on the disk (full, read-only, I/O), or None
            while writes succeed. A node-level condition for ``migctl status`` and the
            machine ad; cleared by the next write that succeeds (see :meth:`probe`).
        failing_since: wall-clock time of the first failed write of the current spell.
    """

    def __init__(self, path: Path, wal_limit_bytes: int = WAL_LIMIT_BYTES) -> None:
        self.path = path
        #: The WAL file's bound (see checkpoint_in_background); tests make it small.
        self.wal_limit_bytes = wal_limit_bytes
        self.recovered_from: Path | None = None
        self.corruption: str | None = None
        self.failing: str | None = None
        self.failing_since: float | None = None
        self._db = self._open()
        self._checkpointer: threading.Thread | None = None
        self._stop_checkpoints = threading.Event()
        # (WAL frames, frames checkpointed) from the background thread's last round.
        self.last_checkpoint: tuple[int, int] | None = None
        #: Set by the checkpointer when the WAL is over its bound and folded; the writer
        #: starts it over at its next commit (see checkpoint_in_background).
        self._wal_over_bound = False
        #: How often the writer started a WAL over its bound anew.
        self.wal_restarts = 0
        # The open batch (see batch()); the first write that fails in it is its `lost`.
        self._batch: Batch | None = None
        # Inside transaction(): its own COMMIT decides for everything written in it.
        self._in_transaction_block = False
        # Deferred commits (defer_commits): how to ask for the group's commit, and the
        # ended batches whose writes wait in the open transaction for it.
        self._defer: Callable[[Callable[[], None]], object] | None = None
        self._pending: list[Batch] = []

    def checkpoint_in_background(self, interval_s: float = 2.0) -> None:
        """Move WAL checkpoints off the caller's thread, and keep the WAL file bounded.

        SQLite checkpoints the WAL inside whichever commit crosses 1000 pages, and a
        checkpoint syncs the database file: a ~5 ms stall on the daemon's event loop every
        few hundred lease changes, the whole p99 of a lease. Here a thread with its own
        connection checkpoints every ``interval_s`` instead (PASSIVE: it never blocks a
        writer, and the sqlite3 module drops the GIL while it waits on the disk).

        A PASSIVE checkpoint never shrinks the WAL: SQLite starts the WAL over only when
        a write begins after *every* frame was checkpointed, and under unbroken load some
        commit always lands between the checkpoint's end and the next write, so the file
        grew by every commit's pages (11 MB/s at saturation, 717 MB after a minute,
        bench/results/wal_growth.md). When the WAL holds more than :attr:`wal_limit_bytes`
        after a PASSIVE that folded everything it saw, the thread asks the writer to
        start it over at its next commit (:meth:`_restart_wal_if_asked`), and
        ``journal_size_limit`` (:meth:`_prepare`) gives back the space
        above twice the bound. Before asking, the thread folds what was committed while
        its PASSIVE ran (:meth:`_catch_up`), so the restart costs the writer the database
        file's sync and little else: a 13-17 ms stall once per :attr:`wal_limit_bytes` of
        commits, about every 6 s at saturation, and never at a load with pauses, where
        the WAL starts over by itself. (A TRUNCATE checkpoint instead stalled 110-165 ms,
        most of it giving the file's blocks back; run from this thread it blocked the
        loop's writes behind SQLite's busy-handler sleeps as well.) When a whole round
        saw no commit, the thread truncates a WAL of more than a sixteenth of the bound.
        """
        if self._checkpointer is not None:
            return
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        self._stop_checkpoints.clear()
        self._checkpointer = threading.Thread(
            target=self._checkpoint_loop,
            args=(interval_s,),
            name="migd-wal",
            daemon=True,
        )
        self._checkpointer.start()

    def _checkpoint_loop(self, interval_s: float) -> None:
        """The background thread (see :meth:`checkpoint_in_background`). It must outlive
        every error: with ``wal_autocheckpoint`` off, nothing else folds the WAL, which
        would grow until the disk is full. So even its connection is made inside the
        round (a failure is tried again next round), and an error is logged once per
        spell, not swallowed: a disk that refuses checkpoints refuses writes soon."""
        db: sqlite3.Connection | None = None
        limit = self.wal_limit_bytes
        frame_bytes = 0
        before: int | None = None  # the WAL's frames at the last round that ran
        failing = ""  # the error of the current spell, logged once
        try:
            while not self._stop_checkpoints.wait(interval_s):
                try:
                    if db is None:
                        db, frame_bytes = self._checkpoint_connection()
                    ran = self._passive(db)
                    if ran is None:
                        continue  # the writer's restart was checkpointing: next round
                    frames, done = ran
                    size = frames * frame_bytes  # what is in use since the WAL started over
                    if frames == done == before and self._wal_file_bytes() > limit // 16:
                        # Nothing committed for a whole round: give the disk back (a
                        # writer that comes meanwhile waits for the file's truncation,
                        # once; a smaller WAL is left for SQLite to start over).
                        busy, _f, _d = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                        frames = frames if busy else 0
                    elif done >= frames and size > limit:
                        self._catch_up(db)
                        self._wal_over_bound = True  # (a plain flag: the writer reads it)
                    before = frames
                except sqlite3.Error as exc:
                    if str(exc) != failing:
                        log.warning(
                            "state.checkpoint_failed",
                            path=str(self.path),
                            error=str(exc),
                            reason="the state database's WAL could not be checkpointed; "
                            "it grows until this succeeds",
                            hint="check the state disk (space, read-only, I/O errors); "
                            "migd tries again every round",
                        )
                    failing = str(exc)
                    continue
                if failing:
                    log.info("state.checkpoint_recovered", path=str(self.path))
                    failing = ""
        finally:
            if db is not None:
                db.close()

    def _checkpoint_connection(self) -> tuple[sqlite3.Connection, int]:
        """The checkpointer's own connection, and the bytes of one WAL frame."""
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA busy_timeout=5000")
            return db, db.execute("PRAGMA page_size").fetchone()[0] + _WAL_FRAME_HEADER
        except sqlite3.Error:
            db.close()
            raise

    def _wal_file_bytes(self) -> int:
        """The WAL file's size on disk: after restarts it is the high-water mark of what
        was in use, which the frame count no longer says."""
        try:
            return Path(f"{self.path}-wal").stat().st_size
        except OSError:
            return 0

    def _passive(self, db: sqlite3.Connection) -> tuple[int, int] | None:
        """One PASSIVE checkpoint: (the WAL's frames, how many are folded), or None when
        it could not run because another checkpoint was running (SQLite then answers -1
        for both, which must not read as a round that saw no commit)."""
        busy, frames, done = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        if busy and frames < 0:
            return None
        self.last_checkpoint = (frames, done)
        return frames, done

    def _catch_up(self, db: sqlite3.Connection) -> None:
        """Fold what was committed while the last PASSIVE ran, until that is a few pages:
        the writer's restart then syncs the file and little else (13-17 ms a restart
        against 17-66 ms without, bench/results/wal_growth.md)."""
        frames, _done = self.last_checkpoint or (0, 0)
        for _ in range(_CATCH_UP_ROUNDS):
            ran = self._passive(db)
            if ran is None:
                return
            now, done = ran
            if done < now or now - frames < _CATCH_UP_FRAMES:
                return
            frames = now

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
        # Distributions build SQLite with SECURE_DELETE, which also zeroes and writes every
        # page a delete frees: a history prune's commit then writes the leases it drops
        # whole (one ~2.8 kB record a page). FAST still zeroes what is deleted on the
        # pages it writes anyway and leaves the freed pages as they were, inside a state
        # directory only root reads (0700): a prune step held the loop 35 % less
        # (bench/results/history_prune.md).
        db.execute("PRAGMA secure_delete=FAST")
        # The WAL file shrinks back to this when SQLite starts it over (it is reused, never
        # shrunk, otherwise: its high-water mark stayed on disk for good). Twice the bound:
        # at the restarts that bound it under load (checkpoint_in_background) the file is
        # below that, so no restart also waits for the file system to free its blocks.
        db.execute(f"PRAGMA journal_size_limit={2 * int(self.wal_limit_bytes)}")
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
        if self._pending and self._batch is None and not self._in_transaction_block:
            # A write of its own (a probe, a meta value) must not join a group of
            # batches and land (or be lost) with them: they are committed first.
            self.commit_pending()
        try:
            if self._batch is not None and not self._db.in_transaction:
                self._group_dropped()  # (not joined by a transaction of its own)
                self._db.execute("BEGIN")  # deferred: the write below takes the lock
            cur = self._db.execute(sql, params)
        except sqlite3.Error as exc:
            raise self._failed(exc) from exc
        if not self._db.in_transaction:  # committed on its own
            if self.failing is not None:
                self._recovered()
            self._restart_wal_if_asked()
        return cur

    def _write_many(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        """One write statement for each of ``rows``, inside an open transaction."""
        assert self._db.in_transaction  # (a group's commit must not land halfway)
        try:
            self._db.executemany(sql, rows)
        except sqlite3.Error as exc:
            raise self._failed(exc) from exc

    def _restart_wal_if_asked(self) -> None:
        """Start the WAL over when the checkpointer found it over its bound (see
        :meth:`checkpoint_in_background`). Called by the writer just after a commit,
        with no transaction open: what is left to fold is what was committed since the
        checkpointer's PASSIVE. It never waits for a lock: when the checkpointer is busy
        folding, the next commit tries again; when SQLite fails it, the checkpointer's
        next round decides whether to ask again."""
        if not self._wal_over_bound or self._db.in_transaction:
            return
        try:
            self._db.execute("PRAGMA busy_timeout=0")
            try:
                busy, _frames, _done = self._db.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
            finally:
                self._db.execute("PRAGMA busy_timeout=5000")
        except sqlite3.Error:
            # A refusing disk shows at the next write. Not again at every commit (each
            # try syncs on the loop): the checkpointer asks again next round if need be.
            self._wal_over_bound = False
            return
        if not busy:
            self._wal_over_bound = False
            self.wal_restarts += 1

    def _failed(self, exc: sqlite3.Error) -> StateStoreError:
        error = self._error_for(exc)
        if self._batch is not None and self._batch.lost is None:
            self._batch.lost = error
        return error

    def _error_for(self, exc: sqlite3.Error) -> StateStoreError:
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
        if self._in_transaction_block or self._batch is not None:  # nested: the outer decides
            yield
            return
        self._write("BEGIN IMMEDIATE")  # (deferred batches are committed first: _write)
        self._in_transaction_block = True
        try:
            yield
            self._write("COMMIT")
        except BaseException:
            self._roll_back()
            raise
        finally:
            self._in_transaction_block = False
        if self.failing is not None:
            self._recovered()

    @contextlib.contextmanager
    def batch(self) -> Iterator[Batch]:
        """The writes made inside land in one commit, whatever the body does: at the end,
        or with the group the batch joins when commits are deferred (:meth:`defer_commits`).

        One lease request writes its history row, the lease and the grant's history row;
        committed one by one, that was three WAL commits (issue 26 §4). Unlike
        :meth:`transaction`, the body's in-memory change stands when a write fails: each
        write still raises its own StateDiskError for its caller to handle, and the
        yielded :class:`Batch` says once it is settled whether everything was lost, so the
        caller can mark what it wrote as unwritten (:meth:`Batch.then`). Nested in a
        transaction or a batch, the outer one commits (the inner one is settled at once,
        as not lost). Make no request of the disk in it that must land before the body
        goes on (:meth:`require_writable`'s probe would only reach the open transaction).
        """
        result = Batch()
        if self._in_transaction_block or self._batch is not None:
            result._settle(None)
            yield result
            return
        # The transaction opens at the first write (_write): most outcomes a scheduling
        # pass applies write nothing, and an empty BEGIN..COMMIT is two statements.
        self._batch = result
        try:
            yield result
        finally:
            self._batch = None
            self._end_batch(result)

    def _end_batch(self, result: Batch) -> None:
        if result.lost is not None:
            # SQLite may have rolled the whole transaction back, the writes of the
            # deferred batches before this one with it: none of them is taken to have landed.
            self._roll_back()
            self._settle_pending(result.lost)
            result._settle(None)
        elif self._defer is not None and self._db.in_transaction:
            self._pending.append(result)
            if len(self._pending) == 1:
                self._defer(self.commit_pending)
        else:
            result._settle(self._commit_or_roll_back())
            self._restart_wal_if_asked()

    def defer_commits(self, schedule: Callable[[Callable[[], None]], object]) -> None:
        """Commit ended batches in groups: a batch's writes stay in the open transaction,
        and the first batch of a group asks ``schedule(commit)`` for the group's commit.

        The daemon passes its event loop's ``call_soon``: every request served in one
        turn of the loop shares one commit, one set of WAL page writes (issue 26 §4: two
        commits per lease->release cycle cost about 7 % of the daemon's CPU at
        saturation, bench/results/daemon_vs_presplit.md). A batch's :meth:`Batch.then`
        runs at that commit; the API server replies only once it is done
        (:meth:`when_committed`). A write outside a batch, :meth:`transaction` and
        :meth:`close` commit the waiting group first.
        """
        self._defer = schedule

    def commit_pending(self) -> None:
        """Commit the writes of the deferred batches now and settle them."""
        if not self._pending:
            return
        if self._batch is not None:  # not inside a batch: it joins the group at its end
            self._defer_again()
            return
        if self._group_dropped():
            return
        self._settle_pending(self._commit_or_roll_back())
        self._restart_wal_if_asked()  # after the replies: they do not wait for it

    def _group_dropped(self) -> bool:
        """Whether SQLite rolled the deferred batches' open transaction back on its own
        (a statement that failed meanwhile, a read included: an I/O error, no memory);
        if so they are settled as lost, and a later batch starts a group of its own."""
        if not self._pending or self._db.in_transaction:
            return False
        self._writes_lost()
        self._settle_pending(
            StateStoreError(
                f"SQLite rolled back the open transaction of {self.path} after a failed "
                "statement; the writes waiting for its commit are lost",
                hint="migd writes the leases again; `migctl status` shows whether the "
                "state disk is failing",
            )
        )
        return True

    def _defer_again(self) -> None:
        assert self._defer is not None  # (pending batches exist only with deferral)
        self._defer(self.commit_pending)

    def _settle_pending(self, lost: StateStoreError | None) -> None:
        pending, self._pending = self._pending, []
        for batch in pending:
            batch._settle(lost)

    def when_committed(self, fn: Callable[[], None]) -> bool:
        """Call ``fn()`` once the batches waiting for a deferred commit are settled
        (committed or lost); False, and ``fn`` not called, when none waits."""
        if not self._pending:
            return False
        self._pending[-1].then(lambda _lost: fn())
        return True

    def _commit_or_roll_back(self) -> StateStoreError | None:
        """Commit the open transaction, if any: rolled back when that fails (the error
        returned), the disk's failure cleared when it lands."""
        lost = self._commit_open()
        if lost is not None:
            self._roll_back()
        elif self.failing is not None:
            self._recovered()
        return lost

    def _commit_open(self) -> StateStoreError | None:
        """Commit the open transaction, if a write opened one; why it failed, if it did."""
        if not self._db.in_transaction:
            return None
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            return self._error_for(exc)  # sets `failing` for a disk's refusal
        return None

    def _roll_back(self) -> None:
        # SQLite may have rolled the transaction back itself (a full disk, an I/O error).
        with contextlib.suppress(sqlite3.Error):
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
        self._writes_lost()

    def _writes_lost(self) -> None:
        """Writes made since the last commit did not land (rolled back by migd or by
        SQLite): a subclass drops what it counted of them."""

    #: Free space (bytes) on the state disk above which require_writable needs no probe.
    PROBE_HEADROOM_BYTES = 16 * 1024 * 1024

    def require_writable(self) -> None:
        """Before a request changes anything: one small write, so a full or read-only
        state disk refuses the request while the books are still as they were.

        The probe would be a committed write of its own before every lease (issue 26
        §4), so it is made only when the disk might refuse: after a failed write (until
        one goes through), on a file system mounted read-only, or with less than
        :attr:`PROBE_HEADROOM_BYTES` free. Otherwise a ``statvfs`` says as much.

        Raises:
            StateDiskError: the write failed (:attr:`failing` says why).
        """
        if self.failing is None and self._roomy():
            return
        self._write(
            "INSERT OR REPLACE INTO meta(key, value) VALUES('disk_probe', ?)",
            (json.dumps(time.time()),),
        )

    def _roomy(self) -> bool:
        """The state disk is writable and has room (what the unprivileged may use)."""
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return False
        if st.f_flag & os.ST_RDONLY:
            return False
        return st.f_bavail * st.f_frsize >= self.PROBE_HEADROOM_BYTES

    def probe(self) -> bool:
        """Try one small write; True (and :attr:`failing` cleared) when the disk takes it."""
        try:
            self._write(
                "INSERT OR REPLACE INTO meta(key, value) VALUES('disk_probe', ?)",
                (json.dumps(time.time()),),
            )
        except StateStoreError:
            return False
        return True

    def close(self) -> None:
        self.commit_pending()
        if self._checkpointer is not None:
            self._stop_checkpoints.set()
            self._checkpointer.join(10)
            self._checkpointer = None
        # Fold the WAL into the database so the file is whole on its own; if that fails
        # the WAL stays and SQLite replays it on the next open.
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()
