"""Advertised free GPU memory is the memory profiles can still use (MigdFreeMB)."""

from __future__ import annotations

from migd.cli.condor_ad import render_condor_ad
from migd.core import catalog
from migd.core.capacity import placeable_mib
from migd.core.states import state_space
from tests.process.conftest import DaemonProcess


def test_placeable_memory_of_a_mig_gpu() -> None:
    space = state_space(catalog.geometry("A100-40GB"))
    p = {x.name: x for x in space.profiles}
    full = p["7g.40gb"].memory_mib
    assert placeable_mib(space, []) == full  # empty: the GPU's share of TotalVRAM
    # seven busy 1g.5gb: 40960 - 7 x 4864 MiB is "not held", but nothing fits
    assert placeable_mib(space, [(p["1g.5gb"], s) for s in range(7)]) == 0
    # a busy 3g.20gb at 4 leaves the other half: at most a 4g.20gb's memory
    half = placeable_mib(space, [(p["3g.20gb"], 4)])
    assert half == p["4g.20gb"].memory_mib


def test_migd_free_mb_is_zero_when_both_gpus_are_full(daemon: DaemonProcess) -> None:
    daemon.simulate = "2xA100-40GB"
    daemon.start()
    client = daemon.client()
    status = client.status()
    empty = [g["placeable_mib"] for g in status["gpus"]]
    assert empty == [g["full_profile_mib"] for g in status["gpus"]]
    assert f"MigdFreeMB = {sum(empty)}" in render_condor_ad(status)
    # fill both GPUs with 1g.5gb instances
    for n in range(14):
        client.lease(job_id=f"ap#{n}.0#1", gpu_memory_mib=4000, mode="mig", wait_s=10)
    status = client.status()
    assert [g["placeable_mib"] for g in status["gpus"]] == [0, 0]
    ad = render_condor_ad(status, per_gpu=True)
    assert "MigdFreeMB = 0" in ad and "MigdLargestPlaceableMB = 0" in ad
    assert ad.count("MigdGpuFreeMB = 0") == 2
