"""Issue 23, section 8: a paging id past SQLite's integers, non-finite numbers, and the
hung-up waiters' futures, against the real daemon over its socket."""

from __future__ import annotations

import json
import socket
from typing import Any, NoReturn

import pytest

from migd.api import decode_request
from migd.errors import ProtocolError
from migd.protocol import encode
from tests.process.conftest import DaemonProcess, wait_for


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def strict(data: bytes) -> Any:
    """Parse as a strict JSON parser does: NaN, Infinity and -Infinity are errors."""
    return json.loads(data, parse_constant=_no_constant)


def exchange(daemon: DaemonProcess, line: bytes) -> bytes:
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
    return data


@pytest.mark.parametrize("before_id", [2**63 - 1, 2**63, 2**64, 10**30])
def test_history_before_an_id_past_sqlite_integers_is_a_clear_answer(
    daemon: DaemonProcess, before_id: int
) -> None:
    daemon.start()
    reply = strict(exchange(daemon, b'{"version":1,"op":"history","before_id":%d}\n' % before_id))
    if before_id < 2**63:  # the largest id SQLite has: every row is older
        assert reply["ok"], reply
        assert isinstance(reply["result"]["history"], list)
    else:
        assert not reply["ok"]
        assert reply["error"]["code"] == "protocol_error", reply
        assert "before_id" in reply["error"]["message"]
    assert daemon.client().ping()
    internal = [e for e in daemon.log_events() if e.get("event") == "api.internal_error"]
    assert not internal


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e400"])
def test_non_finite_numbers_are_refused_and_history_stays_strict_json(
    daemon: DaemonProcess, number: bytes
) -> None:
    daemon.start()
    lease = daemon.client().lease(job_id="1.0", gpu_memory_mib=4000, wait_s=5)
    line = b'{"version":1,"op":"report","lease_id":"%s","event":"note","data":{"x":%s}}\n' % (
        lease["lease_id"].encode(),
        number,
    )
    reply = strict(exchange(daemon, line))
    assert not reply["ok"] and reply["error"]["code"] == "protocol_error", reply
    assert "finite" in reply["error"]["message"]
    # A finite report goes in, and every history page parses with a strict parser.
    ok = exchange(daemon, line.replace(number, b"1.5"))
    assert strict(ok)["ok"]
    page = strict(exchange(daemon, b'{"version":1,"op":"history","limit":100}\n'))
    notes = [r for r in page["result"]["history"] if r["event"] == "wrapper.note"]
    assert [r["data"] for r in notes] == [{"x": 1.5}]


def test_what_the_daemon_sends_is_strict_json_even_from_old_rows() -> None:
    # Rows stored before the check (or any value computed as inf) still go out valid.
    line = encode({"a": float("nan"), "b": [float("inf"), {"c": float("-inf")}], "d": 1.0})
    assert strict(line) == {"a": None, "b": [None, {"c": None}], "d": 1.0}
    with pytest.raises(ProtocolError, match="finite"):
        decode_request(
            b'{"version":1,"op":"lease","job_id":"1.0","gpu_memory_mib":1,"wait_s":Infinity}'
        )


def test_hung_up_waiters_leave_no_unretrieved_future_in_the_log(daemon: DaemonProcess) -> None:
    daemon.start()
    client = daemon.client()
    for n in range(2):
        client.lease(job_id=f"{n}.0", gpu_memory_mib=40000, wait_s=5)
    for n in range(10):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(daemon.socket_path))
            sock.sendall(
                b'{"version":1,"op":"lease","job_id":"%d.1","gpu_memory_mib":1000,'
                b'"wait_s":60}\n' % n
            )
            wait_for(lambda: client.status()["queue"], what="the request to queue")
        wait_for(lambda: not client.status()["queue"], what="the hung-up request to leave")
    cancelled = [x for x in client.call("leases", all=True)["leases"] if x["state"] == "cancelled"]
    assert len(cancelled) == 10
    assert daemon.stop() == 0  # what is left unreferenced is collected by now at the latest
    log = daemon.log_path.read_text()
    assert "never retrieved" not in log
    assert not [e for e in daemon.log_events() if e.get("level") == "error"], log
