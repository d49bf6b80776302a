"""Rolling upgrade: a job wrapper of an older migd against this daemon.

A package upgrade restarts migd under running jobs: each job's wrapper, started by the
old package, keeps running and talks to the new daemon (reports, release) for the rest
of its job, and new jobs may lease from it before they ever see the new wrapper. The
requests here are what the wrapper of commit 57f0a10 (2026-11-23) sent for ``migd-run``
and for ``migd-wrapper`` with a GPU job ad, recorded by
``scripts/record_wrapper_protocol.py 57f0a10 tests/data/protocol/wrapper-57f0a10.json``
from that commit's own code; docs/api.md ("Versions across a pool") says which versions
work together.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from migd.protocol import API_VERSION, decode, encode
from tests.process.conftest import DaemonProcess

pytestmark = pytest.mark.slow

RECORDED = Path(__file__).resolve().parents[1] / "data" / "protocol" / "wrapper-57f0a10.json"


def _exchange(sock_path: Path, request: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(str(sock_path))
        s.sendall(encode(request))
        reply = s.makefile("rb").readline()
    decoded: dict[str, Any] = decode(reply)
    return decoded


def test_an_older_wrappers_requests_are_served_as_it_expects(daemon: DaemonProcess) -> None:
    daemon.config_text = 'version = 1\n[api]\nlease_users = ["*"]\n'
    daemon.start()
    recorded = json.loads(RECORDED.read_text(encoding="utf-8"))
    exchanges = recorded["exchanges"]
    assert [e["request"]["op"] for e in exchanges] == ["lease", "report", "release"] * 2
    lease_ids: dict[str, str] = {}  # recorded lease id -> this daemon's
    for exchange in exchanges:
        request = dict(exchange["request"])
        if "lease_id" in request:
            request["lease_id"] = lease_ids[request["lease_id"]]
        reply = _exchange(daemon.socket_path, request)
        assert reply["ok"] is True, (request, reply)
        assert reply["version"] == API_VERSION == request["version"]
        assert reply["id"] == request["id"]
        result = reply["result"]
        if request["op"] == "lease":
            # what the old wrapper reads from a grant (migd/wrapper/runner.py at 57f0a10):
            # lease["lease_id"], int(lease["memory_limit_mib"]), lease["env"] for the job,
            # lease["mode"] for the restart ladder, lease["profile"]/["gpu"] for its message
            assert isinstance(result["lease_id"], str)
            assert isinstance(result["memory_limit_mib"], int)
            assert result["memory_limit_mib"] >= request["gpu_memory_mib"]
            assert isinstance(result["env"], dict) and result["env"], result
            assert result["mode"] in ("mig", "mps")
            assert "profile" in result and "gpu" in result
            lease_ids[exchange["reply"]["result"]["lease_id"]] = result["lease_id"]
    # each lease the old wrapper took was released by it: none is left active
    leases = daemon.client().call("leases")
    assert not [x for x in leases["leases"] if x["state"] in ("active", "preparing")], leases


def test_a_request_field_this_daemon_does_not_know_is_refused_by_name(
    daemon: DaemonProcess,
) -> None:
    # A wrapper newer than the daemon (the seconds between dpkg unpacking a new wrapper
    # and the postinst restarting migd) that sent a new field would be refused, saying
    # which: the wire format adds request fields only with a new API version (docs/api.md).
    daemon.config_text = 'version = 1\n[api]\nlease_users = ["*"]\n'
    daemon.start()
    request = {
        "version": 1,
        "id": 1,
        "op": "lease",
        "job_id": "x",
        "gpu_memory_mib": 1024,
        "mode": "auto",
        "from_the_future": True,
    }
    reply = _exchange(daemon.socket_path, request)
    assert reply["ok"] is False
    assert reply["error"]["code"] == "protocol_error", reply
    assert "from_the_future" in json.dumps(reply["error"]), reply
