"""One client at a time against the daemons of several trees: where a lease's and a
release's wall time goes when nothing queues (issue 26 §4, the paced p99).

bench/daemon_alternating.py shows the paced client latency of this tree behind the
pre-split daemon's although its CPU per cycle is lower. Paced at ~200 cycles/s the
daemon is mostly idle, so a request's latency is its own service time, not queueing:
this bench measures that alone. One synchronous client (a plain blocking socket, no
asyncio: the client adds as little as it can) runs lease -> 3 ms -> release, ``--cycles``
times per segment, against each tree's daemon in turn for ``--rounds`` rounds, the
order alternating. Per tree: the median time to the reply's first byte of a lease and
of a release, and each daemon thread's CPU per cycle with its number of time slices
(``/proc/PID/task/*/schedstat``), which shows the work the GPU's thread does for the
lease's hand-out check and how often it is woken for it.

    .venv/bin/python bench/daemon_light_load.py . /tmp/presplit

Each tree needs its own ``.venv`` (a link to this one works).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench_daemon import run_async_clients  # noqa: E402
from daemon_alternating import schedstat  # noqa: E402
from daemon_vs_presplit import TreeDaemon  # noqa: E402


def request(path: str, message: dict[str, object]) -> tuple[dict[str, object], float]:
    """The reply and the seconds from connecting to its first byte."""
    with socket.socket(socket.AF_UNIX) as sock:
        began = time.perf_counter()
        sock.connect(path)
        sock.sendall((json.dumps(message) + "\n").encode())
        data = sock.recv(65536)
        first = time.perf_counter() - began
        while chunk := sock.recv(65536):
            data += chunk
    reply: dict[str, object] = json.loads(data)
    return reply, first


def segment(daemon: TreeDaemon, cycles: int, offset: int) -> tuple[list[float], list[float]]:
    leases, releases = [], []
    for n in range(cycles):
        reply, took = request(
            daemon.socket,
            {
                "version": 1,
                "op": "lease",
                "job_id": f"light{offset + n}.0",
                "gpu_memory_mib": 4000,
                "wait_s": 60,
            },
        )
        result = reply["result"]
        assert isinstance(result, dict), reply
        if not result.get("prepared"):  # a partition made for it: NVML time, kept out
            leases.append(took)
        time.sleep(0.003)
        _, took = request(
            daemon.socket, {"version": 1, "op": "release", "lease_id": result["lease_id"]}
        )
        releases.append(took)
    return leases, releases


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", type=Path, nargs="+")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cycles", type=int, default=100, help="per tree and round")
    args = parser.parse_args()
    trees: list[Path] = [t.resolve() for t in args.trees]
    daemons = {t: TreeDaemon(t).__enter__() for t in trees}
    lease_s: dict[Path, list[float]] = {t: [] for t in trees}
    release_s: dict[Path, list[float]] = {t: [] for t in trees}
    cpu: dict[Path, dict[str, list[int]]] = {t: {} for t in trees}
    try:
        for daemon in daemons.values():
            run_async_clients(daemon.socket, 50, 4)  # instances made; warm
        for n in range(args.rounds):
            for tree in trees if n % 2 == 0 else list(reversed(trees)):
                pid = daemons[tree].proc.pid
                before = schedstat(pid)
                leases, releases = segment(daemons[tree], args.cycles, n * args.cycles)
                after = schedstat(pid)
                lease_s[tree] += leases
                release_s[tree] += releases
                for tid, (ns, slices) in after.items():
                    was = before.get(tid, (0, 0))
                    row = cpu[tree].setdefault(tid, [0, 0])
                    row[0] += ns - was[0]
                    row[1] += slices - was[1]
    finally:
        for daemon in daemons.values():
            daemon.__exit__(None, None, None)
    cycles = args.rounds * args.cycles
    print(
        f"\n{args.rounds} rounds x {args.cycles} cycles per tree, one client, "
        f"{time.strftime('%Y-%m-%d %H:%M')}\n"
    )
    print(
        "| tree | lease ms (median) | release ms (median) "
        "| CPU ms/cycle, by thread (slices/cycle) |"
    )
    print("|---|---|---|---|")
    for tree in trees:
        busy = sorted(cpu[tree].items(), key=lambda kv: -kv[1][0])
        shown = [
            f"{ns / cycles / 1e6:.3f} ({slices / cycles:.1f})"
            for _tid, (ns, slices) in busy
            if ns / cycles >= 20_000  # threads that did at least 20 us a cycle
        ]
        print(
            f"| {tree.name} | {statistics.median(lease_s[tree]) * 1000:.3f} "
            f"| {statistics.median(release_s[tree]) * 1000:.3f} | {'; '.join(shown)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
