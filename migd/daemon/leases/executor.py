"""The GPU work executor: one worker thread per GPU, and the work items run in it.

NVML calls for one GPU never run concurrently, and a slow creation on GPU 0 never
blocks GPU 1 or a status query: every backend call goes through :meth:`GpuExecutor.on_gpu`
(the GPU's own single-thread pool). The scheduler's work items (create/destroy MIG
instances) are queued per GPU and run in order by :meth:`GpuExecutor.run_work`, which
reports the result back to the scheduler and the lease service.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from migd.core.leases import LeaseState
from migd.core.planner import CreateOp, DestroyOp
from migd.core.scheduler import GpuMode, InstanceStatus, ManagedGpu, Work
from migd.daemon.context import DaemonContext
from migd.daemon.leases.service import LeaseService
from migd.errors import GpuBusy, GpuError, MigdError, StateDiskError

T = TypeVar("T")
log = structlog.get_logger("migd")


@dataclass
class GpuWorker:
    """One thread per GPU: NVML calls for a GPU never run concurrently."""

    index: int
    executor: ThreadPoolExecutor
    queue: asyncio.Queue[Work] = field(default_factory=asyncio.Queue)
    last_ok_mono: float = 0.0
    heartbeat_pending: bool = False
    busy_since_mono: float | None = None
    # The last heartbeat the event loop sent (number, monotonic time) and the last one
    # the thread answered, written in the thread: a busy loop that has not yet run the
    # answer's callback does not make the thread look hung.
    heartbeat_sent: int = 0
    heartbeat_sent_mono: float = 0.0
    heartbeat_answered: int = 0

    def unanswered_s(self, now: float) -> float:
        """How long the thread has owed an answer to a heartbeat (0: it owes none)."""
        if self.heartbeat_answered >= self.heartbeat_sent:
            return 0.0
        return now - self.heartbeat_sent_mono


async def _no_resync(index: int) -> list[str]:
    return []


class GpuExecutor:
    """Per-GPU worker threads and the scheduler's work items (see module docstring).

    ``resync`` (the reconciler's) re-reads a GPU after failed work; ``before_destroy``
    (the MPS supervisor's) runs in the GPU's thread before an instance is destroyed.
    """

    def __init__(self, ctx: DaemonContext) -> None:
        self.ctx = ctx
        self.workers: dict[int, GpuWorker] = {}
        self.leases: LeaseService | None = None
        self.resync: Callable[[int], Awaitable[list[str]]] = _no_resync
        self.before_destroy: Callable[[int, str | None], None] = lambda gpu, uuid: None
        #: Why the watchdog must stop being fed (an NVML call hung), or "".
        self.tripped = ""

    @property
    def lease_service(self) -> LeaseService:
        assert self.leases is not None
        return self.leases

    def add_gpus(self, gpus: list[ManagedGpu]) -> None:
        for gpu in gpus:
            self.workers[gpu.index] = GpuWorker(
                gpu.index, ThreadPoolExecutor(1, thread_name_prefix=f"gpu{gpu.index}")
            )

    async def on_gpu(
        self, gpu: int, fn: Callable[..., T], *args: Any, timeout_s: float | None = None
    ) -> T:
        """Run a blocking backend call ``fn(*args)`` in the GPU's own thread."""
        worker = self.workers[gpu]
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(worker.executor, fn, *args)
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result when the
        # call finishes just as its task is cancelled, swallowing the cancellation, and a
        # loop around it (the sampler) then never stops: SIGTERM hung until SIGKILL.
        async with asyncio.timeout(timeout_s or self.ctx.config.daemon.work_timeout_s):
            return await fut

    def submit(self, gpu: int, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` in the GPU's thread without waiting for it."""
        return self.workers[gpu].executor.submit(fn, *args)

    def dispatch(self, work: list[Work]) -> None:
        for item in work:
            if item.ops:
                self.workers[item.gpu].queue.put_nowait(item)

    def busy(self) -> bool:
        """Whether any GPU runs or has queued work."""
        return any(
            w.busy_since_mono is not None or not w.queue.empty() for w in self.workers.values()
        )

    def close(self) -> None:
        for worker in self.workers.values():
            worker.executor.shutdown(wait=False, cancel_futures=True)

    # -- running work -----------------------------------------------------------------------

    async def gpu_loop(self, index: int) -> None:
        worker = self.workers[index]
        while True:
            work = await worker.queue.get()
            worker.busy_since_mono = self.ctx.clock.monotonic()
            try:
                await self.run_work(work)
            except Exception as exc:  # keep the loop alive whatever happens
                log.exception("work.crashed", gpu=index, error=str(exc))
            finally:
                worker.busy_since_mono = None

    async def run_work(self, work: Work) -> None:
        ctx, leases = self.ctx, self.lease_service
        sched = ctx.sched
        if not sched.work_is_current(work):
            log.info(
                "work.skipped",
                gpu=work.gpu,
                ops=[str(op) for op in work.ops],
                reason="an earlier operation on this GPU failed",
            )
            leases.apply(sched.work_failed(work, GpuError("obsolete"), ctx.clock.now()))
            return
        gpu = sched.gpus[work.gpu]
        targets: dict[int, tuple[int | None, str | None]] = {}
        for op in work.ops:
            if isinstance(op, DestroyOp):
                inst = gpu.instance_at(op.start, InstanceStatus.DESTROYING)
                targets[op.start] = (inst.gi_id, inst.uuid) if inst else (None, None)
        lease = sched.leases.get(work.lease_id or "")
        started = ctx.clock.monotonic()
        try:
            for op in work.ops:
                if isinstance(op, CreateOp):
                    # Written before the NVML call: after a crash mid-create, a GPU instance
                    # without a compute instance at this start is known to be migd's own.
                    # A state disk that refuses it fails the work (StateDiskError) before
                    # NVML is touched, so the books give the capacity back.
                    ctx.db.remember_instance(gpu.uuid, op.start, op.profile.profile_id, None)
            created = await self.on_gpu(work.gpu, self._execute, work, targets)
        except (MigdError, TimeoutError) as exc:
            error = exc if isinstance(exc, MigdError) else GpuError("NVML call timed out")
            now, mono = ctx.now()
            leases.apply(sched.work_failed(work, error, now))
            log.warning(
                "work.failed",
                gpu=work.gpu,
                ops=[str(op) for op in work.ops],
                error=str(error),
                lease_id=work.lease_id,
            )
            leases.record(
                "work.failed",
                lease,
                gpu=work.gpu,
                ops=[str(o) for o in work.ops],
                error=error.to_dict(),
            )
            if isinstance(exc, TimeoutError):
                self.tripped = "an NVML call hung; the watchdog will restart migd"
                gpu.health.raise_("watchdog", self.tripped, now)
                return
            for note in await self.resync(work.gpu):
                log.info("resync", gpu=work.gpu, note=note)
            # The GPU's books were not trusted until it was re-read: place what fits now.
            leases.apply(sched.schedule(now, mono))
            return
        now, mono = ctx.now()
        outcome = sched.work_done(work, created, now, mono)
        # The work is done on the GPU whatever the state disk says: a row that cannot be
        # written only makes a restart call the instance adopted instead of migd's own.
        with contextlib.suppress(StateDiskError):
            for op in work.ops:
                if isinstance(op, DestroyOp):
                    ctx.db.forget_instance(gpu.uuid, op.start)
                else:
                    ctx.db.remember_instance(
                        gpu.uuid, op.start, op.profile.profile_id, created[op.start][1]
                    )
        elapsed = ctx.clock.monotonic() - started
        log.info(
            "work.done",
            gpu=work.gpu,
            kind=work.kind,
            ops=[str(op) for op in work.ops],
            seconds=round(elapsed, 3),
            lease_id=work.lease_id,
        )
        if lease is not None and lease.state is LeaseState.ACTIVE:
            leases.work_seconds[lease.lease_id] = round(elapsed, 3)  # for the grant's record
        elif work.kind == "teardown":
            leases.record("teardown", None, gpu=work.gpu, ops=[str(o) for o in work.ops])
        leases.apply(outcome)

    def _execute(
        self, work: Work, targets: dict[int, tuple[int | None, str | None]]
    ) -> dict[int, tuple[int | None, str | None, int]]:
        """Run a work item's NVML operations in order (in the GPU's thread)."""
        backend = self.ctx.backend
        created: dict[int, tuple[int | None, str | None, int]] = {}
        for op in work.ops:
            if isinstance(op, DestroyOp):
                gi_id, uuid = targets[op.start]
                if gi_id is None:
                    raise GpuError(f"cannot destroy {op.profile.name}@{op.start}: unknown GI id")
                self.before_destroy(work.gpu, uuid)  # its MPS server is a process too
                if uuid and backend.processes(work.gpu, uuid):
                    # Never destroy an instance a process uses, whatever our books say.
                    raise GpuBusy(f"{op.profile.name}@{op.start} has processes; not destroying it")
                backend.destroy_instance(work.gpu, gi_id)
            elif isinstance(op, CreateOp):
                inst = backend.create_instance(work.gpu, op.profile.profile_id, op.start)
                created[op.start] = (inst.gi_id, inst.uuid, inst.memory_total_mib)
        return created

    # -- liveness (for the watchdog) --------------------------------------------------------

    def send_heartbeats(self) -> None:
        """Ask every GPU thread that is not still answering the last one to answer again."""
        loop = asyncio.get_running_loop()
        for index, worker in self.workers.items():
            if worker.heartbeat_pending:
                continue
            worker.heartbeat_pending = True
            worker.heartbeat_sent += 1
            worker.heartbeat_sent_mono = self.ctx.clock.monotonic()

            def beat(i: int = index, w: GpuWorker = worker, n: int = worker.heartbeat_sent) -> None:
                self.ctx.backend.heartbeat(i)
                w.heartbeat_answered = n

            def done(fut: Any, w: GpuWorker = worker) -> None:
                w.heartbeat_pending = False
                if not fut.cancelled() and not fut.exception():
                    w.last_ok_mono = self.ctx.clock.monotonic()

            loop.run_in_executor(worker.executor, beat).add_done_callback(done)

    def starved_gpus(self, stale_after: float, mono: float | None = None) -> list[int]:
        """GPUs whose thread has owed an answer to a heartbeat for ``stale_after`` seconds
        at monotonic time ``mono`` (default: now), unless NVML work younger than
        ``daemon.work_timeout_s`` runs (see :class:`migd.daemon.supervision.periodic.Watchdog`).

        Only a heartbeat sent and not answered counts against a thread: when the event
        loop was too busy to send one (or to run the answer's callback), that is the
        loop's lag, which the watchdog reports as such, not a hung NVML call."""
        now = self.ctx.clock.monotonic() if mono is None else mono
        limit = self.ctx.config.daemon.work_timeout_s
        if any(
            w.busy_since_mono is not None and now - w.busy_since_mono < limit
            for w in self.workers.values()
        ):
            return []
        return [
            i
            for i, w in self.workers.items()
            if w.unanswered_s(now) > stale_after and self.ctx.sched.gpus[i].mode is not GpuMode.OFF
        ]
