"""CUDA-like workloads on the simulated node, seen through NvmlBackend."""

from __future__ import annotations

import pytest
from sim_support import Sim, SleepRecorder

from migd.backends.nvml import NvmlBackend, nvml_errors
from migd.backends.simulated import FakePynvml, SimCudaError, SimOutOfMemory
from migd.backends.simulated import nvml_api as api
from migd.backends.simulated.hardware import IDLE_USED_MIB, MIG_IDLE_USED_MIB
from migd.core import catalog
from migd.errors import GpuBusy, GpuNotFound, GpuUnsupported
from migd.ports import MemoryInfo


def test_oom_exactly_past_the_mig_device_memory(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB")
    made = backend.create_instance(0, 19, 3)  # 1g.5gb
    assert made.uuid is not None
    size_mib = catalog.geometry("A100-40GB").by_id(19).memory_mib
    reserved = MIG_IDLE_USED_MIB  # what the driver holds on an idle MIG device
    assert backend.memory(0, made.uuid) == MemoryInfo(total_mib=size_mib, used_mib=reserved)
    node.attach(100, made.uuid)
    node.attach(101, made.uuid)  # two processes share the instance's memory
    node.alloc(100, size_mib - reserved - 10)
    node.alloc(101, 10)  # exactly full: fits
    with pytest.raises(SimOutOfMemory, match=r"^CUDA error: out of memory") as caught:
        node.alloc(101, 1)
    assert (caught.value.limit_mib, caught.value.used_mib) == (size_mib, size_mib)
    assert backend.memory(0, made.uuid) == MemoryInfo(total_mib=size_mib, used_mib=size_mib)
    node.free(100, 1)
    node.alloc(101, 1)


def test_oom_at_the_mps_pinned_limit_per_client(sim: Sim) -> None:
    backend, node = sim("1xH100-80GB")
    made = backend.create_instance(0, 9, 0)  # 3g.40gb
    assert made.uuid is not None
    node.attach(200, made.uuid, mps_pinned_limit_mib=1000)
    node.attach(201, made.uuid, mps_pinned_limit_mib=1000)
    node.alloc(200, 1000)
    with pytest.raises(SimOutOfMemory, match="MPS pinned-memory limit"):
        node.alloc(200, 1)
    node.alloc(201, 1000)  # the limit is per client, not per instance
    assert backend.memory(0, made.uuid).used_mib == 2000 + MIG_IDLE_USED_MIB


def test_oom_past_a_whole_non_mig_gpu(sim: Sim) -> None:
    backend, node = sim("1xV100-32GB")
    idle = backend.memory(0)
    assert idle.used_mib == IDLE_USED_MIB  # the driver's own, before any process
    node.attach(300, node.gpu(0).uuid)
    node.alloc(300, idle.free_mib)
    with pytest.raises(SimOutOfMemory):
        node.alloc(300, 1)
    assert backend.memory(0).free_mib == 0


def test_cuda_cannot_use_the_parent_of_a_mig_gpu_or_unknown_devices(sim: Sim) -> None:
    _backend, node = sim("1xA100-40GB")
    with pytest.raises(SimCudaError, match="MIG mode"):
        node.attach(1, node.gpu(0).uuid)
    with pytest.raises(SimCudaError, match="invalid device"):
        node.attach(1, "MIG-does-not-exist")
    with pytest.raises(ValueError, match="no CUDA context"):
        node.alloc(1, 1)


def test_processes_are_visible_with_their_memory(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB")
    a = backend.create_instance(0, 9, 0)
    b = backend.create_instance(0, 14, 4)
    assert a.uuid is not None and b.uuid is not None
    node.attach(10, a.uuid)
    node.alloc(10, 1500)
    node.attach(11, b.uuid, mps_pinned_limit_mib=4096)  # an MPS client
    node.alloc(11, 300)
    everything = backend.processes(0)
    assert [(p.pid, p.used_mib, p.mig_uuid, p.gpu) for p in everything] == [
        (10, 1500, a.uuid, 0),
        (11, 300, b.uuid, 0),
    ]
    assert [p.pid for p in backend.processes(0, a.uuid)] == [10]
    assert [p.pid for p in backend.processes(0, b.uuid)] == [11]
    assert backend.memory(0).used_mib == 1800 + 2 * MIG_IDLE_USED_MIB  # two instances
    node.detach(10)
    assert [p.pid for p in backend.processes(0)] == [11]


def test_destroy_with_a_process_attached_is_busy_until_it_exits(
    sim: Sim, sleeps: SleepRecorder
) -> None:
    backend, node = sim("1xA100-40GB")
    made = backend.create_instance(0, 9, 4)
    assert made.uuid is not None
    node.attach(4242, made.uuid)
    with pytest.raises(GpuBusy, match="processes 4242") as caught:
        backend.destroy_instance(0, made.gi_id)
    assert caught.value.details["pids"] == [4242]
    assert sleeps.waits == [0.2, 0.4, 0.8]  # three retries, doubling
    assert node.placements(0) == {(9, 4)}
    node.detach(4242)
    backend.destroy_instance(0, made.gi_id)
    assert node.placements(0) == frozenset()


def test_injected_in_use_and_a_lost_gpu_surface_to_workloads_and_backend(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB", destroy_retries=0)
    made = backend.create_instance(0, 14, 2)
    assert made.uuid is not None
    node.attach(5, made.uuid)
    node.fail_next("nvmlDeviceGetComputeRunningProcesses", api.NVML_ERROR_IN_USE)
    with pytest.raises(GpuBusy):
        backend.processes(0, made.uuid)
    node.lose_gpu(0)
    with pytest.raises(SimCudaError, match="lost"):
        node.alloc(5, 1)
    with pytest.raises(GpuNotFound):
        backend.processes(0, made.uuid)
    with pytest.raises(GpuNotFound):
        backend.heartbeat(0)


def test_an_older_driver_is_still_driven_through_older_entry_points(sim: Sim) -> None:
    _backend, node = sim("1xA100-40GB")
    backend = NvmlBackend(FakePynvml(node, legacy_driver=True))
    geometry = backend.geometry(0)
    assert sorted(p.profile_id for p in geometry.profiles) == sorted(
        p.profile_id for p in catalog.geometry("A100-40GB").profiles
    )
    made = backend.create_instance(0, 9, 0)
    assert made.uuid is not None
    node.attach(9, made.uuid)
    node.alloc(9, 64)
    assert [(p.pid, p.used_mib) for p in backend.processes(0)] == [(9, 64)]
    assert node.call_counts["nvmlDeviceGetComputeRunningProcesses_v2"] == 1


def test_a_library_mismatch_elsewhere_is_gpu_unsupported() -> None:
    with pytest.raises(GpuUnsupported, match="older than this pynvml call"), nvml_errors("x"):
        raise api.NVMLLibraryMismatchError("use a versioned function")
