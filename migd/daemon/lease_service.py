"""The lease service: what happens around the scheduler's lease decisions.

Persists every lease that changed (and logs each state change with its explanation),
records history, hands the scheduler's follow-on work to the GPU executor, answers the
clients waiting for a grant, and keeps the per-lease side tables. Those tables are
pruned in one place, :meth:`LeaseService.prune`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from migd.core.leases import LeaseState
from migd.core.scheduler import Lease, Work
from migd.daemon.context import DaemonContext
from migd.errors import GpuError, LeaseNotFound, LeaseTimeout, MigdError

log = structlog.get_logger("migd")


@dataclass
class Waiter:
    future: asyncio.Future[Lease]
    lease_id: str


class LeaseService:
    """Lease persistence, history, waiting clients and side tables (see module docstring).

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
        self.waiters: dict[str, Waiter] = {}
        self._saved: dict[str, int] = {}  # lease id -> version last written
        self._logged: dict[str, LeaseState] = {}  # lease id -> state last logged
        self.work_seconds: dict[str, float] = {}  # lease id -> NVML time of its partition
        # Highest GPU memory seen for each active lease (its instance, its whole GPU, or
        # its MPS holder's processes), so the wrapper's OOM verdict has a peak even for
        # jobs shorter than its own sampling; see the periodic sampler.
        self.peaks: dict[str, int] = {}

    # -- persistence and history ------------------------------------------------------------

    def save(self, lease: Lease) -> None:
        self.ctx.db.save_lease(lease)
        self._saved[lease.lease_id] = lease.version
        if self._logged.get(lease.lease_id) is not lease.state:
            self._logged[lease.lease_id] = lease.state
            self._log_transition(lease)

    def restored(self, lease: Lease) -> None:
        """A lease reloaded from the store as it was: its state is already logged."""
        self._logged[lease.lease_id] = lease.state

    def _log_transition(self, lease: Lease) -> None:
        """Every lease decision in the log, with its explanation (each state change is
        persisted through :meth:`save`, so this sees them all)."""
        sched = self.ctx.sched
        state = lease.state
        ids = {"lease_id": lease.lease_id, "job_id": lease.request.job_id}
        decision = lease.decision or {}
        if state is LeaseState.QUEUED:
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
        elif state is LeaseState.PREPARING:
            log.info(
                "lease.preparing",
                **ids,
                gpu=lease.gpu,
                action=decision.get("action"),
                reason=decision.get("reason"),
            )
        elif state is LeaseState.ACTIVE:
            seconds = self.work_seconds.pop(lease.lease_id, None)
            self.record(
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
        elif state.terminal:
            level = log.warning if state in (LeaseState.RECLAIMED, LeaseState.FAILED) else log.info
            level(f"lease.{state.value}", **ids, reason=lease.reason)

    def record(self, event: str, lease: Lease | None = None, /, **data: Any) -> None:
        # Positional-only: a client's report may use any key, "event" and "lease" too.
        self.ctx.db.record(
            event,
            data,
            lease_id=lease.lease_id if lease else None,
            job_id=lease.request.job_id if lease else data.get("job_id"),
            t=self.ctx.clock.now(),
        )

    def lease_for(self, lease_id: str) -> Lease:
        lease = self.ctx.sched.leases.get(lease_id) or self.ctx.db.get_lease(lease_id)
        if lease is None:
            raise LeaseNotFound(f"no lease {lease_id}")
        return lease

    # -- after every scheduler change -------------------------------------------------------

    def after_change(self, work: list[Work]) -> None:
        """Persist leases that changed, run new work, answer waiting clients."""
        for lease in list(self.ctx.sched.leases.values()):
            if self._saved.get(lease.lease_id) != lease.version:
                self.save(lease)
        self.dispatch(work)
        self.resolve_waiters()
        self.prune()

    def prune(self, *, all_terminal: bool = False) -> None:
        """Forget ended leases, and every side table's entries of leases no longer known.

        Ended leases live on in the state db; keeping them in memory would make every
        change cost O(all leases ever), so they go once persisted and answered (a client
        still waiting for one keeps it until it is answered, unless ``all_terminal``).
        """
        sched = self.ctx.sched
        for lease_id, lease in list(sched.leases.items()):
            if lease.state.terminal and (all_terminal or lease_id not in self.waiters):
                sched.forget(lease_id)
        for book in (self._saved, self._logged, self.work_seconds, self.peaks):
            for lease_id in [k for k in book if k not in sched.leases]:
                del book[lease_id]

    def note_peak(self, lease_id: str, used_mib: int | None) -> None:
        lease = self.ctx.sched.leases.get(lease_id)
        if used_mib is None or lease is None or lease.state is not LeaseState.ACTIVE:
            return
        if used_mib > self.peaks.get(lease_id, -1):
            self.peaks[lease_id] = used_mib

    # -- release ----------------------------------------------------------------------------

    def release(self, lease: Lease, reason: str, *, reclaim: bool = False) -> dict[str, Any]:
        sched = self.ctx.sched
        if lease.lease_id not in sched.leases or lease.state.terminal:
            return {"state": lease.state.value, "already": True}
        now, mono = self.ctx.now()
        mps_device = lease.mps_device_uuid if lease.state.holds_resources else None
        work = sched.release(lease.lease_id, now, mono, reclaim=reclaim, reason=reason)
        if mps_device and self.release_share is not None and lease.gpu is not None:
            # Lowers the daemon's pinned limits; the daemon stops after mps.idle_stop_s.
            self.release_share(lease.gpu, mps_device, lease.lease_id)
        self.save(lease)
        peak = self.peaks.get(lease.lease_id)
        # (the state change itself is logged by save(): every lease transition is)
        self.record(
            "reclaimed" if reclaim else "released", lease, reason=reason, peak_used_mib=peak
        )
        self.after_change(work)
        return {"state": lease.state.value, "peak_used_mib": peak}

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
            now, mono = self.ctx.now()
            reason = "client disconnected while waiting" if hangup in done else "wait timed out"
            if not lease.state.terminal:
                self.after_change(self.ctx.sched.release(lease.lease_id, now, mono, reason=reason))
                self.save(lease)
                self.record("cancelled", lease, reason=reason)
            raise LeaseTimeout(f"lease {lease.lease_id} not granted: {reason}")
        finally:
            hangup.cancel()
            self.waiters.pop(lease.lease_id, None)

    def resolve_waiters(self) -> None:
        for lease_id, waiter in list(self.waiters.items()):
            lease = self.ctx.sched.leases.get(lease_id)
            if waiter.future.done() or lease is None:
                continue
            if lease.state is LeaseState.ACTIVE:
                waiter.future.set_result(lease)
            elif lease.state.terminal:
                error: MigdError = LeaseTimeout(
                    f"lease {lease_id} ended while waiting: {lease.state.value} ({lease.reason})"
                )
                if lease.state is LeaseState.FAILED:
                    error = GpuError(f"could not prepare a partition: {lease.reason}")
                waiter.future.set_exception(error)

    def fail_waiters(self, error: MigdError, reason: str) -> None:
        """migd stops: cancel every lease a client still waits for, and tell the client."""
        now, mono = self.ctx.now()
        for lease_id, waiter in list(self.waiters.items()):
            lease = self.ctx.sched.leases.get(lease_id)
            if lease is not None and not lease.state.terminal:
                self.ctx.sched.release(lease_id, now, mono, reason=reason)
                self.save(lease)
                self.record("cancelled", lease, reason=lease.reason)
            if not waiter.future.done():
                waiter.future.set_exception(error)
