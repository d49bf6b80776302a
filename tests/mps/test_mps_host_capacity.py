"""Issue 13 defect 7: an MPS-in-MIG host's pool is as large as NVML says its MIG device is."""

from __future__ import annotations

from migd.backends.simulated import simulated_backend
from migd.core.planner import CreateOp
from migd.core.policy import SchedulerPolicy
from migd.core.scheduler import NodeScheduler

from .test_mps_in_mig_scheduler import lease, mig_gpu

# What NVML reports for a 1g.5gb MIG device in this test (nominal: 4864 MiB on A100-40GB).
REPORTED_MIB = 4608


def test_the_backend_reports_the_mig_devices_nvml_total_not_the_profile_size() -> None:
    backend, _node = simulated_backend(
        '[[gpu]]\nmodel = "A100-40GB"\nmig_memory_mib = {"1g.5gb" = 4608}\n'
    )
    created = backend.create_instance(0, 19, 0)
    assert created.memory_total_mib == REPORTED_MIB
    (listed,) = backend.list_instances(0)
    assert listed.memory_total_mib == REPORTED_MIB


def test_the_host_pool_takes_the_reported_total_once_the_instance_exists() -> None:
    gpu = mig_gpu(mps_in_mig=True)
    node = NodeScheduler([gpu], SchedulerPolicy(mps_reserve_mib=512))
    out = node.submit(lease("a", 1500), 0.0, 0.0)
    (work,) = out.work
    (create,) = [op for op in work.ops if isinstance(op, CreateOp)]
    nominal = create.profile.memory_mib
    assert nominal > REPORTED_MIB
    node.work_done(work, {create.start: (7, "MIG-host", REPORTED_MIB)}, 1.0, 1.0)
    (host,) = gpu.instances
    assert host.mps_pool is not None
    assert host.mps_pool.memory_total_mib == REPORTED_MIB
    assert host.mps_pool.capacity_mib == REPORTED_MIB - 512


def test_a_host_restored_after_a_restart_keeps_the_reported_total() -> None:
    from migd.core.leases import Lease, LeaseRequest

    gpu = mig_gpu(mps_in_mig=True)
    node = NodeScheduler([gpu])
    profile = gpu.space.member("1g.5gb")  # type: ignore[union-attr]
    node.resync(
        0,
        [(profile, 6, 13, "MIG-host", REPORTED_MIB)],
        {"MIG-host"},
        1.0,
        read_at=node.books_version(0),
    )
    share = Lease(
        "a",
        LeaseRequest("job", 1000, mode="mps"),
        1000,
        1,
        0.0,
        mode="mps",
        gpu=0,
        start=6,
        mig_uuid="MIG-host",
        memory_limit_mib=1000,
    )
    node.leases[share.lease_id] = share
    assert node.restore_mps_share(gpu, share)
    (host,) = gpu.instances
    assert host.mps_pool is not None and host.mps_pool.memory_total_mib == REPORTED_MIB
