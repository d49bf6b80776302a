"""The state database's WAL file under unbroken load: how large it grows, and what bounding
it costs the clients.

Each tree's daemon (a fresh one, simulated 8 x A100-40GB) is loaded at saturation (50
connections, 1-10 ms holds, back to back) for ``--seconds``; a thread reads the sizes of
``migd.db`` and ``migd.db-wal`` every second. Then the load stops and, after
``--idle`` seconds, the sizes are read once more: a WAL that SQLite reuses but never
shrinks keeps its high-water mark on disk. Client latency is that of leases granted at
once, over the whole run.

    .venv/bin/python bench/wal_growth.py --seconds 60 . /tmp/before

Each tree needs its own ``.venv`` (a link to this one works). The trees run one after
the other, in the order given, then again in reverse (``--rounds``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench_daemon import pct, run_async_clients  # noqa: E402
from daemon_vs_presplit import TreeDaemon  # noqa: E402

MIB = 1024 * 1024


def sizes(state: Path) -> tuple[int, int]:
    """(database file, WAL file) bytes; 0 for a file not there (yet)."""
    out = []
    for name in ("migd.db", "migd.db-wal"):
        try:
            out.append((state / name).stat().st_size)
        except FileNotFoundError:
            out.append(0)
    return out[0], out[1]


def one_run(tree: Path, seconds: float, idle: float) -> dict[str, float]:
    with TreeDaemon(tree) as daemon:
        state = daemon.root / "state"
        wal_seen: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(1.0):
                wal_seen.append(sizes(state)[1])

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        times: list[float] = []
        cycles = 0
        began = time.monotonic()
        while time.monotonic() - began < seconds:
            granted, made, _ = run_async_clients(daemon.socket, 50, 8)
            times += granted
            cycles += len(granted) + len(made)
        elapsed = time.monotonic() - began
        stop.set()
        watcher.join()
        _db_loaded, wal_loaded = sizes(state)
        time.sleep(idle)  # the load has stopped: what stays on disk
        db_idle, wal_idle = sizes(state)
    return {
        "cycles_per_s": cycles / elapsed,
        "p50_ms": pct(times, 0.5),
        "p99_ms": pct(times, 0.99),
        "p999_ms": pct(times, 0.999),
        "wal_peak_mib": max([*wal_seen, wal_loaded]) / MIB,
        "wal_loaded_mib": wal_loaded / MIB,
        "wal_idle_mib": wal_idle / MIB,
        "db_mib": db_idle / MIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", type=Path, nargs="+")
    parser.add_argument("--seconds", type=float, default=60.0, help="load per run")
    parser.add_argument("--idle", type=float, default=8.0, help="wait after the load")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the trees")
    args = parser.parse_args()
    trees = [t.resolve() for t in args.trees]
    runs: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    for n in range(args.rounds):
        for tree in trees if n % 2 == 0 else list(reversed(trees)):
            runs[tree].append(one_run(tree, args.seconds, args.idle))
            print(f"round {n + 1} {tree.name}: {runs[tree][-1]}", file=sys.stderr, flush=True)
    print(
        f"\n{args.rounds} runs per tree of {args.seconds:g} s at saturation (50 clients, "
        f"1-10 ms holds), {time.strftime('%Y-%m-%d %H:%M')}; medians over the runs\n"
    )
    print(
        "| tree | cycles/s | lease p50 ms | p99 ms | p99.9 ms | WAL peak MiB "
        "| WAL at the end MiB | WAL after idle MiB | db MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for tree in trees:
        med = {k: statistics.median(r[k] for r in runs[tree]) for k in runs[tree][0]}
        print(
            f"| {tree.name} | {med['cycles_per_s']:.0f} | {med['p50_ms']:.2f} "
            f"| {med['p99_ms']:.2f} | {med['p999_ms']:.2f} | {med['wal_peak_mib']:.1f} "
            f"| {med['wal_loaded_mib']:.1f} | {med['wal_idle_mib']:.1f} | {med['db_mib']:.1f} |"
        )


if __name__ == "__main__":
    main()
