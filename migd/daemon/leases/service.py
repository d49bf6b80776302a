"""The lease service: what happens around the scheduler's lease decisions.

Every scheduler mutation returns an :class:`~migd.core.scheduler.Outcome`; the daemon
hands each one to :meth:`LeaseService.apply`, the one place where lease side effects
happen: its transitions go to the lease observers, changed leases to the state db, its
work to the GPU executor, and clients waiting for a grant get their answer. The
per-lease side tables are pruned in one place, :meth:`LeaseService.prune`.

Lease observers (tardis' ``Drone.set_state`` notifying plugins is the model) see every
lease state change, net per outcome, in order::

    class LeaseObserver(Protocol):
        def on_transition(
            self, lease: Lease, old: LeaseState | None, new: LeaseState, now: float
        ) -> None: ...

``old`` is ``None`` for a lease new to the scheduler (a submission). Register one with
``daemon.leases.add_observer(observer)`` before ``Daemon.start()``. Observers run on
the event loop and must not block (no I/O that can hang); an exception in one is logged
and does not stop the others. :class:`TransitionLog` (the log line and the ``granted``
history record of every transition) is the built-in one.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from migd.core.gpus import Work
from migd.core.lease_end import LeaseEnded, LeaseEndReason
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.scheduler import Outcome, Transition
from migd.daemon.context import DaemonContext
from migd.daemon.store.database import Batch
from migd.errors import (
    GpuError,
    LeaseNotFound,
    LeaseTimeout,
    MigdError,
    StateDiskError,
    StateStoreError,
)

log = structlog.get_logger("migd")


def _ended(lease: Lease) -> LeaseEnded:
    """A release reply: the lease's state and ``end_reason``, and for wrappers older than
    it, ``gpu_lost`` (the lease's warning) when its GPU work was lost."""
    out: LeaseEnded = {
        "state": lease.state.value,
        "end_reason": lease.end_reason.value if lease.end_reason else None,
    }
    if lease.end_reason is LeaseEndReason.GPU_LOST:
        out["gpu_lost"] = lease.warning  # such a wrapper has HTCondor run the job again
    if lease.reason:
        out["reason"] = lease.reason
    return out


class LeaseObserver(Protocol):
    """Sees every lease state change (see the module docstring)."""

    def on_transition(
        self, lease: Lease, old: LeaseState | None, new: LeaseState, now: float
    ) -> None: ...


class EventObserver(Protocol):
    """Told of what is not a lease transition: refused requests (they never become
    leases) and history records (wrapper reports, admin ops). The metrics and the GPU
    health monitor are ones."""

    def lease_refused(self, error: MigdError) -> None: ...

    def recorded(self, event: str, lease: Lease | None, data: Mapping[str, Any]) -> None: ...


@dataclass
class Waiter:
    future: asyncio.Future[Lease]
    lease_id: str


class TransitionLog:
    """Every lease decision in the log, with its explanation, and each grant in the
    history (with the NVML time its partition took)."""

    def __init__(self, ctx: DaemonContext, service: LeaseService) -> None:
        self.ctx = ctx
        self.service = service

    def on_transition(
        self, lease: Lease, old: LeaseState | None, new: LeaseState, now: float
    ) -> None:
        sched = self.ctx.sched
        ids = {"lease_id": lease.lease_id, "job_id": lease.request.job_id}
        decision = lease.decision or {}
        if new is LeaseState.QUEUED:
            log.info(
                "lease.queued",
                **ids,
                memory_mib=lease.request.memory_mib,
                mode=lease.request.mode,
                position=sched.queue.position(lease.lease_id, self.ctx.clock.monotonic()),
                waiting=len(sched.queue),
                reason=f"no partition for {lease.request.memory_mib} MiB can be had now, "
                "or requests ahead of it go first",
            )
        elif new is LeaseState.PREPARING:
            log.info(
                "lease.preparing",
                **ids,
                gpu=lease.gpu,
                action=decision.get("action"),
                reason=decision.get("reason"),
            )
        elif new is LeaseState.ACTIVE:
            seconds = self.service.work_seconds.pop(lease.lease_id, None)
            self.service.record(
                "granted",
                lease,
                gpu=lease.gpu,
                mode=lease.mode,
                profile=lease.profile,
                start=lease.start,
                mig_uuid=lease.mig_uuid,
                seconds=seconds,
                decision=lease.decision,
            )
            log.info(
                "lease.granted",
                **ids,
                gpu=lease.gpu,
                mode=lease.mode,
                profile=lease.profile,
                start=lease.start,
                memory_limit_mib=lease.memory_limit_mib,
                reason=decision.get("reason"),
            )
        elif new.terminal:
            level = log.warning if new in (LeaseState.RECLAIMED, LeaseState.FAILED) else log.info
            level(f"lease.{new.value}", **ids, reason=lease.reason)


class LeaseService:
    """Lease side effects, waiting clients and side tables (see the module docstring).

    Args:
        ctx: the daemon's shared state.
        dispatch: hands work items to the GPU executor.
        release_share: called with (GPU index, MPS device, lease id) when a lease holding an
            MPS share is released, so the share's pinned limit is lowered.
    """

    def __init__(
        self,
        ctx: DaemonContext,
        dispatch: Callable[[list[Work]], None],
        release_share: Callable[[int, str, str], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.dispatch = dispatch
        self.release_share = release_share
        self.observers: list[LeaseObserver] = [TransitionLog(ctx, self)]
        self.event_observers: list[EventObserver] = []
        self.waiters: dict[str, Waiter] = {}
        self._saved: dict[str, int] = {}  # lease id -> version last written
        # Leases the state disk refused (written again by the next apply or flush), and
        # ended leases kept in memory until written and answered (see _forget_if_done).
        self._unsaved: dict[str, Lease] = {}
        self._ended: dict[str, Lease] = {}
        self._disk_logged = False  # the current state disk failure is logged
        self.work_seconds: dict[str, float] = {}  # lease id -> NVML time of its partition
        # Highest GPU memory seen for each active lease (its instance, its whole GPU, or
        # its MPS holder's processes), so the wrapper's OOM verdict has a peak even for
        # jobs shorter than its own sampling; see the periodic sampler.
        self.peaks: dict[str, int] = {}
        # Queued requests whose client hung up, released in batches by one task that
        # yields between them (see _drain_hangups).
        self._hangups: deque[tuple[Lease, str]] = deque()
        self._draining: asyncio.Task[None] | None = None
        # While one commit() is open: the leases it wrote and the ended ones it would
        # forget, both settled when it commits (see commit()).
        self._batch: list[Lease] | None = None
        # Lease id -> writes of it in commits not yet settled (deferred to the end of the
        # loop's turn): such a lease is not forgotten, whatever `_saved` says, until its
        # commit has landed (a lost one makes it unsaved again).
        self._landing: dict[str, int] = {}
        self._batch_forget: list[str] = []
        # Lease ids need to be unique, not secret (the owner check is by uid): a PRNG seeded
        # once from os.urandom, not a getrandom(2) call per lease, each of which let a GPU
        # thread take the GIL from the loop (issue 26 §4).
        self._ids = random.Random()

    def add_observer(self, observer: LeaseObserver) -> None:
        self.observers.append(observer)

    # -- a new request ----------------------------------------------------------------------

    def enter(self, request: LeaseRequest, uid: int, holder: int) -> Lease:
        """Give ``request`` (of ``uid``, held by process ``holder``) to the scheduler and
        act on the outcome: the new lease, granted, preparing or queued (the first half of
        :meth:`migd.daemon.leases.submit.LeaseSubmitter.submit`, which waits for it).

        Raises:
            MigdError: the request is refused (it never fits, a bad profile, a state
                disk that refuses writes), counted as such.
        """
        return self._enter([request], uid, holder)[0]

    def enter_group(self, requests: list[LeaseRequest], uid: int, holder: int) -> list[Lease]:
        """As :meth:`enter` for a job on several GPUs: one lease per request, placed all
        or none (:meth:`migd.core.scheduler.NodeScheduler.submit_group`)."""
        return self._enter(requests, uid, holder)

    def _enter(self, requests: list[LeaseRequest], uid: int, holder: int) -> list[Lease]:
        ctx = self.ctx
        now, mono = ctx.now()
        leases = [
            Lease(
                lease_id=f"{int(now)}-{self._ids.getrandbits(32):08x}",
                request=request,
                owner_uid=uid,
                owner_pid=holder,
                owner_start_s=ctx.procs.start_time(holder),
                created_s=now,
            )
            for request in requests
        ]
        # A state disk that refuses writes refuses the request here, before the books
        # change (a grant migd cannot record would be lost by the next restart).
        ctx.db.require_writable()
        with self.commit():
            return self._submit(leases, uid, now, mono)

    def _submit(self, leases: list[Lease], uid: int, now: float, mono: float) -> list[Lease]:
        ctx = self.ctx
        try:
            if len(leases) == 1:
                outcome = ctx.sched.submit(leases[0], now, mono)
            else:
                outcome = ctx.sched.submit_group(leases, now, mono)
        except MigdError as refusal:  # never fits, bad profile, ...: counted, then raised
            self.refused(refusal)
            raise
        if outcome.refusal is not None:
            self.refused(outcome.refusal)
            # Refused, but the same pass may have placed requests queued before it.
            self.apply(outcome)
            raise outcome.refusal
        # A group's members name each other in the history (migctl history/explain).
        group = {"group": [m.lease_id for m in leases]} if len(leases) > 1 else {}
        for lease in leases:
            self.record(
                "submitted",
                lease,
                memory_mib=lease.request.memory_mib,
                mode=lease.request.mode,
                uid=uid,
                state=lease.state.value,
                queued_position=outcome.queued_position,
                **group,
            )
        self.apply(outcome)
        return leases

    # -- the one place outcomes are acted on ------------------------------------------------

    def apply(self, outcome: Outcome) -> None:
        """Observe the outcome's transitions, persist leases that changed, run its work,
        answer waiting clients, prune; the writes in one commit (:meth:`commit`).

        Only what the outcome touched (and leases the state disk refused before) is
        visited: the cost follows the outcome, not the number of leases and waiters."""
        with self.commit():
            self._apply(outcome)

    def _apply(self, outcome: Outcome) -> None:
        self.notify(outcome.transitions)
        touched = outcome.touched
        for lease in [*self._unsaved.values(), *touched]:
            if self._saved.get(lease.lease_id) != lease.version:
                self.save(lease)
        self.dispatch(outcome.work)
        for lease in touched:
            waiter = self.waiters.get(lease.lease_id)
            if waiter is not None:
                self._resolve(waiter, lease)
        for lease in touched:
            if lease.state.terminal:
                self._ended[lease.lease_id] = lease
                self._forget_if_done(lease.lease_id)

    def notify(self, transitions: Iterable[Transition]) -> None:
        now = self.ctx.clock.now()
        for t in transitions:
            for observer in self.observers:
                try:
                    observer.on_transition(t.lease, t.old, t.new, now)
                except Exception as exc:  # one observer's bug must not stop the daemon
                    log.exception("lease.observer_failed", observer=repr(observer), error=str(exc))

    def _save_changed(self) -> None:
        for lease in list(self.ctx.sched.leases.values()):
            if self._saved.get(lease.lease_id) != lease.version:
                self.save(lease)

    def save(self, lease: Lease) -> None:
        """Persist ``lease``. A write the state disk refuses does not stop the change in
        memory (the scheduler's books and the NVML work stay consistent with each other);
        the lease stays unsaved and is written again by the next :meth:`apply` or
        :meth:`flush` once the disk takes writes. Requests that would *start* a change
        are refused before it instead (``StateStore.require_writable``)."""
        try:
            self.ctx.db.save_lease(lease)
        except StateDiskError as exc:
            self._disk_failed(exc)
            if lease.lease_id in self.ctx.sched.leases:
                self._unsaved[lease.lease_id] = lease
        else:
            self._saved[lease.lease_id] = lease.version
            if self._batch is not None:
                self._batch.append(lease)
                self._landing[lease.lease_id] = self._landing.get(lease.lease_id, 0) + 1
            if self._unsaved.pop(lease.lease_id, None) is not None:
                self._forget_if_done(lease.lease_id)

    @contextlib.contextmanager
    def commit(self) -> Iterator[None]:
        """The lease and history writes made inside in one SQLite commit
        (:meth:`migd.daemon.store.database.StateDatabase.batch`): a lease→release cycle
        commits twice, not five times, and in the daemon the requests of one turn of the
        event loop share a commit (``defer_commits``; issue 26 §4). Ended leases are
        forgotten only once their last state has landed; when the commit fails, every
        lease written in it is unsaved again and written by the next :meth:`apply` or
        :meth:`flush` (the history rows are lost; the log has them). Must not span an
        ``await``: another request's writes would join it. Nested: the outer one commits."""
        if self._batch is not None:
            yield
            return
        self._batch, self._batch_forget = [], []
        batch: Batch | None = None
        try:
            with self.ctx.db.batch() as batch:
                yield
        finally:
            written, forget = self._batch, self._batch_forget
            self._batch, self._batch_forget = None, []
            if batch is None:
                self._landed(written, forget, None)
            else:
                batch.then(lambda lost: self._landed(written, forget, lost))

    def _landed(
        self, written: list[Lease], forget: list[str], lost: StateStoreError | None
    ) -> None:
        """A :meth:`commit`'s writes are settled: ``lost`` says why none landed, if so."""
        for lease in written:
            left = self._landing[lease.lease_id] - 1
            if left:
                self._landing[lease.lease_id] = left
            else:
                del self._landing[lease.lease_id]
        if lost is not None:
            if isinstance(lost, StateDiskError):
                self._disk_failed(lost)
            for lease in written:
                if self._saved.get(lease.lease_id) == lease.version:
                    del self._saved[lease.lease_id]
                if lease.lease_id in self.ctx.sched.leases:
                    self._unsaved[lease.lease_id] = lease
        # (each lease written: one that ended may have been asked to go meanwhile)
        for lease_id in [*forget, *(lease.lease_id for lease in written)]:
            self._forget_if_done(lease_id)

    def restored(self, lease: Lease) -> None:
        """A lease reloaded from the store as it was there: nothing to write."""
        self._saved[lease.lease_id] = lease.version

    def record(self, event: str, lease: Lease | None = None, /, **data: Any) -> None:
        # Positional-only: a client's report may use any key, "event" and "lease" too.
        try:
            self.ctx.db.record(
                event,
                data,
                lease_id=lease.lease_id if lease else None,
                job_id=lease.request.job_id if lease else data.get("job_id"),
                t=self.ctx.clock.now(),
            )
        except StateDiskError as exc:
            # The history misses this event; the log (journal) still has it.
            self._disk_failed(exc)
        for observer in self.event_observers:
            observer.recorded(event, lease, data)

    def refused(self, error: MigdError) -> None:
        """A lease request was refused at once (it never became a lease)."""
        for observer in self.event_observers:
            observer.lease_refused(error)

    def _disk_failed(self, exc: StateDiskError) -> None:
        if not self._disk_logged:
            self._disk_logged = True
            log.error("state_disk.failing", message=exc.message, hint=exc.hint)

    def flush(self) -> bool:
        """While the state disk was failing: try it again, and once it takes writes,
        write every lease changed meanwhile. True when nothing is left unsaved."""
        db = self.ctx.db
        if db.failing is None and not self._disk_logged:
            return True
        if not db.probe():
            return False
        log.info("state_disk.recovered")
        self._disk_logged = False
        self._save_changed()
        self.prune()
        return db.failing is None

    def lease_for(self, lease_id: str) -> Lease:
        lease = self.ctx.sched.leases.get(lease_id) or self.ctx.db.get_lease(lease_id)
        if lease is None:
            raise LeaseNotFound(f"no lease {lease_id}")
        return lease

    def prune(self, *, all_terminal: bool = False) -> None:
        """Forget ended leases, and every side table's entries of leases no longer known.

        Ended leases live on in the state db; keeping them in memory would make every
        change cost O(all leases ever), so they go once persisted and answered (a client
        still waiting for one keeps it until it is answered, unless ``all_terminal``).
        """
        sched = self.ctx.sched
        for lease_id, lease in list(sched.leases.items()):
            # An ended lease the state disk has not taken yet stays until it is written.
            unsaved = self._saved.get(lease_id) != lease.version or lease_id in self._landing
            if (
                lease.state.terminal
                and not unsaved
                and (all_terminal or lease_id not in self.waiters)
            ):
                sched.forget(lease_id)
        for book in (self._saved, self.work_seconds, self.peaks, self._unsaved, self._ended):
            for lease_id in [k for k in book if k not in sched.leases]:
                del book[lease_id]

    def _forget_if_done(self, lease_id: str) -> None:
        """:meth:`prune` for one lease: forget it once it has ended, is written and no
        client waits for it (its waiter's end calls this again)."""
        if self._batch is not None:  # once the commit() has landed (or not)
            self._batch_forget.append(lease_id)
            return
        if lease_id in self._landing:  # its commit's landing asks again
            return
        lease = self._ended.get(lease_id)
        if lease is None:
            return
        if self.ctx.sched.leases.get(lease_id) is not lease:
            del self._ended[lease_id]
            return
        if self._saved.get(lease_id) != lease.version or lease_id in self.waiters:
            return
        del self._ended[lease_id]
        self.ctx.sched.forget(lease_id)
        for book in (self._saved, self.work_seconds, self.peaks):
            book.pop(lease_id, None)

    def note_peak(self, lease_id: str, used_mib: int | None) -> None:
        lease = self.ctx.sched.leases.get(lease_id)
        if used_mib is None or lease is None or lease.state is not LeaseState.ACTIVE:
            return
        if used_mib > self.peaks.get(lease_id, -1):
            self.peaks[lease_id] = used_mib

    # -- release ----------------------------------------------------------------------------

    def release(
        self,
        lease: Lease,
        reason: str,
        *,
        reclaim: bool = False,
        end: LeaseEndReason | None = None,
    ) -> LeaseEnded:
        """End ``lease``; ``end`` says why (default: ``released``, or ``holder_gone`` for
        a reclaim). The reply's ``end_reason`` is the lease's: a reason set earlier
        (``gpu_lost`` while it was active) stays."""
        sched = self.ctx.sched
        if lease.lease_id not in sched.leases or lease.state.terminal:
            ended = _ended(lease)
            ended["already"] = True
            return ended
        now, mono = self.ctx.now()
        mps_device = lease.mps_device_uuid if lease.state.holds_resources else None
        outcome = sched.release(lease.lease_id, now, mono, reclaim=reclaim, reason=reason, end=end)
        if mps_device and self.release_share is not None and lease.gpu is not None:
            # Lowers the daemon's pinned limits; the daemon stops after mps.idle_stop_s.
            self.release_share(lease.gpu, mps_device, lease.lease_id)
        peak = self.peaks.get(lease.lease_id)
        with self.commit():
            self.record(
                "reclaimed" if reclaim else "released",
                lease,
                reason=reason,
                peak_used_mib=peak,
                end_reason=lease.end_reason.value if lease.end_reason else None,
            )
            self.apply(outcome)
        ended = _ended(lease)
        ended["peak_used_mib"] = peak
        return ended

    # -- clients waiting for a grant --------------------------------------------------------

    async def wait_active(self, lease: Lease, reader: asyncio.StreamReader, wait_s: float) -> Lease:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Lease] = loop.create_future()
        self.waiters[lease.lease_id] = Waiter(future, lease.lease_id)
        hangup: asyncio.Future[Any] = asyncio.ensure_future(reader.read(1))  # EOF: client gone
        try:
            done, _ = await asyncio.wait(
                [future, hangup],
                timeout=wait_s + self.ctx.config.daemon.work_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if future in done:
                return future.result()
            reason = "client disconnected while waiting" if hangup in done else "wait timed out"
            if lease.state is LeaseState.QUEUED:
                # Thousands may hang up at once (a schedd restarts): out of the queue now,
                # released (written, logged, recorded) in batches that let the loop serve
                # pings and the watchdog between them.
                self.ctx.sched.withdraw(lease.lease_id)
                self._hangups.append((lease, reason))
                if self._draining is None or self._draining.done():
                    self._draining = asyncio.create_task(self._drain_hangups(), name="hangups")
            elif not lease.state.terminal:
                self._cancel(lease, reason)
            raise LeaseTimeout(f"lease {lease.lease_id} not granted: {reason}")
        finally:
            self.waiters.pop(lease.lease_id, None)
            # Nobody awaits these any more. The cancel above ends the lease, which fails
            # the waiter's future; a reset connection fails the read: retrieve what they
            # hold (or cancel them), or asyncio logs "Future exception was never
            # retrieved" at error level for every client that hung up.
            for pending in (future, hangup):
                if not pending.done():
                    pending.cancel()
                elif not pending.cancelled():
                    pending.exception()
            self._forget_if_done(lease.lease_id)

    def _cancel(self, lease: Lease, reason: str) -> None:
        now, mono = self.ctx.now()
        self.apply(self.ctx.sched.release(lease.lease_id, now, mono, reason=reason))
        self.record("cancelled", lease, reason=reason)

    #: Hung-up requests released per turn of the event loop.
    HANGUP_BATCH = 32

    async def _drain_hangups(self) -> None:
        while self._hangups:
            for _ in range(min(self.HANGUP_BATCH, len(self._hangups))):
                lease, reason = self._hangups.popleft()
                if not lease.state.terminal and lease.lease_id in self.ctx.sched.leases:
                    try:
                        self._cancel(lease, reason)
                    except Exception as exc:  # one lease's failure must not strand the rest
                        log.exception(
                            "lease.cancel_failed", lease_id=lease.lease_id, error=str(exc)
                        )
            await asyncio.sleep(0)

    @property
    def hangups_pending(self) -> int:
        """Hung-up requests not yet released (they are out of the queue already)."""
        return len(self._hangups)

    def resolve_waiters(self) -> None:
        """Answer every waiting client whose lease is active or ended (all of them;
        :meth:`apply` answers only those of the leases it touched)."""
        for lease_id, waiter in list(self.waiters.items()):
            lease = self.ctx.sched.leases.get(lease_id)
            if lease is not None:
                self._resolve(waiter, lease)

    @staticmethod
    def _resolve(waiter: Waiter, lease: Lease) -> None:
        if waiter.future.done():
            return
        if lease.state is LeaseState.ACTIVE:
            waiter.future.set_result(lease)
        elif lease.state.terminal:
            error: MigdError = LeaseTimeout(
                f"lease {lease.lease_id} ended while waiting: {lease.state.value} ({lease.reason})"
            )
            if lease.state is LeaseState.FAILED:
                error = GpuError(f"could not prepare a partition: {lease.reason}")
            waiter.future.set_exception(error)

    def fail_waiters(self, error: MigdError, reason: str) -> None:
        """migd stops: cancel every lease a client still waits for, and tell the client
        (and end the hung-up requests not yet released)."""
        now, mono = self.ctx.now()
        while self._hangups:
            gone, why = self._hangups.popleft()
            if not gone.state.terminal and gone.lease_id in self.ctx.sched.leases:
                # Observed and saved, but its work is not run: migd is stopping.
                self.notify(
                    self.ctx.sched.release(gone.lease_id, now, mono, reason=why).transitions
                )
                self.save(gone)
                self.record("cancelled", gone, reason=why)
        for lease_id, waiter in list(self.waiters.items()):
            lease = self.ctx.sched.leases.get(lease_id)
            if lease is not None and not lease.state.terminal:
                # Observed and saved, but its work is not run: migd is stopping.
                self.notify(self.ctx.sched.release(lease_id, now, mono, reason=reason).transitions)
                self.save(lease)
                self.record("cancelled", lease, reason=lease.reason)
            if not waiter.future.done():
                waiter.future.set_exception(error)
