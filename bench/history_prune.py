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

    .venv/bin/python bench/history_prune.py
    .venv/bin/python bench/history_prune.py --early [--tree /tmp/old]
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

    with tempfile.TemporaryDirectory() as tmp:
        store = StateStore(Path(tmp) / "migd.db")
        add(store, args.rows, "L")
        took = []
        for hour in range(args.hours):
            add(store, args.per_hour, f"H{hour}.")
            began = time.perf_counter()
            store.prune(args.rows, HISTORY_KEEP_BYTES)
            took.append((time.perf_counter() - began) * 1000)
        store.close()
    later = took[1:]
    print(
        f"{args.rows} rows, {args.per_hour} more an hour, {args.hours} prunes "
        f"({time.strftime('%Y-%m-%d %H:%M')}): first {took[0]:.1f} ms, then median "
        f"{statistics.median(later):.1f} ms, max {max(later):.1f} ms"
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
        began = time.perf_counter()
        store.prune(args.rows, keep_bytes)
        whole = (time.perf_counter() - began) * 1000
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
            began = time.perf_counter()
            store.prune(args.rows, keep_bytes, max_rows=step_rows, sweep=False)
            steps.append((time.perf_counter() - began) * 1000)
        left = store._history_rows
        store.close()
    print(
        f"  in {len(steps)} steps of {step_rows} rows: longest {max(steps):.1f} ms, median "
        f"{statistics.median(steps):.1f} ms, together {sum(steps):.1f} ms ({left} rows left)"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--per-hour", type=int, default=3_000)
    parser.add_argument("--hours", type=int, default=10)
    parser.add_argument("--early", action="store_true")
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    (early if args.early else hourly)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
