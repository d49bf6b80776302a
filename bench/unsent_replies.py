"""What never-reading clients cost migd, at the configured connection limits (issue 23,
section 5): USERS made-up uids each open api.max_clients_per_uid (64) connections, send
``history`` (a 1 MiB page each, about 3 MiB of history seeded) and never read. Reported:
the daemon's RSS before, its peak (VmHWM) and after the clients hang up, and the
longest ``ping`` round trip of a reading client (root) that pings every 20 ms meanwhile.

    sudo .venv/bin/python bench/unsent_replies.py [--src DIR] [--users 3] [--per-uid 64]

``--src`` runs migd from another source tree (e.g. ``git archive <commit>`` unpacked) to
measure the code before a change on the same host; results: bench/results/unsent_replies.md.
Needs root (clients of other uids: SO_PEERCRED names the process that connected).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from migd.client import MigdClient  # noqa: E402

HISTORY = json.dumps({"version": 1, "op": "history", "limit": 10_000}).encode() + b"\n"


def vm(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB."""
    fields = {
        line.split(":")[0]: line.split()[1]
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith(("VmRSS", "VmHWM"))
    }
    return int(fields["VmRSS"]) / 1024, int(fields["VmHWM"]) / 1024


def connect_as(path: str, uid: int, count: int) -> list[socket.socket]:
    """``count`` connections made by a forked process of ``uid``, passed back (SCM_RIGHTS)."""
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            parent.close()
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            made = []
            for _ in range(count):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(path)
                made.append(sock)
            for start in range(0, count, 200):  # SCM_RIGHTS takes at most 253 fds a message
                socket.send_fds(child, [b"x"], [s.fileno() for s in made[start : start + 200]])
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    child.close()
    fds: list[int] = []
    while len(fds) < count:
        _, got, _, _ = socket.recv_fds(parent, 16, 200)
        if not got:
            break
        fds += got
    parent.close()
    os.waitpid(pid, 0)
    return [socket.socket(fileno=fd) for fd in fds]


class Pinger(threading.Thread):
    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.worst = 0.0
        self.count = 0
        self.failed = 0
        self.stop = threading.Event()

    def run(self) -> None:
        client = MigdClient(self.path, timeout_s=60)
        while not self.stop.is_set():
            began = time.perf_counter()
            try:
                client.ping()
            except Exception:
                self.failed += 1
            self.worst = max(self.worst, time.perf_counter() - began)
            self.count += 1
            self.stop.wait(0.02)


def run(src: Path, users: int, per_uid: int, send_timeout_s: float) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="migd-unsent-", dir="/tmp"))
    root.chmod(0o755)  # the clients of other uids must reach the socket
    (root / "run").mkdir(mode=0o755)
    path = str(root / "run" / "migd.sock")
    log = (root / "migd.log").open("wb")
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "migd",
            "--simulate",
            "2xA100-40GB",
            "--state-dir",
            str(root / "state"),
            "--runtime-dir",
            str(root / "run"),
            "--socket",
            path,
            "--log-format",
            "json",
            "--log-level",
            "warning",
            "--set",
            "backend.sim_time_scale=0",
            "--set",
            f"api.send_timeout_s={send_timeout_s}",
        ],
        stdout=log,
        stderr=log,
        cwd=root,
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while not Path(path).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        client = MigdClient(path, timeout_s=30)
        client.ping()
        for job in range(4):  # about 3 MiB of history, as tests/faults/clients.seed_history
            lease = client.lease(job_id=f"9.{job}", gpu_memory_mib=4000, wait_s=10)
            for n in range(200):
                client.call(
                    "report",
                    lease_id=lease["lease_id"],
                    event="note",
                    data={"n": n, "x": "z" * 3900},
                )
        time.sleep(1.0)
        rss_before, _ = vm(proc.pid)
        pinger = Pinger(path)
        pinger.start()
        time.sleep(0.5)
        socks: list[socket.socket] = []
        began = time.perf_counter()
        for u in range(users):
            socks += connect_as(path, 4242 + u, per_uid)
        for sock in socks:
            sock.sendall(HISTORY)
        # until every connection has been dropped by migd (or the send timeout twice over)
        time.sleep(send_timeout_s * 2 + 2)
        _, peak = vm(proc.pid)
        pinger.stop.set()
        pinger.join()
        for sock in socks:
            sock.close()
        time.sleep(2.0)
        rss_after, _ = vm(proc.pid)
        return {
            "clients": len(socks),
            "rss_before_mib": round(rss_before, 1),
            "rss_peak_mib": round(peak, 1),
            "rss_after_mib": round(rss_after, 1),
            "ping_worst_s": round(pinger.worst, 3),
            "pings": pinger.count,
            "ping_failures": pinger.failed,
            "attack_s": round(time.perf_counter() - began, 1),
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
    parser.add_argument("--users", type=int, default=3)
    parser.add_argument("--per-uid", type=int, default=64)
    parser.add_argument("--send-timeout-s", type=float, default=10.0)
    args = parser.parse_args()
    print(json.dumps(run(args.src, args.users, args.per_uid, args.send_timeout_s)))


if __name__ == "__main__":
    main()
