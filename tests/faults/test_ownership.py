"""Items 10 and 11: sim_* ownership, and what another user sees of a lease."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests.faults.clients import (
    USER_A,
    USER_B,
    call_as,
    mentions,
    sleeper_of,
)
from tests.process.conftest import DaemonProcess

pytestmark = pytest.mark.slow


# -- 10. simulated CUDA work checks ownership ----------------------------------------------------


def test_sim_operations_check_ownership(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    daemon.extra_args += ["--set", 'api.lease_users=["*"]']
    daemon.start()
    a_holder, a_cuda = sleeper_of(USER_A, sleepers), sleeper_of(USER_A, sleepers)
    b_cuda = sleeper_of(USER_B, sleepers)
    granted = call_as(
        daemon, USER_A, "lease", job_id="10.0", gpu_memory_mib=4000, wait_s=10, holder_pid=a_holder
    )
    assert granted["ok"], granted
    mig = granted["result"]["mig_uuid"]
    assert call_as(daemon, USER_A, "sim_attach", pid=a_cuda, device_uuid=mig)["ok"]
    assert call_as(daemon, USER_A, "sim_alloc", pid=a_cuda, mib=100)["ok"]
    refused = [
        call_as(daemon, USER_B, "sim_attach", pid=b_cuda, device_uuid=mig),
        call_as(daemon, USER_B, "sim_alloc", pid=a_cuda, mib=100),
        call_as(daemon, USER_B, "sim_free", pid=a_cuda, mib=100),
        call_as(daemon, USER_B, "sim_detach", pid=a_cuda),
        call_as(daemon, USER_B, "sim_attach", pid=a_cuda, device_uuid=mig),
    ]
    for outcome in refused:
        assert outcome == {**outcome, "ok": False, "code": "not_authorized"}, outcome
    assert call_as(daemon, USER_A, "sim_detach", pid=a_cuda)["ok"]


# -- 11. what a non-owner sees -------------------------------------------------------------------


def test_another_users_lease_device_is_not_shown(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    daemon.extra_args += ["--set", 'api.lease_users=["*"]']
    daemon.start()
    holder = sleeper_of(USER_A, sleepers)
    granted = call_as(
        daemon, USER_A, "lease", job_id="11.0", gpu_memory_mib=4000, wait_s=10, holder_pid=holder
    )
    assert granted["ok"], granted
    mig = granted["result"]["mig_uuid"]
    lease_id = granted["result"]["lease_id"]
    reads: list[tuple[str, dict[str, Any]]] = [
        ("leases", {}),
        ("leases", {"all": True}),
        ("explain", {"job_id": "11.0"}),
        ("history", {"job_id": "11.0"}),
        ("status", {}),
    ]
    for op, fields in reads:
        other = call_as(daemon, USER_B, op, **fields)
        assert other["ok"], other
        assert mentions(other["result"], lease_id), (op, "the lease itself stays visible")
        assert not mentions(other["result"], mig), (op, other["result"])
        assert mentions(call_as(daemon, USER_A, op, **fields)["result"], mig), op
        assert mentions(daemon.client().call(op, **fields), mig), op  # root: an admin
