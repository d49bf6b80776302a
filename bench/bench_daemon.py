"""Benchmark the daemon: 50 concurrent clients lease and release on a simulated 8-GPU node.

Targets (issue "daemon"): lease latency p99 under 5 ms excluding simulated NVML latency
(the simulator runs with sim_time_scale = 0), daemon RSS under 80 MB, `migctl status`
under 200 ms wall.

    .venv/bin/python bench/bench_daemon.py [--clients 50] [--cycles 40] [--out FILE]

Runs, each on a fresh daemon unless said:

- paced: 50 concurrent connections from one asyncio process, starts spread over 0.5 s,
  each holding its lease 0.1-0.4 s, 30 cycles; once sharing all cores with the clients,
  once with the daemon pinned to CPU 0 and the clients to the other CPUs (the load
  generator then cannot steal the daemon's core);
- saturation (one daemon): 50 connections with 1-10 ms holds from one process, then 50
  client processes, then 50 processes asking 5/10/20 GB so that requests queue.

Each client leases a 1g.5gb-sized partition (the mixed run: larger ones too). Client
latency is the wall time of the ``lease`` call as the client sees it, so it includes the
client's own socket, JSON and event-loop work. The daemon's own service time (request
decoded to reply written; leases that queued for capacity excluded) comes from
``migctl status`` (``daemon.latency_ms``, the last 2048 requests per op).
"""

from __future__ import annotations

import argparse
import asyncio
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


async def _request(sock_path: str, message: dict[str, object]) -> dict[str, object]:
    reader, writer = await asyncio.open_unix_connection(sock_path)
    writer.write(json.dumps(message).encode() + b"\n")
    await writer.drain()
    line = await reader.readline()
    writer.close()
    reply: dict[str, object] = json.loads(line)
    if not reply.get("ok"):
        raise RuntimeError(reply.get("error"))
    return reply


async def _async_client(
    sock_path: str,
    cycles: int,
    seed: int,
    times: list[float],
    prepared: list[float],
    hold_s: tuple[float, float],
) -> None:
    rng = random.Random(seed)
    if hold_s[0] >= 0.1:
        await asyncio.sleep(rng.uniform(0.0, 0.5))  # paced clients do not start in lockstep
    for n in range(cycles):
        t = time.perf_counter()
        reply = await _request(
            sock_path,
            {
                "version": 1,
                "op": "lease",
                "job_id": f"a{seed}.{n}",
                "gpu_memory_mib": 4000,
                "wait_s": 120,
            },
        )
        lease = reply["result"]
        assert isinstance(lease, dict)
        # Kept apart: grants that waited for the (simulated, zero-latency) NVML create.
        (prepared if lease.get("prepared") else times).append(time.perf_counter() - t)
        await asyncio.sleep(rng.uniform(*hold_s))
        await _request(sock_path, {"version": 1, "op": "release", "lease_id": lease["lease_id"]})


def run_async_clients(
    sock_path: str, clients: int, cycles: int, hold_s: tuple[float, float] = (0.001, 0.01)
) -> tuple[list[float], list[float], float]:
    """Many concurrent connections from one light process (little client CPU).

    Returns the latencies of leases granted at once, of those whose partition had to be
    created first, and the run's wall time.
    """
    times: list[float] = []
    prepared: list[float] = []

    async def main() -> None:
        await asyncio.gather(
            *(_async_client(sock_path, cycles, s, times, prepared, hold_s) for s in range(clients))
        )

    t0 = time.perf_counter()
    asyncio.run(main())
    return times, prepared, time.perf_counter() - t0


def rss_mib(pid: int) -> tuple[float, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if value.split():
            fields[key] = value.split()[0]
    return int(fields["VmRSS"]) / 1024, int(fields["VmHWM"]) / 1024


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


class BenchDaemon:
    """A migd process on a simulated 8 x A100-40GB node, in a temporary directory."""

    def __init__(self, pin_cpu: int | None = None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="migd-bench-", dir="/tmp"))
        (self.root / "run").mkdir()
        self.socket = str(self.root / "run" / "migd.sock")
        self.pin_cpu = pin_cpu
        profile = os.environ.get("MIGD_BENCH_PROFILE")  # write a cProfile of the daemon here
        prefix = [sys.executable, "-m", "cProfile", "-o", profile] if profile else [sys.executable]
        self.log = (self.root / "migd.log").open("wb")
        self.proc = subprocess.Popen(
            [
                *prefix,
                "-m",
                "migd",
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
                "backend.sim_time_scale=0",  # measure migd, not the simulated NVML latency
                "--set",
                'api.lease_users=["*"]',
                "--set",
                "policy.idle_policy=keep",
            ],
            stdout=self.log,
            stderr=self.log,
            cwd=ROOT,
        )

    def __enter__(self) -> BenchDaemon:
        deadline = time.monotonic() + 30
        while not Path(self.socket).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        MigdClient(self.socket).ping()
        if self.pin_cpu is not None:
            # Every thread of the daemon (the event loop and the per-GPU workers).
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                os.sched_setaffinity(int(task.name), {self.pin_cpu})
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def served(self) -> dict[str, dict[str, float]]:
        latency: dict[str, dict[str, float]] = MigdClient(self.socket).status()["daemon"][
            "latency_ms"
        ]
        return latency


def paced_run(
    clients: int, pin: bool
) -> tuple[list[float], list[float], float, dict[str, dict[str, float]]]:
    cpus = sorted(os.sched_getaffinity(0))
    pinned = pin and len(cpus) >= 2
    mine = set(cpus)
    with BenchDaemon(pin_cpu=cpus[0] if pinned else None) as daemon:
        if pinned:
            os.sched_setaffinity(0, set(cpus[1:]))
        try:
            times, prepared, seconds = run_async_clients(
                daemon.socket, clients, 30, hold_s=(0.1, 0.4)
            )
        finally:
            os.sched_setaffinity(0, mine)
        return times, prepared, seconds, daemon.served()


def row(label: str, times: list[float], served: dict[str, float] | None = None) -> str:
    if not times:
        return f"| {label} | 0 | | | | | |"
    cells = (
        f"{len(times)} | {pct(times, 0.5):.2f} | {pct(times, 0.99):.2f} | {max(times) * 1000:.2f}"
    )
    if served is None:
        return f"| {label} | {cells} | | |"
    return f"| {label} | {cells} | {served['p50']:.2f} | {served['p99']:.2f} |"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--cycles", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    paced, paced_made, paced_s, paced_served = paced_run(args.clients, pin=False)
    pinned, pinned_made, _, pinned_served = paced_run(args.clients, pin=True)
    cores = len(os.sched_getaffinity(0))
    with BenchDaemon() as daemon:
        sock = daemon.socket
        rss_idle, _ = rss_mib(daemon.proc.pid)
        light, light_made, light_s = run_async_clients(sock, args.clients, args.cycles)
        light += light_made
        t0 = time.perf_counter()
        uniform = run_clients(sock, args.clients, args.cycles, [4000])
        uniform_s = time.perf_counter() - t0
        mixed = run_clients(sock, args.clients, max(5, args.cycles // 4), [4000, 9000, 19000])
        rss_now, rss_peak = rss_mib(daemon.proc.pid)
        status_times = []
        for _ in range(20):
            t = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "migd.cli.migctl", "--socket", sock, "status"],
                capture_output=True,
                check=True,
                cwd=ROOT,
            )
            status_times.append(time.perf_counter() - t)
        status = MigdClient(sock).status()
        leaked = sum(1 for g in status["gpus"] for i in g["instances"] if i["busy"])
        served = status["daemon"]["latency_ms"]
    lines = [
        "# Daemon benchmark",
        "",
        f"`.venv/bin/python bench/bench_daemon.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        f"on {cores} cores, Python {sys.version.split()[0]}, simulated 8 x A100-40GB, "
        "sim_time_scale 0 (no simulated NVML latency).",
        "",
        "| run | leases | client p50 (ms) | client p99 (ms) | client max (ms) "
        "| daemon p50 (ms) | daemon p99 (ms) |",
        "|---|---|---|---|---|---|---|",
        row(
            f"paced: {args.clients} concurrent clients, 0.1-0.4 s holds "
            f"({(len(paced) + len(paced_made)) / paced_s:.0f} lease+release/s offered), "
            "sharing the cores; granted at once",
            paced,
            paced_served["lease"],
        ),
        row(
            "paced, as above: leases whose instance was created",
            paced_made,
            paced_served.get("lease.prepared"),
        ),
        row(
            "paced, as above, daemon pinned to one CPU and the clients to the "
            f"other {cores - 1}; granted at once",
            pinned,
            pinned_served["lease"] if cores >= 2 else None,
        ),
        row(
            "paced and pinned: leases whose instance was created",
            pinned_made,
            pinned_served.get("lease.prepared") if cores >= 2 else None,
        ),
        row(f"saturation: {args.clients} connections, 1-10 ms holds, one process", light, None),
        row(f"saturation: {args.clients} client processes, 1-10 ms holds", uniform, None),
        row(f"saturation with queueing: {args.clients} processes, 5/10/20 GB mix", mixed, None),
        "",
        "Daemon service time over the last 2048 requests of each op after the saturation runs "
        "(request decoded to reply written):",
        "",
        "| op | n | p50 (ms) | p99 (ms) | max (ms) |",
        "|---|---|---|---|---|",
        *(
            f"| {op} | {v['n']} | {v['p50']:.2f} | {v['p99']:.2f} | {v['max']:.2f} |"
            for op, v in sorted(served.items())
            if op.startswith("lease") or op in ("release", "status")
        ),
        "",
        f"All {len(paced) + len(paced_made)} paced leases together, sharing the cores: client "
        f"p50 {pct(paced + paced_made, 0.5):.2f} ms, p99 {pct(paced + paced_made, 0.99):.2f} ms.",
        "",
        "The paced runs' client-side latency includes the load generator's own event loop "
        "(50 connections in one Python process); the daemon columns are the daemon's own "
        "service time for the same requests.",
        "",
        f"Throughput: {len(light) / light_s:.0f} lease+release cycles/s with one client "
        f"process, {len(uniform) / uniform_s:.0f} with {args.clients} client processes "
        f"(which compete with the daemon for the {cores} cores).",
        f"Daemon RSS: {rss_idle:.1f} MiB idle, {rss_now:.1f} MiB after the saturation runs, "
        f"peak {rss_peak:.1f} MiB (target < 80 MB).",
        f"`migctl status` wall (new process each, 20 runs): median "
        f"{statistics.median(status_times) * 1000:.0f} ms, max {max(status_times) * 1000:.0f} ms "
        "(target < 200 ms).",
        f"Busy instances after all clients released: {leaked} (nothing leaks).",
        "",
        "Target: lease p99 < 5 ms with 50 concurrent clients.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
