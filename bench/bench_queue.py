"""Benchmark the queue: CPU per submit, per cancel and per scheduling pass with 100, 1,000
and 10,000 requests queued, for both schemes (issue 26 §4, issue 23 §6).

    .venv/bin/python bench/bench_queue.py [--ops 300] [--scales 100,1000,10000] [--out FILE]
    MIGD_TREE=/path/to/other/checkout .venv/bin/python bench/bench_queue.py ...

``MIGD_TREE`` measures another checkout's code with this bench (the pre-split 57f0a10
too, whose ``migd.core.scheduler`` still held the GPUs, leases and policy).

A NodeScheduler on 8 x A100-40GB whose every GPU is held by a whole-GPU lease, so every
request queues. The queue is filled to n with a realistic mix of sizes (the eight
distinct figures below, users 1000-1003), then ``--ops`` more requests are submitted
(each timed: the submit, its scheduling pass and its queue position) and cancelled again
(each timed: the release of a queued lease), so n stays put; before them ``--ops``
scheduling passes over the n queued (``NodeScheduler.schedule``, nothing placeable) are
timed. Figures are CPU time
(``time.process_time``) per operation, median and mean; the growth exponent is the
slope of log(cost) over log(n) from 100 to 10,000 (0: flat, 1: linear, 2: quadratic).
The ``size`` runs age (aging_s 600) and backfill, as the defaults have it.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

# MIGD_TREE: another checkout to measure (the pre-split 57f0a10 included, whose scheduler
# module held the GPUs, leases and policy); default: this one.
ROOT = Path(os.environ.get("MIGD_TREE") or Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(ROOT))

from migd.core import catalog  # noqa: E402
from migd.core.planner import CreateOp  # noqa: E402
from migd.core.queueing import QueuePolicy  # noqa: E402
from migd.core.scheduler import NodeScheduler  # noqa: E402
from migd.core.states import state_space  # noqa: E402

try:
    from migd.core.gpus import GpuMode, ManagedGpu, mode_state
    from migd.core.leases import Lease, LeaseRequest, LeaseState
    from migd.core.policy import SchedulerPolicy

    PRESPLIT = False
except ImportError:  # before the split (57f0a10)
    from migd.core.scheduler import (  # type: ignore[attr-defined,no-redef]
        GpuMode,
        Lease,
        LeaseRequest,
        LeaseState,
        ManagedGpu,
        SchedulerPolicy,
    )

    PRESPLIT = True

SIZES = [2000, 4000, 5000, 9000, 10000, 19000, 20000, 39000]  # MiB: 1g..7g requests
SCALES = [100, 1000, 10000]


def node(scheme: QueuePolicy) -> NodeScheduler:
    geo = catalog.geometry("A100-40GB")
    if PRESPLIT:
        gpus = [
            ManagedGpu(
                i,
                f"GPU-{i:04d}",
                geo.model,
                geo.model,
                geo.memory_mib,
                GpuMode.MIG,
                space=state_space(geo),
            )
            for i in range(8)
        ]
    else:
        gpus = [
            ManagedGpu(
                i,
                f"GPU-{i:04d}",
                geo.model,
                geo.model,
                geo.memory_mib,
                mode_state(GpuMode.MIG, state_space(geo)),
            )
            for i in range(8)
        ]
    sched = NodeScheduler(gpus, SchedulerPolicy(queue=scheme))
    ids = itertools.count()
    for _ in range(8):  # every GPU held whole
        lease = Lease(f"hold{next(ids)}", LeaseRequest("hold", 40000, wait_s=0), 999, 1, 0.0)
        out = sched.submit(lease, 0.0, 0.0)
        for work in out.work:
            created = {
                op.start: (op.start, f"MIG-{work.gpu}-{op.start}", 40000)
                for op in work.ops
                if isinstance(op, CreateOp)
            }
            if PRESPLIT:
                sched.work_done(work, created, 0.0)
            else:
                sched.work_done(work, created, 0.0, 0.0)
        assert lease.state is LeaseState.ACTIVE, lease.state
    return sched


def measure(
    scheme: QueuePolicy, n: int, ops: int, seed: int = 1
) -> tuple[list[float], list[float], list[float]]:
    rng = random.Random(seed)
    sched = node(scheme)
    ids = itertools.count()
    now = 1.0

    def request() -> Lease:
        request = LeaseRequest(f"j{next(ids)}", rng.choice(SIZES), wait_s=86400.0)
        return Lease(f"L{next(ids)}", request, 1000 + rng.randrange(4), 1, now)

    for _ in range(n):
        now += 0.01
        out = sched.submit(request(), now, now)
        assert out.lease is not None and out.lease.state is LeaseState.QUEUED
    # a scheduling pass over the n queued (nothing placeable: every GPU is held), as
    # the daemon runs one after a change outside the books (a GPU re-read, a reload)
    passes: list[float] = []
    for _ in range(ops):
        now += 0.01
        t = time.process_time()
        sched.schedule(now, now)
        passes.append(time.process_time() - t)
    submit: list[float] = []
    cancel: list[float] = []
    extra: list[Lease] = []
    for _ in range(ops):
        now += 0.01
        lease = request()
        t = time.process_time()
        sched.submit(lease, now, now)
        submit.append(time.process_time() - t)
        extra.append(lease)
    rng.shuffle(extra)
    for lease in extra:
        now += 0.01
        t = time.process_time()
        sched.release(lease.lease_id, now, now, reason="cancelled")
        cancel.append(time.process_time() - t)
        sched.forget(lease.lease_id)
    assert len(sched.queue) == n
    return submit, cancel, passes


def exponent(costs: dict[int, float]) -> float:
    lo, hi = min(costs), max(costs)
    return math.log(costs[hi] / costs[lo]) / math.log(hi / lo)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--scales", default=",".join(map(str, SCALES)), help="queue lengths")
    args = parser.parse_args()
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    lines = [
        "# Queue: CPU per submit and per cancel against the queue's length",
        "",
        f"`.venv/bin/python bench/bench_queue.py {' '.join(sys.argv[1:])}` at {rev}, "
        f"Python {sys.version.split()[0]}; 8 x A100-40GB all held, every request queues; "
        f"{args.ops} submits, {args.ops} cancels and {args.ops} scheduling passes per row, "
        "CPU time.",
        "",
        "| scheme | queued | submit median (µs) | submit mean (µs) | cancel median (µs) "
        "| cancel mean (µs) | pass median (µs) | pass mean (µs) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    growth: list[str] = []
    scales = [int(x) for x in args.scales.split(",")]
    for scheme in QueuePolicy:
        means: dict[str, dict[int, float]] = {"submit": {}, "cancel": {}, "pass": {}}
        for n in scales:
            submit, cancel, passes = measure(scheme, n, args.ops)
            means["submit"][n] = statistics.mean(submit)
            means["cancel"][n] = statistics.mean(cancel)
            means["pass"][n] = statistics.mean(passes)
            row = (
                f"| {scheme.value} | {n:,} | {statistics.median(submit) * 1e6:.0f} "
                f"| {statistics.mean(submit) * 1e6:.0f} | {statistics.median(cancel) * 1e6:.0f} "
                f"| {statistics.mean(cancel) * 1e6:.0f} | {statistics.median(passes) * 1e6:.0f} "
                f"| {statistics.mean(passes) * 1e6:.0f} |"
            )
            print(row, flush=True)
            lines.append(row)
        growth.append(
            f"- {scheme.value}: submit {exponent(means['submit']):.2f}, "
            f"cancel {exponent(means['cancel']):.2f}, pass {exponent(means['pass']):.2f}"
        )
    span = f"{min(scales):,} to {max(scales):,}"
    lines += ["", f"Growth exponent of the mean cost, {span} queued:", "", *growth]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
