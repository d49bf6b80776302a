"""A wrapper newer than the daemon it talks to (a package upgrade replaces the wrapper before
migd restarts): the ``cgroup`` field an older daemon refuses as unknown costs the job
nothing, the request is made again without it; any other refusal stays a refusal."""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest

import migd.wrapper.leasing as leasing_module
from migd.errors import ProtocolError
from migd.wrapper.jobspec import spec_from_flags
from migd.wrapper.leasing import WrapperFailure
from migd.wrapper.runner import JobRunner
from migd.wrapper.settings import WrapperSettings
from migd.wrapper_options import WrapperOptions

OLD_DAEMONS_REFUSAL = "invalid lease request: cgroup: Extra inputs are not permitted"


class OlderDaemon:
    """Refuses what its API does not know, as pydantic's ``extra="forbid"`` does."""

    def __init__(self, refusal: str = OLD_DAEMONS_REFUSAL) -> None:
        self.refusal = refusal
        self.requests: list[dict[str, Any]] = []

    def lease(self, **request: Any) -> dict[str, Any]:
        self.requests.append(request)
        if "cgroup" in request:
            raise ProtocolError(self.refusal)
        return {
            "lease_id": "L1",
            "gpu": 0,
            "gpu_uuid": "GPU-0",
            "mode": "mig",
            "profile": "1g.5gb",
            "memory_limit_mib": 4864,
            "env": {},
        }

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        if op == "get_lease":
            return {"state": "active"}
        if op == "usage":
            return {"peak_used_mib": None, "device_used_mib": None}
        return {}

    def status(self) -> dict[str, Any]:
        return {"gpus": []}

    def release(self, lease_id: str, reason: str) -> dict[str, Any]:
        return {"state": "released", "peak_used_mib": None}


def run_job(daemon: OlderDaemon) -> int:
    spec = spec_from_flags(
        [sys.executable, "-c", "pass"], gpu_memory="3G", job_id="5.0", max_restarts=0
    )
    runner = JobRunner(
        spec,
        daemon,  # type: ignore[arg-type]
        settings=WrapperSettings(WrapperOptions(sample_interval_s=0.05)),
        err=io.BytesIO(),
    )
    return runner.run()


@pytest.fixture(autouse=True)
def in_a_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leasing_module, "own_cgroup", lambda: "/htcondor/condor_slot1_1")


def test_a_daemon_older_than_the_cgroup_field_is_asked_again_without_it() -> None:
    daemon = OlderDaemon()
    assert run_job(daemon) == 0
    first, second = daemon.requests
    assert first["cgroup"] == "/htcondor/condor_slot1_1" and "cgroup" not in second
    assert {k: v for k, v in first.items() if k != "cgroup"} == second


def test_any_other_protocol_refusal_is_not_retried() -> None:
    daemon = OlderDaemon(refusal="invalid lease request: gpu_memory_mib: too large")
    with pytest.raises(WrapperFailure, match="gpu_memory_mib: too large"):
        run_job(daemon)
    assert len(daemon.requests) == 1
