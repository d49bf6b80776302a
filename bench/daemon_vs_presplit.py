"""This daemon against another tree (the last commit before the split, 57f0a10), same
machine, interleaved: paced client p99, saturation throughput and daemon CPU per
lease->release cycle, each the median over rounds.

    git worktree add /tmp/presplit 57f0a10
    (cd /tmp/presplit && python3 -m venv .venv && .venv/bin/pip install -e .)
    .venv/bin/python bench/daemon_vs_presplit.py --other /tmp/presplit \
        --rounds 5 --out bench/results/daemon_vs_presplit.md

Each round starts a fresh daemon of each tree (the order alternates between rounds, so
neither always runs first on a machine whose load drifts), both started as
bench/bench_daemon.py starts one (simulated 8 x A100-40GB, sim_time_scale 0), and runs:

- paced: 50 connections from one asyncio process, starts spread over 0.5 s, 0.1-0.4 s
  holds, 30 cycles each: the client p99 of leases granted at once;
- saturation: 50 connections, 1-10 ms holds, ``--cycles`` (40) cycles each:
  lease->release cycles per second of wall time, and the daemon's CPU (user + system,
  from /proc) per cycle, split into the event loop's thread and the others (the GPU
  threads' NVML calls, the WAL checkpointer). On a loaded machine the CPU per cycle is
  the steadier figure: the wall-time ones include waiting for a core.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench_daemon import pct, run_async_clients  # noqa: E402

from migd.client import MigdClient  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of process ``pid``, or of its thread ``tid``."""
    stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


class TreeDaemon:
    """A migd of ``tree`` (its own .venv), as bench_daemon.BenchDaemon starts one."""

    def __init__(self, tree: Path, script: Path | None = None, extra: tuple[str, ...] = ()) -> None:
        """``script``: run it with the daemon's arguments instead of ``-m migd``;
        ``extra``: more of them (``--set`` options)."""
        self.root = Path(tempfile.mkdtemp(prefix="migd-cmp-", dir="/tmp"))
        (self.root / "run").mkdir()
        self.socket = str(self.root / "run" / "migd.sock")
        self.log = (self.root / "migd.log").open("wb")
        python = tree / ".venv" / "bin" / "python"
        self.proc = subprocess.Popen(
            [
                str(python),
                *([str(script)] if script else ["-m", "migd"]),
                "--simulate",
                "8xA100-40GB",
                "--state-dir",
                str(self.root / "state"),
                "--runtime-dir",
                str(self.root / "run"),
                "--socket",
                self.socket,
                "--log-format",
                "json",
                "--log-level",
                "warning",
                "--set",
                "backend.sim_time_scale=0",
                "--set",
                'api.lease_users=["*"]',
                "--set",
                "policy.idle_policy=keep",
                *extra,
            ],
            stdout=self.log,
            stderr=self.log,
            cwd=tree,
        )

    def __enter__(self) -> TreeDaemon:
        deadline = time.monotonic() + 60
        while not Path(self.socket).exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no socket after 60 s; see {self.root / 'migd.log'}")
            time.sleep(0.05)
        MigdClient(self.socket).ping()
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:  # a loaded machine: do not lose the round
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


def one_round(tree: Path, clients: int, cycles: int) -> dict[str, float]:
    with TreeDaemon(tree) as daemon:
        paced, _, _ = run_async_clients(daemon.socket, clients, 30, hold_s=(0.1, 0.4))
    with TreeDaemon(tree) as daemon:
        run_async_clients(daemon.socket, clients, 4)  # instances made; warm
        pid = daemon.proc.pid
        before, loop_before = cpu_s(pid), cpu_s(pid, pid)
        times, made, seconds = run_async_clients(daemon.socket, clients, cycles)
        used, loop_used = cpu_s(pid) - before, cpu_s(pid, pid) - loop_before
    cycles = len(times) + len(made)
    return {
        "paced_p99_ms": pct(paced, 0.99),  # pct gives ms
        "cycles_per_s": cycles / seconds,
        "cpu_ms_per_cycle": used / cycles * 1000,
        # the event loop's thread (the main one), and the rest: the GPU threads' NVML
        # calls and their hand-offs, the WAL checkpointer
        "loop_cpu_ms_per_cycle": loop_used / cycles * 1000,
        "other_cpu_ms_per_cycle": (used - loop_used) / cycles * 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--other", type=Path, required=True, help="the tree to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--cycles", type=int, default=40, help="per client, saturation run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    trees = {"this": ROOT, "other": args.other.resolve()}
    rev = {
        name: subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for name, tree in trees.items()
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for n in range(args.rounds):
        order = list(trees) if n % 2 == 0 else list(reversed(trees))
        for name in order:
            result = one_round(trees[name], args.clients, args.cycles)
            results[name].append(result)
            print(f"round {n + 1} {name} ({rev[name]}): {result}", flush=True)
    load = os.getloadavg()
    keys = [
        ("paced_p99_ms", "paced client p99 (ms)"),
        ("cycles_per_s", "saturation: cycles/s"),
        ("cpu_ms_per_cycle", "daemon CPU per cycle (ms)"),
        ("loop_cpu_ms_per_cycle", "of which the event loop's thread (ms)"),
        ("other_cpu_ms_per_cycle", "of which other threads (ms)"),
    ]
    lines = [
        "# This daemon against the pre-split one, interleaved",
        "",
        f"`.venv/bin/python bench/daemon_vs_presplit.py {' '.join(sys.argv[1:])}`",
        "",
        f"This tree {rev['this']}, other {rev['other']} ({args.other}); "
        f"{len(os.sched_getaffinity(0))} cores, shared with other users (load average "
        f"{load[0]:.1f} at the end), so each figure is the median of {args.rounds} "
        "interleaved rounds, with the range.",
        "",
        f"| measure | {rev['this']} (this) | {rev['other']} (other) | this / other |",
        "|---|---|---|---|",
    ]
    for key, label in keys:
        mine = [r[key] for r in results["this"]]
        theirs = [r[key] for r in results["other"]]
        a, b = statistics.median(mine), statistics.median(theirs)
        lines.append(
            f"| {label} | {a:.2f} ({min(mine):.2f}-{max(mine):.2f}) "
            f"| {b:.2f} ({min(theirs):.2f}-{max(theirs):.2f}) | {a / b:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
