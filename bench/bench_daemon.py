"""Benchmark the daemon: 50 concurrent clients lease and release on a simulated 8-GPU node.

Targets (issue "daemon"): lease latency p99 under 5 ms excluding simulated NVML latency
(the simulator runs with sim_time_scale = 0), daemon RSS under 80 MB, `migctl status`
under 200 ms wall.

    .venv/bin/python bench/bench_daemon.py [--clients 50] [--cycles 40] [--out bench/results/daemon.md]

Clients are separate processes (real peers on the Unix socket); each one leases a
1g.5gb-sized partition, holds it a few milliseconds and releases it, ``--cycles`` times.
Latency is the wall time of the ``lease`` call as the client sees it, so it includes the
client's own socket and JSON work. Every request fits (50 x 1g.5gb <= 56 on 8 A100s), so
no queueing is measured; the mixed run below measures the queueing case separately.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from migd.client import MigdClient  # noqa: E402


def client_loop(socket: str, cycles: int, sizes: list[int], seed: int, out: mp.Queue) -> None:
    rng = random.Random(seed)
    client = MigdClient(socket, timeout_s=120)
    times = []
    for n in range(cycles):
        t = time.perf_counter()
        lease = client.lease(job_id=f"{seed}.{n}", gpu_memory_mib=rng.choice(sizes), wait_s=120)
        times.append(time.perf_counter() - t)
        time.sleep(rng.uniform(0.001, 0.01))
        client.release(lease["lease_id"])
    out.put(times)


def run_clients(socket: str, clients: int, cycles: int, sizes: list[int]) -> list[float]:
    ctx = mp.get_context("fork")
    queue: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=client_loop, args=(socket, cycles, sizes, seed, queue))
        for seed in range(clients)
    ]
    for p in procs:
        p.start()
    times: list[float] = []
    for _ in procs:
        times += queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return times


def rss_mib(pid: int) -> tuple[float, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = {line.split(":")[0]: line.split()[1] for line in status.splitlines() if ":" in line}
    return int(fields["VmRSS"]) / 1024, int(fields["VmHWM"]) / 1024


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--cycles", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="migd-bench-", dir="/tmp"))
    (root / "run").mkdir()
    sock = str(root / "run" / "migd.sock")
    log = (root / "migd.log").open("wb")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "migd", "--simulate", "8xA100-40GB", "--state-dir",
         str(root / "state"), "--runtime-dir", str(root / "run"), "--socket", sock,
         "--log-format", "json", "--log-level", "warning", "--set", 'api.lease_users=["*"]',
         "--set", "policy.idle_policy=keep"],
        stdout=log, stderr=log, cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 30
        while not Path(sock).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        MigdClient(sock).ping()
        rss_idle, _ = rss_mib(daemon.pid)
        t0 = time.perf_counter()
        uniform = run_clients(sock, args.clients, args.cycles, [4000])
        uniform_s = time.perf_counter() - t0
        mixed = run_clients(sock, args.clients, max(5, args.cycles // 4), [4000, 9000, 19000])
        rss_now, rss_peak = rss_mib(daemon.pid)
        status_times = []
        for _ in range(20):
            t = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "migd.cli.migctl", "--socket", sock, "status"],
                capture_output=True, check=True, cwd=ROOT,
            )
            status_times.append(time.perf_counter() - t)
        status = MigdClient(sock).status()
        leaked = sum(1 for g in status["gpus"] for i in g["instances"] if i["busy"])
    finally:
        daemon.terminate()
        daemon.wait(30)
        log.close()
        shutil.rmtree(root, ignore_errors=True)
    lines = [
        "# Daemon benchmark",
        "",
        f"`.venv/bin/python bench/bench_daemon.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        f"on {os.cpu_count()} cores, Python {sys.version.split()[0]}, simulated 8 x A100-40GB, "
        "sim_time_scale 0 (no simulated NVML latency).",
        "",
        "| run | leases | p50 (ms) | p99 (ms) | max (ms) |",
        "|---|---|---|---|---|",
        f"| {args.clients} clients, 1g.5gb each (no queueing) | {len(uniform)} | "
        f"{pct(uniform, 0.5):.2f} | {pct(uniform, 0.99):.2f} | {max(uniform) * 1000:.2f} |",
        f"| {args.clients} clients, 5/10/20 GB mix (queueing) | {len(mixed)} | "
        f"{pct(mixed, 0.5):.2f} | {pct(mixed, 0.99):.2f} | {max(mixed) * 1000:.2f} |",
        "",
        f"Throughput (uniform run): {len(uniform) / uniform_s:.0f} lease+release cycles/s.",
        f"Daemon RSS: {rss_idle:.1f} MiB idle, {rss_now:.1f} MiB after the runs, "
        f"peak {rss_peak:.1f} MiB (target < 80 MB).",
        f"`migctl status` wall (new process each, 20 runs): median "
        f"{statistics.median(status_times) * 1000:.0f} ms, max {max(status_times) * 1000:.0f} ms "
        "(target < 200 ms).",
        f"Busy instances after all clients released: {leaked} (nothing leaks).",
        "",
        "Targets: lease p99 < 5 ms (uniform run).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
