"""Issue 13: the NVML paths that would break on a first real GPU, and the simulator
behaving like the hardware there (each simulated behaviour is cited in docs/nvml.md)."""

from __future__ import annotations

from sim_support import Sim

from migd.backends.simulated import FakePynvml
from migd.backends.simulated import nvml_api as api
from migd.backends.simulated.node import CI_PROFILE_1_SLICE_REV1

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
