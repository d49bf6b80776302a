"""Where a daemon's CPU goes per lease->release cycle: the saturation run of
bench/daemon_vs_presplit.py against one tree's daemon run under cProfile (the event
loop's thread CPU time), summed by area and printed in ms per cycle.

    .venv/bin/python bench/profile_daemon.py --tree . --tree /tmp/presplit [--cycles 25]

cProfile's own cost lands on Python code, not on C (SQLite, the json encoder), so the
areas compare between trees, not with the unprofiled CPU per cycle. The profile of each
tree is left in --keep (pstats files) for a closer look.
"""

from __future__ import annotations

import argparse
import os
import pstats
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench_daemon import run_async_clients  # noqa: E402
from daemon_vs_presplit import TreeDaemon  # noqa: E402

# Runs the tree's daemon under cProfile; SIGUSR2 writes the profile (some older trees
# do not stop on SIGTERM within a minute, so the profile cannot wait for the exit).
PROFILED = """
import cProfile, os, signal, sys, time
from migd.daemon.main import main
p = cProfile.Profile(time.thread_time)
def dump(*_):
    p.disable()
    p.dump_stats(os.environ["MIGD_PROFILE_OUT"])
signal.signal(signal.SIGUSR2, dump)
p.enable()
sys.exit(main(sys.argv[1:]))
"""


class ProfiledDaemon(TreeDaemon):
    def __init__(self, tree: Path, out: Path) -> None:
        script = Path(tempfile.mkdtemp(prefix="migd-prof-", dir="/tmp")) / "profiled.py"
        script.write_text(PROFILED)
        os.environ["MIGD_PROFILE_OUT"] = str(out)  # the daemon inherits it
        super().__init__(tree, script)

    def dump(self, out: Path) -> None:
        self.proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 60
        while not out.exists() or out.stat().st_size == 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no profile in {out} after 60 s")
            time.sleep(0.1)
        time.sleep(1)  # written whole


def area(file: str, fn: str, root: str) -> str:
    file = file.replace(root, "")
    if file.startswith("migd/core"):
        return "migd/core"
    if file.startswith("migd/"):
        return "migd (daemon, api, backends)"
    if "asyncio" in file:
        return "asyncio"
    if "concurrent" in file or "threading" in file or file.endswith("queue.py"):
        return "threads"
    if "structlog" in file or "logging" in file:
        return "logging"
    if "prometheus" in file:
        return "prometheus"
    if file == "~":
        if "sqlite3" in fn:
            return "sqlite (C)"
        if "json" in fn or "encode" in fn:
            return "json (C)"
        return "builtins"
    if "json" in file:
        return "json"
    return "other"


def profile(tree: Path, cycles: int, keep: Path) -> tuple[dict[str, float], int]:
    out = keep / f"{tree.name or 'tree'}-{os.getpid()}.prof"
    with ProfiledDaemon(tree, out) as daemon:
        run_async_clients(daemon.socket, 50, 4)
        times, made, _ = run_async_clients(daemon.socket, 50, cycles)
        daemon.dump(out)
    n = len(times) + len(made) + 50 * 4
    areas: dict[str, float] = defaultdict(float)
    stats = pstats.Stats(str(out)).stats  # type: ignore[attr-defined]
    for (file, _line, fn), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        areas[area(file, fn, str(tree.resolve()) + "/")] += tottime
    return {k: v / n * 1000 for k, v in areas.items()}, n


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", type=Path, action="append", required=True)
    parser.add_argument("--cycles", type=int, default=25)
    parser.add_argument("--keep", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    results = {str(t): profile(t, args.cycles, args.keep)[0] for t in args.tree}
    keys = sorted(
        {k for r in results.values() for k in r},
        key=lambda k: -max(r.get(k, 0.0) for r in results.values()),
    )
    print("| area (ms per cycle, profiled) | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{r.get(k, 0.0):.3f}" for r in results.values()) + " |")
    totals = " | ".join(f"{sum(r.values()):.3f}" for r in results.values())
    print(f"| total | {totals} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
