"""GpuThread: a GPU's calls in one thread, in order, answered on the event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from migd.daemon.leases.executor import GpuThread
from tests.waiting import limit


def test_calls_run_in_order_and_their_results_and_errors_reach_the_caller() -> None:
    thread = GpuThread("gpu-test")
    ran: list[int] = []

    def record(n: int) -> int:
        ran.append(n)
        return n * 10

    def fail() -> None:
        raise ValueError("NVML said no")

    async def main() -> None:
        futures = [thread.call(record, n) for n in range(5)]
        assert await asyncio.gather(*futures) == [0, 10, 20, 30, 40]
        with pytest.raises(ValueError, match="NVML said no"):
            await thread.call(fail)

    try:
        asyncio.run(main())
    finally:
        thread.shutdown()
    assert ran == [0, 1, 2, 3, 4]


def test_a_call_its_caller_stopped_waiting_for_never_runs() -> None:
    """What on_gpu's timeout relies on: a queued call whose future was cancelled (its
    caller timed out) is skipped, as a ThreadPoolExecutor skips a cancelled work item."""
    thread = GpuThread("gpu-test")
    gate = threading.Event()
    ran: list[str] = []

    async def main() -> None:
        blocked = thread.call(gate.wait, limit(30))
        dropped = thread.call(ran.append, "dropped")
        dropped.cancel()
        gate.set()
        assert await blocked is True
        await thread.call(ran.append, "after")

    try:
        asyncio.run(main())
    finally:
        thread.shutdown()
    assert ran == ["after"]


def test_submit_answers_any_thread_and_shutdown_cancels_what_is_queued() -> None:
    thread = GpuThread("gpu-test")
    assert thread.submit(sum, [1, 2, 3]).result(timeout=limit(30)) == 6
    gate, started = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return gate.wait(limit(30))

    running = thread.submit(hold)
    queued = thread.submit(sum, [4])
    assert started.wait(limit(30)), "the thread never began the first call"
    thread.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert running.result(timeout=limit(30)) is True
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        thread.submit(sum, [5])
