"""Benchmark a mass hang-up of queued lease requests against a real migd process: how long
the watchdog goes unfed and ping unanswered while thousands of queued clients leave at once
(issue 23 §6).

    .venv/bin/python bench/mass_hangup.py [--n 1000 --n 3000 --n 7000] [--runs 2]
        [--tree NAME=DIR ...] [--bound-s 300] [--out FILE] [--raw FILE]

Run it as root: root has no per-uid connection cap, and the bench raises its own
``RLIMIT_NOFILE`` (which the daemon inherits) to hold N connections. Each ``--tree`` is a
source tree of migd (default: this one, as ``now``); ``git archive <commit> | tar -x -C
DIR`` gives an older one. The daemon runs with the tree first on ``PYTHONPATH`` and this
venv's interpreter (its dependencies), from a scratch directory so that ``python -m``
does not pick up the current directory's ``migd``.

One run: a daemon on a simulated 1 x A100-40GB node (the arguments of
``tests/process/conftest.py``: no simulated NVML latency, a ``NOTIFY_SOCKET`` datagram
socket, ``WATCHDOG_USEC`` 2 s so it sends ``WATCHDOG=1`` about every 0.5-1 s,
``api.max_clients`` N + 64); one lease holds the whole GPU; N lease requests (5 GB,
``wait_s`` 3600), each on its own connection, are sent in batches of 100, each batch
waited for in ``status`` (``leases.queued``) before the next, so the listen backlog never
overflows. Then every connection is closed at once (t0), and from t0 until ``status``
shows only the holder's lease left (the drain), the bench records:

- the longest gap between ``WATCHDOG=1`` notifications (counted from the last one before
  t0, and up to the end of the drain if none came after it);
- ping latency: a pinger thread on its own connections sends ``ping`` every 50 ms (the
  next one 50 ms after the last was sent, or at once if that one took longer); the worst
  and the 99th percentile of the pings waiting at any moment between t0 and the end of the
  drain (a ping still unanswered when a run is stopped counts with the time it had waited);
- the time to drain (``status`` polled every 0.2 s, on yet another connection).

A run that has not drained ``--bound-s`` after t0 is stopped and reported as "> bound".
Runs are interleaved: for each N, round after round, every tree once. Medians over the runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from migd.client import MigdClient  # noqa: E402
from migd.errors import MigdError  # noqa: E402
from migd.protocol import API_VERSION, encode  # noqa: E402

BATCH = 100  # connections sent at once: under asyncio's default listen backlog (100)
PING_EVERY_S = 0.05
STATUS_EVERY_S = 0.2


@dataclass
class Run:
    n: int
    tree: str
    fill_s: float = 0.0
    drain_s: float | None = None  # None: not drained within the bound
    watchdog_gap_s: float = 0.0
    watchdog_gap_open: bool = False  # the longest gap had not ended when the run stopped
    # How long the watchdog had been quiet already at t0 (part of the longest gap when
    # that gap spans t0), and the longest gap while the N requests were being queued.
    watchdog_quiet_at_t0_s: float | None = None
    fill_watchdog_gap_s: float | None = None
    pings: list[float] = field(default_factory=list)
    ping_open_s: float | None = None  # a ping still unanswered when the run stopped
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)


def wait(what: str, check: Any, limit_s: float, every_s: float = 0.1) -> None:
    end = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > end:
            raise SystemExit(f"waited {limit_s:.0f} s for {what}")
        time.sleep(every_s)


class Daemon:
    """A migd process from ``tree`` in ``root``, with a notify socket whose ``WATCHDOG=1``
    arrival times a thread records."""

    def __init__(self, tree: Path, root: Path, n: int) -> None:
        self.root = root
        self.socket = root / "run" / "migd.sock"
        (root / "run").mkdir(parents=True)
        tool = root / "condor-tool"
        tool.write_text('#!/bin/sh\nif [ "$1" = MIGD_SHARES_PER_GPU ]; then echo 7; fi\n')
        tool.chmod(0o755)
        (root / "migd.toml").write_text("version = 1\n")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(root / "notify.sock"))
        self.notify.settimeout(0.2)
        self.ready = threading.Event()
        self.watchdog: list[float] = []
        self.stopping = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        env = {
            **os.environ,
            "PYTHONPATH": str(tree),
            "NOTIFY_SOCKET": str(root / "notify.sock"),
            "WATCHDOG_USEC": "2000000",
        }
        env.pop("WATCHDOG_PID", None)
        args = [
            sys.executable,
            "-m",
            "migd",
            "--config",
            str(root / "migd.toml"),
            "--simulate",
            "1xA100-40GB",
            "--state-dir",
            str(root / "state"),
            "--runtime-dir",
            str(root / "run"),
            "--socket",
            str(self.socket),
            "--log-format",
            "json",
            "--set",
            "reaper.interval_s=0.2",
            "--set",
            "backend.sim_time_scale=0",
            "--set",
            f'htcondor.reconfig_command=["{tool}", "-daemon", "startd"]',
            "--set",
            f'htcondor.shares_command=["{tool}", "MIGD_SHARES_PER_GPU"]',
            "--set",
            f"api.max_clients={n + 64}",
            "--set",
            f"api.max_clients_per_uid={n + 64}",
        ]
        with (root / "migd.log").open("ab") as log:
            # cwd: the scratch root, so `-m` does not put this checkout's migd first.
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, env=env, cwd=root)
        wait("READY=1 from migd", lambda: self.ready.is_set() or self.proc.poll() is not None, 120)
        if self.proc.poll() is not None:
            tail = (root / "migd.log").read_text(errors="replace").splitlines()[-5:]
            raise SystemExit(f"migd from {tree} exited: " + " | ".join(tail))

    def _read(self) -> None:
        while not self.stopping.is_set():
            try:
                data = self.notify.recv(4096).decode()
            except TimeoutError:
                continue
            now = time.monotonic()
            if "READY=1" in data:
                self.ready.set()
            if "WATCHDOG=1" in data:
                self.watchdog.append(now)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.stopping.set()
        self.reader.join(5)
        self.notify.close()


class Pinger(threading.Thread):
    def __init__(self, sock: Path, timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.client = MigdClient(sock, timeout_s=timeout_s)
        self.samples: list[tuple[float, float]] = []  # (sent, latency)
        self.in_flight: float | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            sent = time.monotonic()
            self.in_flight = sent
            try:
                self.client.ping()
            except MigdError:  # the daemon is stopping at the end of the run
                break
            self.in_flight = None
            self.samples.append((sent, time.monotonic() - sent))
            self.stopping.wait(max(0.0, sent + PING_EVERY_S - time.monotonic()))


def leases(status: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = status["leases"]
    return counts


def one_run(
    tree_name: str, tree: Path, n: int, bound_s: float, fill_bound_s: float, work: Path
) -> Run:
    run = Run(n=n, tree=tree_name)
    root = Path(tempfile.mkdtemp(prefix=f"hb-{tree_name}-{n}-", dir=work))
    daemon = Daemon(tree, root, n)
    admin = MigdClient(daemon.socket, timeout_s=bound_s + 60)
    conns: list[socket.socket] = []
    pinger = Pinger(daemon.socket, timeout_s=bound_s + 60)
    try:
        admin.lease(job_id="big", gpu_memory_mib=40000, wait_s=30)
        t = time.monotonic()
        fill_marks = len(daemon.watchdog)
        for first in range(0, n, BATCH):
            for k in range(first, min(n, first + BATCH)):
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.connect(str(daemon.socket))
                message = {"job_id": f"q.{k}", "gpu_memory_mib": 5000, "wait_s": 3600}
                conn.sendall(encode({"version": API_VERSION, "id": 1, "op": "lease", **message}))
                conns.append(conn)
            want = len(conns)
            wait(
                f"{want} queued requests",
                lambda want=want: leases(admin.status())["queued"] >= want,
                fill_bound_s,
                every_s=0.2,
            )
        run.fill_s = time.monotonic() - t
        filling = [t, *daemon.watchdog[fill_marks:], time.monotonic()]
        run.fill_watchdog_gap_s = max(b - a for a, b in itertools.pairwise(filling))
        pinger.start()
        wait("a first ping", lambda: pinger.samples, 60, every_s=0.05)
        # t0: every queued client hangs up at once.
        t0 = time.monotonic()
        for conn in conns:
            conn.close()
        conns.clear()
        end = t0 + bound_s
        while time.monotonic() < end:
            counts = leases(admin.status())
            if counts["queued"] == 0 and sum(counts.values()) == 1:
                run.drain_s = time.monotonic() - t0
                break
            time.sleep(STATUS_EVERY_S)
        stop = time.monotonic()
        pinger.stopping.set()
        before = [w for w in daemon.watchdog if w < t0]
        during = [w for w in daemon.watchdog if t0 <= w <= stop]
        marks = before[-1:] + during
        run.watchdog_quiet_at_t0_s = t0 - before[-1] if before else None
        gaps = [b - a for a, b in itertools.pairwise(marks)]
        tail = stop - marks[-1] if marks else stop - t0
        run.watchdog_gap_s = max([*gaps, tail])
        run.watchdog_gap_open = tail >= max(gaps, default=0.0)
        # Every ping that was waiting at some moment of the drain: one sent just before t0
        # and answered after it waited through the hang-ups too.
        run.pings = [lat for sent, lat in pinger.samples if sent + lat >= t0 and sent <= stop]
        if pinger.in_flight is not None:
            run.ping_open_s = stop - pinger.in_flight
        run.load = os.getloadavg()
    finally:
        for conn in conns:
            conn.close()
        daemon.stop()
        pinger.join(bound_s + 60 if pinger.is_alive() and daemon.proc.poll() is None else 5)
        shutil.rmtree(root, ignore_errors=True)
    return run


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def figures(run: Run) -> dict[str, float | None]:
    """Seconds; None where the run stopped before it was known."""
    # A ping still waiting when the run stopped counts with the time it had waited.
    pings = run.pings + ([run.ping_open_s] if run.ping_open_s is not None else [])
    return {
        "watchdog_gap_s": run.watchdog_gap_s,
        "worst_ping_s": max(pings, default=None),
        "p99_ping_s": pct(pings, 0.99) if pings else None,
        "drain_s": run.drain_s,
    }


def cell(values: list[float | None], bound_s: float, open_: bool = False) -> str:
    known = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(known) < len(values):
        return f"> {bound_s:.0f}"
    med = statistics.median(known)
    text = f"{med * 1000:.0f} ms" if med < 1 else f"{med:.1f} s"
    if len(known) > 1:
        lo, hi = min(known), max(known)
        text += f" ({lo:.2f}-{hi:.2f} s)" if hi >= 1 else f" ({lo * 1000:.0f}-{hi * 1000:.0f})"
    return ("≥ " if open_ else "") + text


def report(runs: list[Run], args: argparse.Namespace, trees: list[list[str]]) -> str:
    command = "`.venv/bin/python bench/mass_hangup.py" + "".join(f" --n {n}" for n in args.n)
    command += f" --runs {args.runs} --bound-s {args.bound_s:.0f}"
    command += "".join(f" --tree {n}={d}" for n, d in (trees if args.tree else [])) + "`"
    loads = [r.load[0] for r in runs]
    lines = [
        "# Mass hang-up of queued requests: watchdog and ping (issue 23 §6)",
        "",
        f"{command} as root, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"Python {platform.python_version()}, {os.cpu_count()} cores shared with other work "
        f"(1-minute load average at the end of each run: {min(loads):.1f}-{max(loads):.1f}). "
        "A real migd on a simulated 1 x A100-40GB node, the GPU held by one lease, N lease "
        "requests queued each on its own connection, then all N connections closed at once "
        "(t0). From t0 until only the holder's lease is left: the longest gap between "
        "`WATCHDOG=1` notifications, counted from the last one before t0 as systemd counts "
        "it (WATCHDOG_USEC 2 s: one every 0.5 s when served), ping latency (a ping every "
        "50 ms on its own connection), the time to drain. Medians over the runs (min-max "
        "in brackets); ≥: the gap was still open when the run stopped.",
        "",
        "| N | version | runs | longest watchdog gap | worst ping | p99 ping | time to drain "
        "| time to queue N |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in sorted({r.n for r in runs}):
        for name, _ in trees:
            mine = [r for r in runs if r.n == n and r.tree == name]
            if not mine:
                continue
            figs = [figures(r) for r in mine]
            gap_open = any(r.watchdog_gap_open and r.drain_s is None for r in mine)
            lines.append(
                f"| {n:,} | {name} | {len(mine)} "
                f"| {cell([f['watchdog_gap_s'] for f in figs], args.bound_s, gap_open)} "
                f"| {cell([f['worst_ping_s'] for f in figs], args.bound_s)} "
                f"| {cell([f['p99_ping_s'] for f in figs], args.bound_s)} "
                f"| {cell([f['drain_s'] for f in figs], args.bound_s)} "
                f"| {statistics.median(r.fill_s for r in mine):.1f} s |"
            )
    lines += [
        "",
        "## Every run",
        "",
        "In run order. Quiet at t0: how long the watchdog had already gone without a "
        "`WATCHDOG=1` when the clients hung up (part of the longest gap when that gap spans "
        "t0); longest gap while queueing: while the N requests were sent and taken in; "
        "pings: how many were answered or waiting during the drain (-: not recorded).",
        "",
        "| N | version | longest watchdog gap | quiet at t0 | worst ping | pings | time to drain "
        "| time to queue N | longest gap while queueing | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def sec(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    for r in runs:
        f = figures(r)
        count = len(r.pings) + (r.ping_open_s is not None)
        lines.append(
            f"| {r.n:,} | {r.tree} | {sec(r.watchdog_gap_s)} | {sec(r.watchdog_quiet_at_t0_s)} "
            f"| {sec(f['worst_ping_s'])} | {count} "
            f"| {sec(r.drain_s) if r.drain_s is not None else f'> {args.bound_s:.0f} s'} "
            f"| {sec(r.fill_s)} | {sec(r.fill_watchdog_gap_s)} | {r.load[0]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, action="append", default=None)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--tree", action="append", default=None, help="NAME=DIR")
    parser.add_argument("--bound-s", type=float, default=300.0, help="drain limit")
    parser.add_argument("--fill-bound-s", type=float, default=900.0, help="queueing limit")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--raw",
        type=Path,
        action="append",
        default=None,
        help="every run's samples, JSON (written; with --report-only read, several may be given)",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="no runs: the report of the runs in --raw"
    )
    args = parser.parse_args()
    args.n = args.n or [1000, 3000, 7000]
    trees = [t.split("=", 1) for t in (args.tree or [f"now={ROOT}"])]
    if args.report_only:
        saved = [Run(**r) for f in args.raw for r in json.loads(f.read_text())]
        text = report(saved, args, trees)
        print(text)
        if args.out:
            args.out.write_text(text)
        return
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max(args.n) + 1024
    if hard != resource.RLIM_INFINITY and hard < need:
        hard = need  # root may raise the hard limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    work = Path(tempfile.mkdtemp(prefix="migd-hangup-bench-"))
    runs: list[Run] = []
    try:
        for n in args.n:
            for _ in range(args.runs):
                for name, tree in trees:
                    run = one_run(
                        name, Path(tree).resolve(), n, args.bound_s, args.fill_bound_s, work
                    )
                    runs.append(run)
                    print(json.dumps({"tree": name, "n": n, **figures(run)}), flush=True)
                    if args.raw:
                        args.raw[0].write_text(json.dumps([asdict(r) for r in runs]))
                    if args.out:
                        args.out.write_text(report(runs, args, trees))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report(runs, args, trees))


if __name__ == "__main__":
    main()
