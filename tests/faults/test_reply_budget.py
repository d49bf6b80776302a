"""Issue 23, section 5: what unread replies hold is bounded per user and in total, not only
per connection. Clients of made-up uids send ``history`` and never read; once their
replies fill the user's budget (or everyone's), that user's (everyone's) next request is
refused at once, before any reply is built, while other users, root and ping are served;
the budget comes back when the replies are read or the clients dropped."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
from pathlib import Path

import pytest

from tests.faults.clients import USER_A, USER_B, call_as, seed_history
from tests.process.conftest import DaemonProcess, wait_for

pytestmark = pytest.mark.slow

USER_C = 4244
PAGE = 256 * 1024  # api.max_reply_bytes: each history reply below is one page this size
HISTORY = json.dumps({"version": 1, "op": "history", "limit": 10_000}).encode() + b"\n"


def connect_as(path: Path, uid: int, count: int) -> list[socket.socket]:
    """``count`` connections made by a process of ``uid`` (SO_PEERCRED names the process
    that connected), handed back to this one over a socket pair (SCM_RIGHTS)."""
    if os.geteuid() != 0:
        pytest.skip("clients of other uids need root")
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
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
                sock.connect(str(path))
                made.append(sock)
            socket.send_fds(child, [b"x"], [s.fileno() for s in made])
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    child.close()
    try:
        _, fds, _, _ = socket.recv_fds(parent, 16, count)
    finally:
        parent.close()
        _, status = os.waitpid(pid, 0)
    assert status == 0 and len(fds) == count, f"connecting as uid {uid} failed"
    return [socket.socket(fileno=fd) for fd in fds]


def held_reply(sock: socket.socket) -> bool | None:
    """Whether migd answered this connection with a reply it now holds (``ok``, a page
    the client does not read), or refused it (``False``); ``None``: no answer yet."""
    ready, _, _ = select.select([sock], [], [], 0)
    if not ready:
        return None
    head = sock.recv(64, socket.MSG_PEEK)
    return b'"ok":true' in head.replace(b" ", b"")


def hog(daemon: DaemonProcess, uid: int, count: int) -> list[socket.socket]:
    """``count`` clients of ``uid`` that each got a history page and never read it.

    A connection refused meanwhile (a reply read by an earlier client is given back
    only when that client's connection closes) is replaced until ``count`` are held."""
    held: list[socket.socket] = []

    def more() -> bool:
        while len(held) < count:
            (sock,) = connect_as(daemon.socket_path, uid, 1)
            sock.sendall(HISTORY)

            def answered(sock: socket.socket = sock) -> tuple[bool] | None:
                got = held_reply(sock)
                return None if got is None else (got,)

            (ok,) = wait_for(answered, what=f"migd to answer a history request of uid {uid}")
            if ok:
                held.append(sock)
            else:
                sock.close()
                return False
        return True

    wait_for(more, what=f"{count} unread history replies of uid {uid} held by migd")
    return held


def test_unread_replies_are_bounded_per_user_and_in_total(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    daemon.extra_args += [
        "--set",
        "api.status_public=true",
        "--set",
        f"api.max_reply_bytes={PAGE}",
        "--set",
        f"api.max_unsent_bytes_per_uid={2 * PAGE + PAGE // 2}",  # two pages, not three
        "--set",
        f"api.max_unsent_bytes={4 * PAGE + PAGE // 2}",  # four pages, not five
        "--set",
        "api.send_timeout_s=60",  # the unread replies stay held while the test looks
    ]
    daemon.start()
    seed_history(daemon, sleepers)  # about 3 MiB: every history reply is a full page
    held: list[socket.socket] = []
    try:
        held += hog(daemon, USER_A, 2)
        # A's budget is spent: its next request is refused, and says what to do
        refused = call_as(daemon, USER_A, "history", limit=10_000)
        assert not refused["ok"] and refused["code"] == "daemon_unavailable"
        assert "api.max_unsent_bytes_per_uid =" in refused["message"]
        assert call_as(daemon, USER_A, "ping")["ok"] is False  # any request, not only history
        # another user is served, and so is root
        assert call_as(daemon, USER_B, "history", limit=10_000)["ok"]
        assert daemon.client().ping()
        # B fills the rest of the total: a third user is refused, root still served
        held += hog(daemon, USER_B, 2)
        total = call_as(daemon, USER_C, "history", limit=10_000)
        assert not total["ok"] and total["code"] == "daemon_unavailable"
        assert "api.max_unsent_bytes =" in total["message"]
        assert daemon.client().ping()
    finally:
        for sock in held:
            sock.close()
    # the hogs hung up: their bytes are given back, and everyone is served again
    wait_for(
        lambda: call_as(daemon, USER_A, "history", limit=10_000)["ok"],
        what="uid 4242 to be served again once its unread replies were dropped",
    )
    assert call_as(daemon, USER_C, "history", limit=10_000)["ok"]
