"""Issue 13: the NVML paths that would break on a first real GPU, and the simulator
behaving like the hardware there (each simulated behaviour is cited in docs/nvml.md)."""

from __future__ import annotations

import logging

import pytest
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
