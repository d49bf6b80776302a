"""What a history prune holds the daemon's event loop for (issue 26 §4).

Hourly (the default): a state database with ``--rows`` history rows of the size a
lease's ``granted`` row has (the daemon's default ``history_keep`` is 100,000), then
``--hours`` rounds of: an hour's worth of new rows (``--per-hour``), one prune with the
daemon's defaults, timed. The first prune of a daemon's life counts the table's bytes
once; the later ones cost the rows they drop.

``--early``: the prune a saturated node calls at a housekeeping round once its history
is half again over ``--rows`` (``StateStore.history_overdue``): leases as the daemon
writes them (a ~2.8 kB record and three ~680-byte history rows each, as a bench daemon's
database holds them), ``--rows`` x 1.5 rows, pruned back to ``--rows``: at once, and in
the daemon's steps of ``Timers.PRUNE_STEP_ROWS`` rows (the loop serves requests between
two). ``--tree`` imports migd from another checkout, to time its prune the same way
(one that has no steps is timed at once only).

``--start``: the same database reopened, as after a restart: the first prune's count of
the history's bytes, and the hourly prune's sweep of the leases table (``--rows`` x 0.5
leases), each in one statement and in the daemon's steps (``Timers.COUNT_STEP_ROWS``,
``Timers.SWEEP_STEP_ROWS``).

    .venv/bin/python bench/history_prune.py
    .venv/bin/python bench/history_prune.py --early [--tree /tmp/old]
    .venv/bin/python bench/history_prune.py --start
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROW = {"gpu": 0, "instance": "1g.5gb@3", "reason": "x" * 60}
# A lease's three history rows and its record, of the sizes a bench daemon writes
# (bench/daemon_alternating.py's databases: 680 and 2,780 bytes on average).
EARLY_ROW = {"reason": "x" * 660}
EARLY_LEASE = "{" + '"x": "' + "y" * 2770 + '"}'


def add(store: Any, rows: int, tag: str) -> None:
    with store.transaction():
        for n in range(rows):
            store.record("granted", ROW, lease_id=f"{tag}{n}", job_id=f"{n}.0")


def hourly(args: argparse.Namespace) -> None:
    from migd.daemon.store.state import HISTORY_KEEP_BYTES, StateStore

    try:
        from migd.daemon.supervision.periodic import Timers

        step_rows: int | None = Timers.PRUNE_STEP_ROWS
    except (ImportError, AttributeError):
        step_rows = None  # a tree without steps

    with tempfile.TemporaryDirectory() as tmp:
        store = StateStore(Path(tmp) / "migd.db")
        add(store, args.rows, "L")
        took, steps = [], []
        for hour in range(args.hours):
            add(store, args.per_hour, f"H{hour}.")
            began = time.perf_counter()
            if hour == 0 or step_rows is None:
                store.prune(args.rows, HISTORY_KEEP_BYTES)
            else:  # as the daemon prunes: in steps
                while store.history_due(args.rows, HISTORY_KEEP_BYTES):
                    _, took_ms = timed(
                        lambda: store.prune(args.rows, HISTORY_KEEP_BYTES, max_rows=step_rows)
                    )
                    steps.append(took_ms)
            took.append((time.perf_counter() - began) * 1000)
        store.close()
    later = took[1:]
    print(
        f"{args.rows} rows, {args.per_hour} more an hour, {args.hours} prunes "
        f"({time.strftime('%Y-%m-%d %H:%M')}): first {took[0]:.1f} ms, then median "
        f"{statistics.median(later):.1f} ms, max {max(later):.1f} ms"
        + (
            f"; in {len(steps)} steps of {step_rows} rows, median {statistics.median(steps):.1f}"
            f" ms, longest {max(steps):.1f} ms"
            if steps
            else ""
        )
    )


def early_store(tmp: str, rows: int) -> Any:
    from migd.daemon.store.state import StateStore

    store = StateStore(Path(tmp) / "migd.db")
    leases = rows * 3 // 2 // 3
    with store.transaction():
        for n in range(leases):
            t = 1_000_000.0 + n
            store._write(
                "INSERT INTO leases VALUES(?,?,?,?,?,?)",
                (f"L{n:08d}", f"s#{n}.0#1", "released", t, t, EARLY_LEASE),
            )
            for event in ("submitted", "granted", "released"):
                store.record(event, EARLY_ROW, lease_id=f"L{n:08d}", job_id=f"s#{n}.0#1", t=t)
    store.prune(10**9, 10**12)  # as the daemon's first prune: counts the bytes
    # The daemon's checkpointer keeps the WAL short (StateDatabase.checkpoint_in_background)
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return store


def early(args: argparse.Namespace) -> None:
    import migd
    from migd.daemon.store.state import HISTORY_KEEP_BYTES

    print(f"migd from {Path(migd.__file__).parent.parent}")
    keep_bytes = HISTORY_KEEP_BYTES
    with tempfile.TemporaryDirectory() as tmp:
        store = early_store(tmp, args.rows)
        _, whole = timed(store.prune, args.rows, keep_bytes)
        left = store._history_rows
        store.close()
    print(
        f"early prune of {args.rows * 3 // 2} rows to {args.rows} "
        f"({time.strftime('%Y-%m-%d %H:%M')}): at once {whole:.1f} ms ({left} rows left)"
    )
    try:
        from migd.daemon.supervision.periodic import Timers

        step_rows = Timers.PRUNE_STEP_ROWS
    except AttributeError:
        return  # a tree without steps
    with tempfile.TemporaryDirectory() as tmp:
        store = early_store(tmp, args.rows)
        steps = []
        while store.history_due(args.rows, keep_bytes):
            _, took = timed(lambda: store.prune(args.rows, keep_bytes, max_rows=step_rows))
            steps.append(took)
        left = store._history_rows
        store.close()
    print(
        f"  in {len(steps)} steps of {step_rows} rows: longest {max(steps):.1f} ms, median "
        f"{statistics.median(steps):.1f} ms, together {sum(steps):.1f} ms ({left} rows left)"
    )


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    began = time.perf_counter()
    answer = fn(*args)
    return answer, (time.perf_counter() - began) * 1000


def start(args: argparse.Namespace) -> None:
    from migd.daemon.store.state import _LIVE, StateStore
    from migd.daemon.supervision.periodic import Timers

    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {args.rows * 3 // 2} history rows:")
    with tempfile.TemporaryDirectory() as tmp:
        early_store(tmp, args.rows).close()
        for _ in range(args.hours):
            store = StateStore(Path(tmp) / "migd.db")  # a start: the bytes are unknown
            _, whole = timed(store._history_total)
            steps = []
            while True:
                done, took = timed(store.count_history_step, Timers.COUNT_STEP_ROWS)
                steps.append(took)
                if done:
                    break
            leases = store._db.execute("SELECT COUNT(*) FROM leases").fetchone()[0]
            # The sweep as one statement, as the hourly prune ran it before its steps.
            with store.transaction():
                oldest = store._db.execute("SELECT MIN(t) FROM history").fetchone()[0]
                _, sweep = timed(
                    store._db.execute,
                    "DELETE FROM leases WHERE state NOT IN (?,?,?) AND updated_s < ?",
                    (*_LIVE, oldest),
                )
            sweeps, cursor = [], 0
            while cursor is not None:
                cursor, took = timed(store.sweep_ended_leases_step, cursor, Timers.SWEEP_STEP_ROWS)
                sweeps.append(took)
            store.close()
            print(
                f"  count: at once {whole:.1f} ms; {len(steps)} steps of "
                f"{Timers.COUNT_STEP_ROWS}, longest {max(steps):.1f} ms, median "
                f"{statistics.median(steps):.1f} ms. Sweep of {leases} leases: at once "
                f"{sweep:.1f} ms; {len(sweeps)} steps of {Timers.SWEEP_STEP_ROWS}, longest "
                f"{max(sweeps):.1f} ms, median {statistics.median(sweeps):.1f} ms"
            )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--per-hour", type=int, default=3_000)
    parser.add_argument("--hours", type=int, default=10)
    parser.add_argument("--early", action="store_true")
    parser.add_argument("--start", action="store_true")
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    (early if args.early else start if args.start else hourly)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
