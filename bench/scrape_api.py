"""Does scraping /metrics hold up the API? (issue 23, section 3)

migd on a simulated 8 x A100-40GB node with 40 MIG leases (so a collection has something
to read), ``metrics.listen`` on a loopback port. A separate process fires waves of 200
parallel ``GET /metrics`` for ``--seconds``; this process pings the API socket every 10 ms
meanwhile, and before, as a baseline. Reported: ping round trips (median, p99, worst) with
and without scrapes, and how the scrapes were answered (200, 503, failed).

    .venv/bin/python bench/scrape_api.py [--src DIR] [--parallel 200] [--seconds 10]

``--src`` runs migd from another source tree (``git archive <commit>`` unpacked) to
measure the code before a change on the same host; results: bench/results/scrape_api.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
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


async def _scrape(port: int) -> str:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 60)
        writer.close()
        return data[9:12].decode() or "empty"
    except (OSError, TimeoutError):
        return "failed"


def scraper(port: int, parallel: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    async def main() -> dict[str, int]:
        counts: dict[str, int] = {}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for status in await asyncio.gather(*(_scrape(port) for _ in range(parallel))):
                counts[status] = counts.get(status, 0) + 1
        return counts

    out.put(asyncio.run(main()))


def pings(path: str, seconds: float) -> list[float]:
    client = MigdClient(path, timeout_s=60)
    times = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        began = time.perf_counter()
        client.ping()
        times.append(time.perf_counter() - began)
        time.sleep(0.01)
    return times


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1000, 2),
        "worst_ms": round(ordered[-1] * 1000, 2),
        "pings": len(ordered),
    }


def run(src: Path, parallel: int, seconds: float) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="migd-scrape-", dir="/tmp"))
    (root / "run").mkdir()
    path = str(root / "run" / "migd.sock")
    log_path = root / "migd.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "migd",
            "--simulate",
            "8xA100-40GB",
            "--state-dir",
            str(root / "state"),
            "--runtime-dir",
            str(root / "run"),
            "--socket",
            path,
            "--log-format",
            "json",
            "--set",
            "backend.sim_time_scale=0",
            "--set",
            "metrics.listen=127.0.0.1:0",
        ],
        stdout=log,
        stderr=log,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(src)},
    )
    try:
        port = None
        deadline = time.monotonic() + 30
        while port is None and time.monotonic() < deadline:
            for line in log_path.read_text().splitlines():
                if '"metrics.listening"' in line:
                    port = int(json.loads(line)["address"].rpartition(":")[2])
            time.sleep(0.05)
        assert port is not None, "migd did not log metrics.listening"
        client = MigdClient(path, timeout_s=30)
        for n in range(40):
            client.lease(job_id=f"{n}.0", gpu_memory_mib=4000, wait_s=10)
        baseline = pings(path, 3.0)
        out: mp.Queue = mp.Queue()  # type: ignore[type-arg]
        scrapers = mp.Process(target=scraper, args=(port, parallel, seconds, out))
        scrapers.start()
        loaded = pings(path, seconds)
        answers = out.get(timeout=seconds + 120)
        scrapers.join()
        return {
            "parallel_scrapes": parallel,
            "baseline": summary(baseline),
            "during_scrapes": summary(loaded),
            "scrape_answers": answers,
        }
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", type=Path, default=ROOT)
    parser.add_argument("--parallel", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    print(json.dumps(run(args.src, args.parallel, args.seconds)))


if __name__ == "__main__":
    main()
