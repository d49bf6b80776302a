"""What the hourly history prune holds the daemon's event loop for (issue 26 §4).

A state database with ``--rows`` history rows of the size a lease's ``granted`` row has
(the daemon's default ``history_keep`` is 100,000), then ``--hours`` rounds of: an
hour's worth of new rows (``--per-hour``), one prune with the daemon's defaults, timed.
The first prune of a daemon's life counts the table's bytes once; the later ones cost
the rows they drop.

    .venv/bin/python bench/history_prune.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from migd.daemon.store.state import HISTORY_KEEP_BYTES, StateStore

ROW = {"gpu": 0, "instance": "1g.5gb@3", "reason": "x" * 60}


def add(store: StateStore, rows: int, tag: str) -> None:
    with store.transaction():
        for n in range(rows):
            store.record("granted", ROW, lease_id=f"{tag}{n}", job_id=f"{n}.0")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--per-hour", type=int, default=3_000)
    parser.add_argument("--hours", type=int, default=10)
    args = parser.parse_args()
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
