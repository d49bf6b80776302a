"""A GPU whose MIG mode NVML cannot read is neither a MIG GPU nor a whole GPU: no work."""

from __future__ import annotations

from migd.backends.accounts import SystemAccounts
from migd.backends.procs import PsutilProcessTable
from migd.backends.simulated import nvml_api as api
from migd.backends.simulated import simulated_backend
from migd.core.gpus import GpuMode
from migd.daemon.config import MigdConfig
from migd.daemon.service import Daemon


def test_a_gpu_with_an_unreadable_mig_mode_gets_no_work() -> None:
    backend, node = simulated_backend("2xA100-40GB,1xV100-32GB")
    node.fail_next("nvmlDeviceGetMigMode", api.NVML_ERROR_UNKNOWN, gpu=1)
    daemon = Daemon(MigdConfig(), backend, PsutilProcessTable(), accounts=SystemAccounts())
    managed = [daemon.reconciler.manage(info) for info in backend.discover()]
    assert [g.mode for g in managed] == [GpuMode.MIG, GpuMode.OFF, GpuMode.MPS]
    unknown = managed[1]
    assert not unknown.available and unknown.space is None
    assert list(unknown.health.conditions) == ["startup"]
    assert "MIG mode of GPU 1 cannot be read" in str(unknown.health)
    assert "restart migd" in str(unknown.health)
    # Before the fix an unreadable mode read as "no MIG" and the GPU was shared whole (MPS).
    assert unknown.mode is not GpuMode.MPS
    assert [g.available for g in (managed[0], managed[2])] == [True, True]
