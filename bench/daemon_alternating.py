"""Daemon CPU per lease->release cycle of several trees, their daemons running side by
side and loaded in turn, a second at a time.

bench/daemon_vs_presplit.py and bench/daemon_paired.py start a fresh daemon per round
and run each for 5-10 s; on a 2-core virtual machine whose speed drifts by 25 % over a
few minutes, rounds of one tree then differ by more than the trees do (the paired
median of 5 rounds still moved by +-10 % from run to run). Here every tree's daemon is
started once and warmed, then the trees are loaded in turn, one short segment each
(``--cycles`` per client, about a second), the order alternating, for ``--pairs``
rounds; a tree's figure is the median over its segments, and the comparison is the
median of the per-round ratios to the last tree, so a drift slower than a few seconds
cancels out. CPU time is read from ``/proc/PID/task/*/schedstat`` (nanoseconds of
run time per thread), not the 10 ms clock ticks of ``/proc/PID/stat``.

    .venv/bin/python bench/daemon_alternating.py --pairs 30 . /tmp/presplit

Each tree needs its own ``.venv`` (a link to this one works). Two phases, each
alternating: saturation (50 connections, 1-10 ms holds: CPU per cycle and cycles/s)
and, with ``--paced``, paced load (50 connections, 0.1-0.4 s holds: the client p50 and
p99 of leases granted at once, over all of a tree's segments together). A paced p99 of a
few thousand leases moves by 10-20 % from run to run, so each tree's p99 ratio to the last
tree comes with a 95 % interval: the paced rounds are resampled with replacement, the same
rounds for both trees (``--boot`` times), and the ratio of the pooled p99s taken each time.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench_daemon import pct, run_async_clients  # noqa: E402
from daemon_vs_presplit import TreeDaemon  # noqa: E402


def schedstat(pid: int) -> dict[str, tuple[int, int]]:
    """Each thread of ``pid`` by its id: (run time ns, time slices)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        out[task.name] = (int(fields[0]), int(fields[2]))
    return out


def run_ns(pid: int) -> tuple[int, int]:
    """(run time of all of ``pid``'s threads, of its main thread: the event loop's), ns."""
    threads = schedstat(pid)
    return sum(ns for ns, _ in threads.values()), threads.get(str(pid), (0, 0))[0]


def segment(daemon: TreeDaemon, clients: int, cycles: int) -> tuple[float, float, float]:
    """Load ``daemon`` once: (CPU ms per cycle, of which the loop's thread, cycles/s)."""
    pid = daemon.proc.pid
    before, loop_before = run_ns(pid)
    times, made, seconds = run_async_clients(daemon.socket, clients, cycles)
    after, loop_after = run_ns(pid)
    n = len(times) + len(made)
    return (after - before) / n / 1e6, (loop_after - loop_before) / n / 1e6, n / seconds


def quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):.3f} (IQR {q[0]:.3f}-{q[2]:.3f})"


def p99_ratio(mine: list[list[float]], ref: list[list[float]], boot: int) -> str:
    """The pooled p99 of ``mine`` over ``ref``'s, and a 95 % bootstrap interval from
    resampling the paced rounds (the same rounds for both: they ran side by side)."""

    def ratio(rounds: list[int]) -> float:
        return pct([t for r in rounds for t in mine[r]], 0.99) / pct(
            [t for r in rounds for t in ref[r]], 0.99
        )

    every = list(range(len(mine)))
    rng = random.Random(0)
    draws = sorted(ratio(rng.choices(every, k=len(every))) for _ in range(boot))
    low, high = draws[int(0.025 * boot)], draws[min(boot - 1, int(0.975 * boot))]
    return f"{ratio(every):.3f} ({low:.3f}-{high:.3f})"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", type=Path, nargs="+", help="the last is the reference")
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--cycles", type=int, default=8, help="per client and segment")
    parser.add_argument("--paced", type=int, default=0, help="paced rounds after (0: none)")
    parser.add_argument("--boot", type=int, default=400, help="resamples of the paced rounds")
    parser.add_argument(
        "--pin", action="store_true", help="daemons on the first CPU, this client on the last"
    )
    args = parser.parse_args()
    trees: list[Path] = [t.resolve() for t in args.trees]
    reference = trees[-1]
    daemons = {t: TreeDaemon(t).__enter__() for t in trees}
    try:
        if args.pin:
            cpus = sorted(os.sched_getaffinity(0))
            for daemon in daemons.values():
                for task in Path(f"/proc/{daemon.proc.pid}/task").iterdir():
                    os.sched_setaffinity(int(task.name), {cpus[0]})
            os.sched_setaffinity(0, {cpus[-1]})
        for daemon in daemons.values():
            run_async_clients(daemon.socket, args.clients, 4)  # instances made; warm
        runs: dict[Path, list[tuple[float, float, float]]] = {t: [] for t in trees}
        for n in range(args.pairs):
            for tree in trees if n % 2 == 0 else list(reversed(trees)):
                runs[tree].append(segment(daemons[tree], args.clients, args.cycles))
            print(
                f"round {n + 1}: " + " | ".join(f"{t.name} {runs[t][-1][0]:.3f} ms" for t in trees),
                flush=True,
            )
        paced: dict[Path, list[list[float]]] = {t: [] for t in trees}
        for n in range(args.paced):
            for tree in trees if n % 2 == 0 else list(reversed(trees)):
                times, _, _ = run_async_clients(
                    daemons[tree].socket, args.clients, 10, hold_s=(0.1, 0.4)
                )
                paced[tree].append(times)
            print(f"paced round {n + 1} done", flush=True)
    finally:
        for daemon in daemons.values():
            daemon.__exit__(None, None, None)
    print(
        f"\n{args.pairs} rounds of {args.clients} clients x {args.cycles} cycles, "
        f"{time.strftime('%Y-%m-%d %H:%M')}; ratios are to {reference.name}, round by round\n"
    )
    print(
        "| tree | CPU ms/cycle | loop thread | other threads | cycles/s | CPU ratio | "
        "loop ratio | cycles/s ratio | rounds below 1 |"
        + (" paced p50 / p99 ms | paced p99 ratio (95 % interval) |" if args.paced else "")
    )
    print("|---" * (9 + 2 * bool(args.paced)) + "|")
    ref = runs[reference]
    for tree in trees:
        mine = runs[tree]
        cpu = [a[0] / b[0] for a, b in zip(mine, ref, strict=True)]
        loop = [a[1] / b[1] for a, b in zip(mine, ref, strict=True)]
        rate = [a[2] / b[2] for a, b in zip(mine, ref, strict=True)]
        row = (
            f"| {tree.name} | {statistics.median(m[0] for m in mine):.3f} "
            f"| {statistics.median(m[1] for m in mine):.3f} "
            f"| {statistics.median(m[0] - m[1] for m in mine):.3f} "
            f"| {statistics.median(m[2] for m in mine):.0f} | {quartiles(cpu)} "
            f"| {quartiles(loop)} | {quartiles(rate)} | {sum(r < 1 for r in cpu)}/{len(cpu)} |"
        )
        if args.paced:
            pooled = [t for times in paced[tree] for t in times]
            row += (
                f" {pct(pooled, 0.5):.2f} / {pct(pooled, 0.99):.2f} ({len(pooled)} leases) "
                f"| {p99_ratio(paced[tree], paced[reference], args.boot)} |"
            )
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
