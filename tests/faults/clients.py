"""Helpers for the client fault tests: clients of other uids, descriptors, memory.

Clients that must be another user run in a forked child with a made-up uid (4242,
4243: no account needed, migd names an unknown uid by its number); that needs root.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from migd.client import MigdClient
from migd.errors import MigdError
from tests.process.conftest import DaemonProcess

USER_A, USER_B = 4242, 4243


def as_user(uid: int, action: Callable[[], Any]) -> dict[str, Any]:
    """Run ``action`` in a forked child whose uid and gid are ``uid`` (the kernel's
    SO_PEERCRED then names that uid); its result or MigdError comes back as a dict.
    (A fork, not a new interpreter: this Python may live where other uids cannot read.)"""
    if os.geteuid() != 0:
        pytest.skip("clients of other uids need root")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                outcome: dict[str, Any] = {"ok": True, "result": action()}
            except MigdError as exc:
                outcome = {"ok": False, "code": exc.code, "message": exc.message}
            os.write(write_end, json.dumps(outcome).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and data, f"the client as uid {uid} failed"
    result: dict[str, Any] = json.loads(data)
    return result


def hold_then_call(path: Path, held: int, op: str) -> Any:
    """Hold ``held`` idle connections, then send ``op`` and read to the end of the stream,
    as `socat`/`nc -U` or any client that reads until EOF does."""
    sockets = []
    for _ in range(held):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(path))
        sockets.append(sock)
    time.sleep(0.3)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        data = b""
        try:
            sock.sendall(json.dumps({"version": 1, "op": op}).encode() + b"\n")
            while chunk := sock.recv(65536):
                data += chunk
        except OSError as exc:
            return {"reply": data.decode(), "error": type(exc).__name__}
    return {"reply": json.loads(data)}


def call_as(daemon: DaemonProcess, uid: int, op: str, **fields: Any) -> dict[str, Any]:
    return as_user(uid, lambda: MigdClient(daemon.socket_path, timeout_s=20).call(op, **fields))


def sleeper_of(uid: int, procs: list[subprocess.Popen[bytes]]) -> int:
    proc = subprocess.Popen(["sleep", "300"], user=uid, group=uid, extra_groups=[])
    procs.append(proc)
    return proc.pid


def fds(daemon: DaemonProcess) -> int:
    assert daemon.proc is not None
    return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))


def rss_mib(daemon: DaemonProcess) -> float:
    assert daemon.proc is not None
    return float(psutil.Process(daemon.proc.pid).memory_info().rss) / 2**20


def raw_call(daemon: DaemonProcess, line: bytes) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(daemon.socket_path))
        sock.sendall(line)
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    reply: dict[str, Any] = json.loads(data)
    return reply


def seed_history(daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]) -> None:
    """About 3 MiB of history: 4 leases x 200 reports of ~3.9 KiB."""
    client = daemon.client()
    for job in range(4):
        holder = sleeper_of(0, sleepers)
        lease = client.lease(job_id=f"9.{job}", gpu_memory_mib=4000, wait_s=10, holder_pid=holder)
        for n in range(200):
            client.call(
                "report", lease_id=lease["lease_id"], event="note", data={"n": n, "x": "z" * 3900}
            )


def mentions(value: Any, needle: str) -> bool:
    return needle in json.dumps(value)
