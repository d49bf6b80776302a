"""Issue 25: the MPS v3 path used by MPS leases (a job cgroup's hard limit, behind
detection), and the client cap seen at a refusal lowering a device's capacity."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from migd.api import LeaseRequestMsg
from migd.backends.mps.dmem import NvmlCgroupLimits
from migd.backends.simulated import simulated_backend
from migd.backends.simulated.dmem import SimDmemNvml
from migd.core.gpus import ManagedGpu, MpsState
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.mps import (
    MPS_V3_RECHECK_S,
    CgroupLimitAction,
    CgroupLimitBook,
    CgroupSupport,
    DeviceKind,
    MpsPool,
    MpsRequest,
    admit,
    can_admit,
    cgroup_limit_decision,
    job_cgroup_problem,
    observe_client_cap,
)
from migd.core.scheduler import NodeScheduler
from migd.daemon.config import MigdConfig
from migd.daemon.supervision.mps import MpsSupervisor, ShareRelease
from migd.errors import GpuError
from migd.ports import CgroupMemoryLimit, ManualClock
from migd.wrapper.cgroup import own_cgroup

JOB = "/htcondor/condor_var_lib_condor_execute_slot1_1@node"


# -- the decision -------------------------------------------------------------------------


def decide(clock: ManualClock, support: CgroupSupport | None, **kw: Any) -> CgroupLimitAction:
    args: dict[str, Any] = {
        "setting": "auto",
        "support": support,
        "now_s": clock.monotonic(),
        "cgroup": JOB,
        "kind": DeviceKind.GPU,
        "hard_mib": 4096,
        "device_mib": 81559,
    }
    return cgroup_limit_decision(**(args | kw)).action


def test_detection_is_asked_first_then_holds_for_the_recheck_interval() -> None:
    clock = ManualClock()
    assert decide(clock, None) is CgroupLimitAction.DETECT
    seen = CgroupSupport(None, clock.monotonic())
    assert decide(clock, seen) is CgroupLimitAction.APPLY
    clock.advance(MPS_V3_RECHECK_S - 1)
    assert decide(clock, seen) is CgroupLimitAction.APPLY
    clock.advance(1)
    assert decide(clock, seen) is CgroupLimitAction.DETECT
    # A wall-clock step does not touch it (monotonic time only).
    clock.step_wall(-3600)
    fresh = CgroupSupport("driver 580.159.04 is older than r615", clock.monotonic())
    got = cgroup_limit_decision(
        setting="auto",
        support=fresh,
        now_s=clock.monotonic(),
        cgroup=JOB,
        kind=DeviceKind.GPU,
        hard_mib=4096,
        device_mib=81559,
    )
    assert got.action is CgroupLimitAction.SKIP and "older than r615" in got.reason


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"setting": "off"}, "mps.cgroup_limits = off"),
        ({"kind": DeviceKind.MIG}, "non-MIG device"),
        ({"cgroup": None}, "named no job cgroup"),
        ({"hard_mib": 90000}, "within the device"),
    ],
)
def test_each_reason_to_keep_the_pinned_limit_only_is_named(kw: dict[str, Any], why: str) -> None:
    clock = ManualClock()
    got = cgroup_limit_decision(
        **(
            {
                "setting": "auto",
                "support": CgroupSupport(None, clock.monotonic()),
                "now_s": clock.monotonic(),
                "cgroup": JOB,
                "kind": DeviceKind.GPU,
                "hard_mib": 4096,
                "device_mib": 81559,
            }
            | kw
        )
    )
    assert got.action is CgroupLimitAction.SKIP and why in got.reason


# -- the job cgroup: wrapper and API ------------------------------------------------------


def test_the_wrapper_sends_its_cgroup_v2_path_and_nothing_else() -> None:
    assert own_cgroup(f"0::{JOB}\n") == JOB
    hybrid = f"4:memory:/x\n1:cpu:/\n0::{JOB}\n"
    assert own_cgroup(hybrid) == JOB
    assert own_cgroup("4:memory:/x\n1:cpu:/\n") is None  # cgroup v1 only
    assert own_cgroup("0::/\n") is None  # the root cgroup is no job's
    assert own_cgroup("0::/a/../b\n") is None
    assert own_cgroup("") is None


@pytest.mark.parametrize(
    "bad", ["relative/path", "/", "/a/../etc", "/a/./b", "/a//b", "/a\n", "/" + "x" * 5000]
)
def test_the_lease_request_refuses_a_cgroup_that_could_name_something_else(bad: str) -> None:
    assert job_cgroup_problem(bad) is not None
    with pytest.raises(ValidationError):
        LeaseRequestMsg.model_validate(
            {"version": 1, "op": "lease", "job_id": "j", "gpu_memory_mib": 1, "cgroup": bad}
        )


def test_an_older_wrapper_without_the_field_still_gets_its_lease() -> None:
    msg = LeaseRequestMsg.model_validate(
        {"version": 1, "op": "lease", "job_id": "j", "gpu_memory_mib": 1}
    )
    assert msg.cgroup is None
    msg = LeaseRequestMsg.model_validate(
        {"version": 1, "op": "lease", "job_id": "j", "gpu_memory_mib": 1, "cgroup": JOB}
    )
    assert msg.cgroup == JOB


# -- the stand-in refuses what NVIDIA documents --------------------------------------------


@pytest.fixture
def cgroups(tmp_path: Path) -> Path:
    (tmp_path / "cgroup.controllers").write_text("cpu memory dmem\n")
    job = tmp_path / JOB.lstrip("/")
    job.mkdir(parents=True)
    (job / "cgroup.procs").write_text("")
    return tmp_path


def test_the_node_stand_in_refuses_mig_v1_missing_paths_and_limits_above_the_device(
    cgroups: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _backend, node = simulated_backend(
        'driver_version = "615.10.01"\n[[gpu]]\nmodel = "A100-40GB"\nmig = false\n'
        '[[gpu]]\nmodel = "A100-40GB"\nmig = true\n'
    )
    nvml = SimDmemNvml(node=node, cgroup_root=cgroups)
    limits = NvmlCgroupLimits(nvml, cgroup_root=cgroups)
    job = str(cgroups / JOB.lstrip("/"))
    assert limits.support(0) is None
    assert "MIG" in (limits.support(1) or "")
    limits.set_limit(0, job, 40000)
    with pytest.raises(GpuError):  # MIG: "MIG handles are not supported"
        limits.set_limit(1, job, 4096)
    with pytest.raises(GpuError):  # above the A100-40GB's 40960 MiB
        limits.set_limit(0, job, 40961)
    with pytest.raises(GpuError):  # no such cgroup
        limits.set_limit(0, str(cgroups / "htcondor" / "gone"), 4096)
    outside = tmp_path_factory.mktemp("elsewhere")
    (outside / "cgroup.procs").write_text("")
    with pytest.raises(GpuError):  # not under the cgroup root
        limits.set_limit(0, str(outside), 4096)
    v1 = tmp_path_factory.mktemp("v1")
    (v1 / "job").mkdir()
    (v1 / "job" / "cgroup.procs").write_text("")
    with pytest.raises(GpuError):  # "requires cgroup v2"
        NvmlCgroupLimits(SimDmemNvml(node=node, cgroup_root=v1)).set_limit(0, str(v1 / "job"), 4096)
    assert [c[0] for c in nvml.calls] == ["set"]


# -- the supervisor applies and clears it -------------------------------------------------


class SpyLimits:
    def __init__(self, support: str | None, fail: bool = False) -> None:
        self.answer, self.fail = support, fail
        self.calls: list[tuple[Any, ...]] = []

    def support(self, gpu: int) -> str | None:
        self.calls.append(("support", gpu))
        return self.answer

    def set_limit(self, gpu: int, cgroup: str, hard_mib: int, soft_mib: int = 0) -> None:
        self.calls.append(("set", gpu, cgroup, hard_mib))
        if self.fail:
            raise GpuError(f"NVML refused cgroup {cgroup}")

    def get_limit(self, gpu: int, cgroup: str) -> CgroupMemoryLimit:
        raise AssertionError("not used")

    def clear_limit(self, gpu: int, cgroup: str) -> None:
        self.calls.append(("clear", gpu, cgroup))


class InlineExecutor:
    async def on_gpu(self, gpu: int, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def run_detached(self, gpu: int, fn: Any, *args: Any) -> None:
        fn(*args)


def supervisor(port: SpyLimits | None, setting: str = "auto") -> tuple[MpsSupervisor, Any]:
    config = MigdConfig.model_validate(
        {"mps": {"cgroup_limits": setting, "cgroup_root": "/sys/fs/cgroup"}}
    )
    gpu = ManagedGpu(0, "GPU-x", "H100-80GB", "NVIDIA H100", 81559, MpsState())
    ctx: Any = SimpleNamespace(
        config=config,
        clock=ManualClock(),
        cgroup_limits=port,
        cgroup_book=CgroupLimitBook(),
        notes=[],
        sched=SimpleNamespace(gpus={0: gpu}),
        mps=None,
    )
    recorded: list[tuple[str, dict[str, Any]]] = []
    leases: Any = SimpleNamespace(record=lambda event, lease, **kw: recorded.append((event, kw)))
    sup = MpsSupervisor(ctx, InlineExecutor(), leases)  # type: ignore[arg-type]
    return sup, recorded


def mps_lease(lease_id: str = "L1", clients: int = 2) -> Lease:
    lease = Lease(lease_id, LeaseRequest("j", 2048, mode="mps", mps_clients=clients), 1000, 1, 0.0)
    lease.gpu = 0
    lease.state = LeaseState.ACTIVE
    return lease


def share(lease: Lease) -> MpsRequest:
    return MpsRequest(lease.lease_id, 1000, 2048, clients=lease.request.mps_clients)


def test_a_supported_gpu_gets_the_shares_whole_memory_on_the_job_cgroup_and_it_is_cleared() -> None:
    port = SpyLimits(None)
    sup, recorded = supervisor(port)
    lease = mps_lease()
    asyncio.run(sup.limit_cgroup(lease, share(lease), "GPU-x", JOB))
    # limit x clients, as the books count it: the cgroup holds all the job's processes.
    assert port.calls == [("support", 0), ("set", 0, f"/sys/fs/cgroup{JOB}", 4096)]
    assert recorded == [("mps.cgroup_limit", {"cgroup": f"/sys/fs/cgroup{JOB}", "hard_mib": 4096})]
    book = sup.ctx.cgroup_book
    assert book.device_status("GPU-x", setting="auto", kind=DeviceKind.GPU)["in_force"]
    # A second lease within the recheck interval is not detected again.
    second = mps_lease("L2", clients=1)
    asyncio.run(sup.limit_cgroup(second, share(second), "GPU-x", JOB + "_2"))
    assert [c[0] for c in port.calls] == ["support", "set", "set"]
    ShareRelease(sup.ctx, sup.executor)(0, "GPU-x", "L1")
    ShareRelease(sup.ctx, sup.executor)(0, "GPU-x", "L2")
    assert port.calls[-2:] == [
        ("clear", 0, f"/sys/fs/cgroup{JOB}"),
        ("clear", 0, f"/sys/fs/cgroup{JOB}_2"),
    ]
    status = book.device_status("GPU-x", setting="auto", kind=DeviceKind.GPU)
    assert status["in_force"] is False and status["leases"] == 0


def test_an_unsupported_driver_makes_no_call_and_says_why() -> None:
    port = SpyLimits("driver 580.159.04 is older than r615 (MPS v3 ...)")
    sup, recorded = supervisor(port)
    lease = mps_lease()
    asyncio.run(sup.limit_cgroup(lease, share(lease), "GPU-x", JOB))
    assert port.calls == [("support", 0)] and recorded == []
    status = sup.ctx.cgroup_book.device_status("GPU-x", setting="auto", kind=DeviceKind.GPU)
    assert status["in_force"] is False and "older than r615" in status["why_not"]
    ShareRelease(sup.ctx, sup.executor)(0, "GPU-x", "L1")
    assert port.calls == [("support", 0)]


def test_a_refused_limit_is_a_note_never_a_failed_lease() -> None:
    port = SpyLimits(None, fail=True)
    sup, recorded = supervisor(port)
    lease = mps_lease()
    asyncio.run(sup.limit_cgroup(lease, share(lease), "GPU-x", JOB))
    assert recorded == [] and "keep their pinned limit" in sup.ctx.notes[-1]
    second = mps_lease("L2")
    asyncio.run(sup.limit_cgroup(second, share(second), "GPU-x", JOB))
    assert len(sup.ctx.notes) == 1  # one note per device and cause, not one per lease
    status = sup.ctx.cgroup_book.device_status("GPU-x", setting="auto", kind=DeviceKind.GPU)
    assert "NVML refused" in status["why_not"]


def test_switched_off_or_an_older_wrapper_asks_nothing() -> None:
    port = SpyLimits(None)
    sup, _ = supervisor(port, setting="off")
    lease = mps_lease()
    asyncio.run(sup.limit_cgroup(lease, share(lease), "GPU-x", JOB))
    sup2, _ = supervisor(port)
    asyncio.run(sup2.limit_cgroup(lease, share(lease), "GPU-x", None))
    assert port.calls == []


# -- the client cap seen at a refusal -------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    configured=st.integers(1, 60),
    seen=st.lists(st.integers(0, 70), min_size=1, max_size=5),
    held=st.integers(0, 10),
)
def test_an_observed_cap_only_lowers_and_the_books_never_pass_it(
    configured: int, seen: list[int], held: int
) -> None:
    pool = MpsPool("GPU-x", 81559, max_clients=configured)
    for n in range(min(held, configured)):
        pool = admit(pool, MpsRequest(f"s{n}", 1000, 64))
    for count in seen:
        before = pool.max_clients
        pool = observe_client_cap(pool, count)
        assert pool.max_clients <= before
        assert observe_client_cap(pool, count) is pool  # idempotent
    cap = min([configured, *(max(1, c) for c in seen)])
    assert pool.max_clients == cap and pool.clients_cap_seen == min(max(1, c) for c in seen)
    assert MpsPool.from_dict(pool.to_dict()) == pool
    # One more client than the cap allows now waits (or goes elsewhere); never admitted.
    extra = MpsRequest("next", 1000, 64, clients=max(1, cap - pool.clients + 1))
    if extra.clients <= cap:
        assert not can_admit(pool, extra).ok


def test_the_scheduler_places_the_next_lease_within_the_seen_cap() -> None:
    gpus = [
        ManagedGpu(i, f"GPU-{i}", "H100-80GB", "NVIDIA H100", 81559, MpsState()) for i in (0, 1)
    ]
    node = NodeScheduler(gpus)
    for n in range(3):
        out = node.submit(
            Lease(f"a{n}", LeaseRequest("j", 1024, mode="mps", gpu_uuids=("GPU-0",)), 1000, 1, 0.0),
            0.0,
            0.0,
        )
        assert out.refusal is None
    assert node.observe_mps_client_cap("GPU-0", 3)
    assert not node.observe_mps_client_cap("GPU-0", 3)
    assert node.mps_pool(gpus[0]).max_clients == 3
    later = Lease("b", LeaseRequest("j", 1024, mode="mps", wait_s=60.0), 1000, 1, 0.0)
    node.submit(later, 1.0, 1.0)
    assert later.gpu == 1  # GPU 0 refused its 4th client: the lease goes to GPU 1


def test_an_mps_share_inside_a_mig_device_keeps_the_pinned_limit_only() -> None:
    port = SpyLimits(None)
    sup, recorded = supervisor(port)
    lease = mps_lease()
    asyncio.run(sup.limit_cgroup(lease, share(lease), "MIG-4f1c", JOB))
    assert port.calls == [] and recorded == []
    status = sup.ctx.cgroup_book.device_status("MIG-4f1c", setting="auto", kind=DeviceKind.MIG)
    assert status["in_force"] is False and "non-MIG device" in status["why_not"]


def test_the_housekeeping_round_lowers_a_device_to_the_cap_it_showed() -> None:
    """The MPS manager's ``clients_at_refusal`` (a refusal with clients running) reaches the
    books after a housekeeping round: the pool takes no more clients than that."""
    gpu = ManagedGpu(0, "GPU-0", "T4", "Tesla T4", 15360, MpsState())
    node = NodeScheduler([gpu])
    node.submit(Lease("a", LeaseRequest("j", 512, mode="mps"), 1000, 1, 0.0), 0.0, 0.0)
    seen: dict[str, list[dict[str, Any]]] = {"GPU-0": [{"clients_at_refusal": None}]}
    mps: Any = SimpleNamespace(cached_status_for=lambda uuid: seen.get(uuid, []))
    ctx: Any = SimpleNamespace(sched=node, notes=[])
    sup = MpsSupervisor(ctx, None, None)  # type: ignore[arg-type]
    sup.apply_client_caps(mps)
    assert node.mps_pool(gpu).max_clients == 48 and ctx.notes == []
    seen["GPU-0"] = [{"clients_at_refusal": 21}]  # a T4 that refused at 21 (k8s-device-plugin#1118)
    sup.apply_client_caps(mps)
    sup.apply_client_caps(mps)
    pool = node.mps_pool(gpu)
    assert (pool.max_clients, pool.clients_cap_seen) == (21, 21)
    assert len(ctx.notes) == 1 and "at most 21 client processes" in ctx.notes[0]


def test_a_lease_released_while_its_limit_was_being_set_has_it_cleared_at_once() -> None:
    port = SpyLimits(None)
    sup, recorded = supervisor(port)
    lease = mps_lease()
    lease.state = LeaseState.RELEASED
    asyncio.run(sup.limit_cgroup(lease, share(lease), "GPU-x", JOB))
    assert [c[0] for c in port.calls] == ["support", "set", "clear"] and recorded == []
    assert sup.ctx.cgroup_book.applied == {}
