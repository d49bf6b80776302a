"""Issue 13: the NVML paths that would break on a first real GPU, and the simulator
behaving like the hardware there (each simulated behaviour is cited in docs/nvml.md)."""

from __future__ import annotations

import logging

import pytest
from sim_support import Sim, SleepRecorder

from migd.backends.simulated import FakePynvml
from migd.backends.simulated import nvml_api as api
from migd.backends.simulated.mig_ops import CI_PROFILE_1_SLICE_REV1
from migd.core import catalog
from migd.errors import GpuBusy

# 1g.5gb on an A100-40GB (nvidia-smi mig -lgip: ID 19).
A100_1G = 19


# -- defect 3: the duplicate 1-slice compute instance profile -----------------------------


def test_the_simulator_reports_the_rev1_ci_profile_as_a_duplicate_of_the_1_slice_one(
    sim: Sim,
) -> None:
    backend, node = sim("1xA100-40GB")
    backend.create_instance(0, A100_1G, 0)
    nvml = FakePynvml(node)
    nvml.nvmlInit()
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    (gi_id,) = (i.gi_id for i in node.instances(0))
    gi = nvml.nvmlDeviceGetGpuInstanceById(gpu, gi_id)
    shared = api.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    plain = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 0, shared)
    rev1 = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, CI_PROFILE_1_SLICE_REV1, shared)
    assert (rev1.id, rev1.sliceCount) == (plain.id, plain.sliceCount) == (0, 1)


def test_each_compute_instance_is_listed_once_and_destroyed_once(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB")
    created = backend.create_instance(0, A100_1G, 0)
    (listed,) = backend.list_instances(0)
    assert [ci.uuid for ci in listed.compute_instances] == [created.uuid]
    backend.destroy_instance(0, created.gi_id)
    assert backend.list_instances(0) == []
    assert node.instances(0) == []


# -- defects 4 and 5: persistence and compute mode are read at discovery --------------------


def test_discovery_reports_persistence_and_compute_mode(sim: Sim) -> None:
    backend, _node = sim(
        '[[gpu]]\nmodel = "A100-40GB"\n'
        '[[gpu]]\nmodel = "H100-80GB"\npersistence_mode = false\n'
        'compute_mode = "exclusive_process"\n'
    )
    first, second = backend.discover()
    assert (first.persistence_mode, first.compute_mode) == (True, "DEFAULT")
    assert (second.persistence_mode, second.compute_mode) == (False, "EXCLUSIVE_PROCESS")


def test_persistence_mode_off_is_warned_about_once(
    sim: Sim, caplog: pytest.LogCaptureFixture
) -> None:
    backend, _node = sim('[[gpu]]\nmodel = "A100-40GB"\npersistence_mode = false\n')
    with caplog.at_level(logging.WARNING, logger="migd.backends.nvml"):
        backend.discover()
        backend.discover()
    warnings = [r.getMessage() for r in caplog.records if "persistence mode off" in r.getMessage()]
    assert len(warnings) == 1
    assert "nvidia-persistenced" in warnings[0]


def test_an_unreadable_persistence_or_compute_mode_is_unknown_not_an_error(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB")
    node.fail_next("nvmlDeviceGetPersistenceMode", api.NVML_ERROR_NOT_SUPPORTED)
    node.fail_next("nvmlDeviceGetComputeMode", api.NVML_ERROR_NO_PERMISSION)
    (info,) = backend.discover()
    assert (info.persistence_mode, info.compute_mode) == (None, None)


# -- the simulated GPU where hardware is less kind (issue 13) ------------------------------


class HostTable:
    """The host's processes as the simulated node sees them: a set of live PIDs."""

    def __init__(self, *pids: int) -> None:
        self.live = set(pids)

    def alive(self, pid: int, start_time: float | None = None) -> bool:
        return pid in self.live

    def start_time(self, pid: int) -> float | None:
        return 1.0 if pid in self.live else None

    def uid(self, pid: int) -> int | None:
        return 1000 if pid in self.live else None

    def parent(self, pid: int) -> int | None:
        return 1 if pid in self.live else None


def test_an_mps_server_is_a_compute_process_on_its_device_until_it_exits(sim: Sim) -> None:
    host = HostTable(5150)
    backend, node = sim("1xA100-40GB", host_processes=host)
    inst = backend.create_instance(0, A100_1G, 0)
    assert inst.uuid is not None
    node.procs.track_mps_servers(inst.uuid, [5150])

    (server,) = backend.processes(0, inst.uuid)
    assert (server.pid, server.mps) == (5150, False)  # a compute process, not a client
    with pytest.raises(GpuBusy):
        backend.destroy_instance(0, inst.gi_id)

    host.live.clear()  # the server exits after its control daemon's quit
    assert backend.processes(0, inst.uuid) == []
    backend.destroy_instance(0, inst.gi_id)


def test_gpu_instance_ids_follow_the_placement_not_the_order_of_creation(sim: Sim) -> None:
    # NVIDIA's MIG user guide, "Example 1: Creation of a 4-2-1 geometry" on an A100-40GB.
    backend, _node = sim("1xA100-40GB")
    one = backend.create_instance(0, A100_1G, 6)
    two = backend.create_instance(0, 14, 4)  # 2g.10gb
    four = backend.create_instance(0, 5, 0)  # 4g.20gb
    assert (one.gi_id, two.gi_id, four.gi_id) == (13, 5, 1)


def test_whole_gpu_memory_in_mig_mode_needs_privileges(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB", root=False)
    nvml = FakePynvml(node)
    nvml.nvmlInit()
    with pytest.raises(api.NVMLError) as caught:
        nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0))
    assert caught.value.value == api.NVML_ERROR_NO_PERMISSION
    # Discovery still names the GPU and its size (the catalog's, for a known model).
    (info,) = backend.discover()
    assert info.model == "A100-40GB"
    assert info.memory_total_mib == catalog.geometry("A100-40GB").memory_mib


def test_used_gpu_memory_can_be_unavailable(sim: Sim) -> None:
    backend, node = sim("1xV100-32GB", used_memory_visible=False)
    node.attach(4321, node.gpus[0].uuid)
    node.alloc(4321, 512)
    (proc,) = backend.processes(0)
    assert proc.pid == 4321 and proc.used_mib is None


def test_a_new_mig_device_handle_can_appear_after_the_creation_returned(
    sim: Sim, sleeps: SleepRecorder
) -> None:
    backend, _node = sim("1xA100-40GB", mig_handle_delay=2)
    created = backend.create_instance(0, A100_1G, 0)
    assert created.uuid is not None and created.uuid.startswith("MIG-")
    assert len(sleeps.waits) >= 1  # it had to look again
    assert [i.uuid for i in backend.list_instances(0)] == [created.uuid]


def test_a_process_can_outlive_its_lease_and_keep_its_memory(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB")
    inst = backend.create_instance(0, A100_1G, 0)
    assert inst.uuid is not None
    pid = node.procs.leave_behind(inst.uuid, 1024)
    assert pid > 1 << 22  # never a host PID
    (proc,) = backend.processes(0, inst.uuid)
    assert (proc.pid, proc.used_mib) == (pid, 1024)
    assert backend.memory(0, inst.uuid).used_mib >= 1024
    with pytest.raises(GpuBusy):
        backend.destroy_instance(0, inst.gi_id)
    node.detach(pid)
    backend.destroy_instance(0, inst.gi_id)


# -- issue 11: one NVML error table --------------------------------------------------------


def test_the_backend_and_the_simulator_share_one_error_table() -> None:
    from migd.backends import nvml_codes
    from migd.backends.nvml import translate_nvml_error

    assert api.ERROR_STRINGS is nvml_codes.ERROR_STRINGS
    for name in nvml_codes.__all__:
        if name.startswith("NVML_ERROR_"):
            code = getattr(nvml_codes, name)
            assert getattr(api, name) == code
            assert translate_nvml_error(code, op="x").details["nvml_error"] == name
