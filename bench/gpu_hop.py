"""What one round trip to a GPU's thread costs the daemon in CPU, against doing the same
work on the event loop: the cost behind the two leftover-process checks of a lease
cycle (bench/results/daemon_vs_presplit.md).

50 tasks on one event loop each do 0.3 ms of their own work, then a ~30 us call (what a
process listing on the simulated GPU costs, measured at 31 us) on one of 8 worker
threads, 400 times. Printed: CPU per round trip over the 0.3 ms of loop work, and wall.

- ``none``: the call on the event loop (no thread);
- ``rie``: ``loop.run_in_executor`` on a one-thread ``ThreadPoolExecutor`` inside
  ``asyncio.timeout``, as ``GpuExecutor.on_gpu`` does;
- ``light``: a bare thread on a ``queue.SimpleQueue`` answering with
  ``call_soon_threadsafe``, the cheapest hand-off Python has.

    .venv/bin/python bench/gpu_hop.py none rie light rie light none
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

TASKS, GPUS, CALLS, LOOP_WORK_S = 50, 8, 400, 0.0003


def call() -> int:
    """About 30 us of Python, like one process listing on the simulated GPU."""
    total = 0
    for i in range(300):
        total += i
    return total


def spin(seconds: float) -> None:
    """The loop's own work per request (decode, books, reply)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class BareThread:
    """One worker thread on a SimpleQueue, answering through call_soon_threadsafe."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            loop, fut, fn = self.queue.get()
            try:
                loop.call_soon_threadsafe(_settle, fut, fn(), None)
            except Exception as exc:
                loop.call_soon_threadsafe(_settle, fut, None, exc)

    def call(self, fn: Callable[[], int]) -> asyncio.Future[int]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        self.queue.put((loop, fut, fn))
        return fut


def _settle(fut: asyncio.Future[int], result: int, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


async def task(kind: str, pool: ThreadPoolExecutor, bare: BareThread) -> None:
    loop = asyncio.get_running_loop()
    for _ in range(CALLS):
        spin(LOOP_WORK_S)
        if kind == "rie":
            async with asyncio.timeout(10):
                await loop.run_in_executor(pool, call)
        elif kind == "light":
            async with asyncio.timeout(10):
                await bare.call(call)
        else:
            call()
        await asyncio.sleep(0)


async def one(kind: str) -> None:
    pools = [ThreadPoolExecutor(1) for _ in range(GPUS)]
    bares = [BareThread() for _ in range(GPUS)]
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(task(kind, pools[i % GPUS], bares[i % GPUS]) for i in range(TASKS)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    per_call_us = (cpu / (TASKS * CALLS) - LOOP_WORK_S) * 1e6
    print(f"{kind:5s} CPU per call {per_call_us:6.1f} us (call itself ~30 us), wall {wall:.2f} s")
    for pool in pools:
        pool.shutdown()


def main() -> int:
    for kind in sys.argv[1:] or ["none", "rie", "light"]:
        if kind not in ("none", "rie", "light"):
            print(f"unknown kind {kind!r}: none, rie or light", file=sys.stderr)
            return 2
        asyncio.run(one(kind))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
