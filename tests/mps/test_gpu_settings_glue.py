"""Issue 13 defects 4 and 5 in the daemon: persistence and compute mode are reported per
GPU, and mps.require_exclusive_process keeps MPS off GPUs not in EXCLUSIVE_PROCESS."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from migd.core.gpus import ManagedGpu, MigState, MpsState
from migd.daemon.api.status import gpu_warnings
from migd.daemon.config import MigdConfig
from migd.daemon.supervision.mps import MpsSupervisor
from migd.ports import GpuInfo, ManualClock

INFO = GpuInfo(
    index=0,
    uuid="GPU-0a1b2c3d-0000-4000-8000-0000000000d1",
    name="NVIDIA H100 80GB HBM3",
    pci_bus_id="00000000:01:00.0",
    pci_device_id=0x233010DE,
    memory_total_mib=81559,
    mig_current=False,
    mig_pending=False,
    driver_version="550.54.15",
    cuda_version="12.4",
    model="H100-80GB",
    persistence_mode=True,
    compute_mode="EXCLUSIVE_PROCESS",
)


def mps_gpu() -> ManagedGpu:
    return ManagedGpu(0, INFO.uuid, "H100-80GB", INFO.name, 81559, MpsState())


def configure(info: GpuInfo, *, require: bool) -> ManagedGpu:
    config = MigdConfig.model_validate({"mps": {"require_exclusive_process": require}})
    backend = SimpleNamespace(geometry=lambda index: SimpleNamespace(compute_slices=7))
    ctx: Any = SimpleNamespace(config=config, backend=backend, mps=None, clock=ManualClock())
    gpu = mps_gpu()
    MpsSupervisor(ctx, executor=None, leases=None).configure(gpu, info, False, None)  # type: ignore[arg-type]
    return gpu


def test_a_well_set_up_gpu_has_no_warnings() -> None:
    assert gpu_warnings(INFO, mps_gpu()) == []


def test_persistence_off_and_a_default_compute_mode_are_warned_about() -> None:
    info = replace(INFO, persistence_mode=False, compute_mode="DEFAULT")
    persistence, compute = gpu_warnings(info, mps_gpu())
    assert "persistence mode is off" in persistence and "nvidia-persistenced" in persistence
    assert "compute mode is DEFAULT" in compute and "-c EXCLUSIVE_PROCESS" in compute


def test_the_compute_mode_matters_only_where_mps_is_offered() -> None:
    mig = ManagedGpu(0, INFO.uuid, "H100-80GB", INFO.name, 81559, MigState())
    assert gpu_warnings(replace(INFO, compute_mode="DEFAULT"), mig) == []


def test_require_exclusive_process_keeps_mps_off_other_gpus() -> None:
    weak = replace(INFO, compute_mode="DEFAULT")
    assert configure(weak, require=False).health.available
    refused = configure(weak, require=True)
    assert "mps.require_exclusive_process" in str(refused.health)
    assert configure(INFO, require=True).health.available
