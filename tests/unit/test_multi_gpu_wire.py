"""Several GPUs per job, at the edges: what the job ad and ``migd-run`` flags ask for,
what goes on the wire (and what an older daemon or wrapper sees), and how the
members' environments combine."""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest

import migd.wrapper.leasing as leasing_module
from migd.api import LeaseRequestMsg, decode_request
from migd.core.groups import merge_environments
from migd.core.leases import Lease, LeaseRequest
from migd.errors import InvalidRequest, ProtocolError
from migd.protocol import encode
from migd.wrapper.jobspec import spec_from_ads, spec_from_flags
from migd.wrapper.leasing import WrapperFailure
from migd.wrapper.runner import JobRunner
from migd.wrapper.settings import WrapperSettings
from migd.wrapper_options import WrapperOptions

AD = {"GlobalJobId": "ap#7.0#1", "RequestVRAM": 4096}


def share(gpu: str, n: int) -> str:
    return f"GPU-s{n:02d}-{gpu}"


def test_request_gpus_two_gives_two_members_on_the_assigned_gpus() -> None:
    spec = spec_from_ads(
        ["job"],
        {**AD, "RequestGPUs": 2},
        {"AssignedGPUs": f"{share('aaaa1111', 1)},{share('bbbb2222', 3)}"},
    )
    assert spec.gpu_count == 2
    assert spec.gpus == ("GPU-aaaa1111", "GPU-bbbb2222")
    assert spec.memory_mib == 4096  # per GPU, as gpus_minimum_memory means it


def test_two_shares_of_one_gpu_keep_both_members_there() -> None:
    spec = spec_from_ads(
        ["job"],
        {**AD, "RequestGPUs": 2},
        {"AssignedGPUs": f"{share('aaaa1111', 1)},{share('aaaa1111', 2)}"},
    )
    assert (spec.gpu_count, spec.gpus) == (2, ("GPU-aaaa1111", "GPU-aaaa1111"))


def test_one_gpu_job_is_as_before() -> None:
    spec = spec_from_ads(["job"], {**AD, "RequestGPUs": 1}, {"AssignedGPUs": share("aaaa1111", 1)})
    assert (spec.gpu_count, spec.gpus) == (1, ("GPU-aaaa1111",))


def test_migd_run_gpus_flag() -> None:
    spec = spec_from_flags(["x"], gpu_memory="3G", job_id="j", gpu_count=2)
    assert spec.gpu_count == 2 and spec.gpus is None
    with pytest.raises(InvalidRequest, match="MPS"):
        spec_from_flags(["x"], gpu_memory="3G", job_id="j", gpu_count=2, mode="mps")
    with pytest.raises(InvalidRequest, match="1 to 64"):
        spec_from_flags(["x"], gpu_memory="3G", job_id="j", gpu_count=0)


def test_an_older_wrappers_request_is_one_lease() -> None:
    """A request without gpu_count (every wrapper before it) parses as one GPU."""
    line = encode({"version": 1, "op": "lease", "job_id": "1.0", "gpu_memory_mib": 3072})
    req = decode_request(line)
    assert isinstance(req, LeaseRequestMsg) and req.gpu_count == 1


class Daemon:
    """Answers a lease as the daemon does, or refuses gpu_count as a daemon before it."""

    def __init__(self, *, knows_groups: bool) -> None:
        self.knows_groups = knows_groups
        self.requests: list[dict[str, Any]] = []
        self.released: list[str] = []

    def lease(self, **request: Any) -> dict[str, Any]:
        request = {k: v for k, v in request.items() if v is not None}  # as MigdClient sends
        self.requests.append(request)
        if "gpu_count" in request and not self.knows_groups:
            raise ProtocolError("invalid lease request: gpu_count: Extra inputs are not permitted")
        n = request.get("gpu_count") or 1
        members = [
            {
                "lease_id": f"L{i}",
                "gpu": i,
                "mode": "mig",
                "profile": "1g.5gb",
                "memory_limit_mib": 4864,
            }
            for i in range(n)
        ]
        reply = {**members[0], "env": {"CUDA_VISIBLE_DEVICES": "MIG-0,MIG-1"}}
        if n > 1:
            reply["group"] = members
        return reply

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        if op == "get_lease":
            return {"state": "active"}
        if op == "usage":
            return {"peak_used_mib": None, "device_used_mib": None}
        return {}

    def status(self) -> dict[str, Any]:
        return {"gpus": []}

    def release(self, lease_id: str, reason: str) -> dict[str, Any]:
        self.released.append(lease_id)
        return {"state": "released", "peak_used_mib": None}


def run_job(daemon: Daemon, gpu_count: int) -> int:
    spec = spec_from_flags(
        [sys.executable, "-c", "pass"],
        gpu_memory="3G",
        job_id="5.0",
        max_restarts=0,
        gpu_count=gpu_count,
    )
    runner = JobRunner(
        spec,
        daemon,  # type: ignore[arg-type]
        settings=WrapperSettings(WrapperOptions(sample_interval_s=0.05)),
        err=io.BytesIO(),
    )
    return runner.run()


@pytest.fixture(autouse=True)
def no_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leasing_module, "own_cgroup", lambda: None)


def test_a_one_gpu_request_sends_no_gpu_count() -> None:
    """So an older daemon takes it exactly as before."""
    daemon = Daemon(knows_groups=False)
    assert run_job(daemon, 1) == 0
    assert "gpu_count" not in daemon.requests[0]


def test_a_group_releases_every_member() -> None:
    daemon = Daemon(knows_groups=True)
    assert run_job(daemon, 2) == 0
    assert daemon.requests[0]["gpu_count"] == 2
    assert sorted(daemon.released) == ["L0", "L1"]


def test_an_older_daemon_refuses_a_group_with_a_clear_reason() -> None:
    daemon = Daemon(knows_groups=False)
    with pytest.raises(WrapperFailure, match="too old to give a job 2 GPUs"):
        run_job(daemon, 2)


def lease(n: int, env: dict[str, str]) -> Lease:
    request = LeaseRequest(job_id="j", memory_mib=1)
    return Lease(f"L{n}", request, owner_uid=1, owner_pid=1, created_s=0.0, env=env)


def test_environments_list_every_device_in_order() -> None:
    env = merge_environments(
        [
            lease(0, {"CUDA_VISIBLE_DEVICES": "MIG-a", "NVIDIA_VISIBLE_DEVICES": "MIG-a"}),
            lease(1, {"CUDA_VISIBLE_DEVICES": "MIG-b", "NVIDIA_VISIBLE_DEVICES": "MIG-b"}),
        ]
    )
    assert env == {"CUDA_VISIBLE_DEVICES": "MIG-a,MIG-b", "NVIDIA_VISIBLE_DEVICES": "MIG-a,MIG-b"}


def test_two_mps_servers_cannot_serve_one_process() -> None:
    with pytest.raises(InvalidRequest, match="CUDA_MPS_PIPE_DIRECTORY"):
        merge_environments(
            [
                lease(0, {"CUDA_VISIBLE_DEVICES": "GPU-a", "CUDA_MPS_PIPE_DIRECTORY": "/a"}),
                lease(1, {"CUDA_VISIBLE_DEVICES": "GPU-b", "CUDA_MPS_PIPE_DIRECTORY": "/b"}),
            ]
        )
