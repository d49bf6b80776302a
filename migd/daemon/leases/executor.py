"""The GPU executor: one worker thread per GPU and its queue of work items.

NVML calls for one GPU never run concurrently, and a slow creation on GPU 0 never
blocks GPU 1 or a status query: every backend call goes through :meth:`GpuExecutor.on_gpu`
(the GPU's own thread, :class:`GpuThread`). The scheduler's work items (create/destroy MIG
instances) are queued per GPU by :meth:`GpuExecutor.dispatch` and run in order by
:class:`migd.daemon.leases.work.WorkRunner`, which reports the result back to the
scheduler and the lease service. The executor knows nothing of leases: it is built
first, and everything that queues or runs GPU work is built with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import structlog

from migd.core.gpus import GpuMode, ManagedGpu, Work
from migd.daemon.context import DaemonContext

T = TypeVar("T")
log = structlog.get_logger("migd")


class GpuCalls(Protocol):
    """Where a GPU's calls run, one at a time in the order given: :class:`GpuThread`, or
    a test's stepped stand-in (tests/interleave/harness.py)."""

    def call(self, fn: Callable[..., T], /, *args: Any) -> asyncio.Future[T]:
        """Queue ``fn(*args)``; the future (of the running loop) settles with its result."""
        ...

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T]:
        """Queue ``fn(*args)`` from any thread, with no event loop to answer to."""
        ...

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None: ...


class _Stop:
    """The queue entry that ends a :class:`GpuThread`."""


class GpuThread:
    """One thread that runs a GPU's calls in order (:class:`GpuCalls`).

    A ``ThreadPoolExecutor(1)`` would do the same through ``run_in_executor``, but every
    call then passes a ``concurrent.futures.Future`` (a lock and a condition) and a second
    future chained to it: 164-173 us of CPU per round trip against 89-124 us for this
    bare queue answering through ``call_soon_threadsafe`` (bench/gpu_hop.py), and a lease
    makes one round trip per cycle (its hand-out check, issue 26 §4).

    The thread is a daemon thread: an NVML call that never returns (a GPU fallen off the
    bus) must not keep migd from exiting; the watchdog reports the hang
    (:meth:`GpuExecutor.starved_gpus`).
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, ...] | _Stop] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., T], /, *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._put((loop, fut, fn, args))
        return fut

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T]:
        fut: Future[T] = Future()
        self._put((None, fut, fn, args))
        return fut

    def _put(self, item: tuple[Any, ...]) -> None:
        if self._closed:
            raise RuntimeError("the GPU's thread is shut down: migd is stopping")
        self._queue.put(item)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, _Stop):
                return
            loop, fut, fn, args = item
            if loop is None:
                self._run_submitted(fut, fn, args)
                continue
            if fut.cancelled():  # its caller stopped waiting before it started
                continue
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # every error goes to the caller, as an executor's
                result, error = None, exc
            # The loop may be closed already (migd stopping while NVML answered).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, fut, result, error)

    @staticmethod
    def _run_submitted(fut: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking calls; the thread ends after the ones queued (all but the running
        one are dropped with ``cancel_futures``: their callers see them cancelled)."""
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Stop):
                    continue
                loop, fut, _fn, _args = item
                if loop is None:
                    fut.cancel()
                else:
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(fut.cancel)
        self._queue.put(_Stop())
        if wait:
            self._thread.join()


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():  # cancelled meanwhile (its caller timed out)
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


@dataclass
class GpuWorker:
    """One thread per GPU: NVML calls for a GPU never run concurrently."""

    index: int
    executor: GpuCalls
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


class GpuExecutor:
    """Per-GPU worker threads and work queues (see the module docstring)."""

    def __init__(self, ctx: DaemonContext) -> None:
        self.ctx = ctx
        self.workers: dict[int, GpuWorker] = {}
        #: Why the watchdog must stop being fed (an NVML call hung), or "".
        self.tripped = ""

    def add_gpus(self, gpus: list[ManagedGpu]) -> None:
        for gpu in gpus:
            self.workers[gpu.index] = GpuWorker(gpu.index, GpuThread(f"gpu{gpu.index}"))

    async def on_gpu(
        self, gpu: int, fn: Callable[..., T], *args: Any, timeout_s: float | None = None
    ) -> T:
        """Run a blocking backend call ``fn(*args)`` in the GPU's own thread."""
        fut = self.workers[gpu].executor.call(fn, *args)
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result when the
        # call finishes just as its task is cancelled, swallowing the cancellation, and a
        # loop around it (the sampler) then never stops: SIGTERM hung until SIGKILL.
        async with asyncio.timeout(timeout_s or self.ctx.config.daemon.work_timeout_s):
            return await fut

    def run_detached(self, gpu: int, fn: Callable[..., Any], *args: Any) -> Future[Any]:
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

    # -- liveness (for the watchdog) --------------------------------------------------------

    def send_heartbeats(self) -> None:
        """Ask every GPU thread that is not still answering the last one to answer again."""
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

            worker.executor.call(beat).add_done_callback(done)

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
