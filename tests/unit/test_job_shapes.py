"""Job shapes (issue 22): what the slot ads say for containers, mode requests and the
access point's pool defaults, and the scheduler's answer to a mode pinned to the wrong GPU."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import classad2
import pytest

from migd.cli.condor_ad import render_condor_ad, render_inventory, served_modes, share_attr
from migd.cli.pool_defaults import QUERY, PoolDefaults, parse_status, run
from migd.core.scheduler import GpuMode, NodeScheduler
from migd.errors import InvalidRequest
from tests.unit.test_gpu_modes import gpu, lease


@pytest.mark.parametrize("mps_in_mig", [False, True])
@pytest.mark.parametrize("mode", list(GpuMode))
def test_advertised_modes_are_the_ones_the_scheduler_serves(
    mode: GpuMode, mps_in_mig: bool
) -> None:
    kw = {"mps_in_mig": True} if mps_in_mig and mode is GpuMode.MIG else {}
    g = gpu(mode, **kw)
    ops = NodeScheduler([g]).mode_ops(g)
    served = {m for m in ("mig", "mps") if ops.serves(g, m)}  # type: ignore[arg-type]
    assert set(served_modes(mode.value, bool(kw))) == served


def _status_gpu(index: int, uuid: str, mode: str, **kw: Any) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": uuid,
        "mode": mode,
        "name": "NVIDIA A100-SXM4-40GB",
        "model": "A100-40GB",
        "memory_total_mib": 40960,
        "full_profile_mib": kw.pop("full", 40448),
        "healthy": True,
        "draining": False,
        "health": "",
        "largest_placeable": {"memory_mib": 40448, "profile": "7g.40gb"},
        "placeable_mib": 40448,
        "driver_version": "550.163.01",
        "cuda_version": "12.4",
        "compute_capability": "8.0",
        **kw,
    }


STATUS = {
    "daemon": {"version": "test"},
    "gpus": [
        _status_gpu(0, "GPU-aaaa1111-2222", "mig"),
        _status_gpu(1, "GPU-bbbb1111-2222", "mps", full=32768),
        _status_gpu(2, "GPU-cccc1111-2222", "off"),
    ],
}


def test_inventory_carries_nvidia_driver_and_the_modes_each_gpu_serves() -> None:
    from migd.cli.condor_ad import gpus_for_inventory

    text = render_inventory(gpus_for_inventory(STATUS), shares=2)
    ad = classad2.parseOne(text)
    # the node-level property the 25.14 starter reads as GPUs_NvidiaDriver before --nv
    assert ad["NvidiaDriver"] == "550.163.01"
    ids = [i.strip() for i in str(ad["DetectedGPUs"]).split(",")]
    props = {i: ad[share_attr(i)] for i in ids}
    assert {p["NvidiaDriver"] for p in props.values()} == {"550.163.01"}
    serves = {str(p["DeviceUuid"])[:4]: p.get("MigdServes") for p in props.values()}
    assert serves == {"aaaa": "mig", "bbbb": "mps"}


def test_node_ad_says_the_largest_partition_and_the_modes_served() -> None:
    ad = classad2.parseOne(render_condor_ad(STATUS).replace("- migd update:true", ""))
    assert ad["MigdMaxVRAM"] == 40448
    assert ad["MigdServes"] == "mig,mps"


def test_a_mode_pinned_to_the_wrong_gpu_names_the_gpu_that_serves_it() -> None:
    mig, mps = gpu(GpuMode.MIG, 0), gpu(GpuMode.MPS, 1)
    node = NodeScheduler([mig, mps])
    with pytest.raises(InvalidRequest) as err:
        node.submit(lease(2000, mode="mps", gpu_uuids=(mig.uuid,)), 1.0, 1.0)
    assert "does not serve mode=mps" in err.value.message
    assert "GPU 1 (mps) does" in err.value.message
    # unpinned, the request lands on the GPU that serves it
    out = node.submit(lease(2000, mode="mps"), 2.0, 2.0)
    assert out.lease is not None and out.lease.gpu == 1
    # and where truly nothing serves it, the message says so
    only_mig = NodeScheduler([gpu(GpuMode.MIG, 0)])
    with pytest.raises(InvalidRequest, match="no GPU on this node serves mode=mps"):
        only_mig.submit(lease(2000, mode="mps"), 1.0, 1.0)


def test_pool_defaults_take_the_largest_node_and_every_mode() -> None:
    text = "40448 mig\n32768 mps\n40448 mig,mps\nundefined undefined\n\n"
    assert parse_status(text) == PoolDefaults(40448, ("mig", "mps"))
    assert parse_status("") is None  # no migd node: nothing to say
    assert parse_status("undefined undefined\n") is None


def test_pool_defaults_write_once_and_reconfigure_only_on_change(tmp_path: Path) -> None:
    target = tmp_path / "migd-pool-defaults.config"
    answers = ["143771 mig\n40448 mps\n", "143771 mig\n40448 mps\n", "", "40448 mig\n"]
    asked: list[list[str]] = []
    reconfigs: list[int] = []

    def query(argv: Any) -> str:
        asked.append(list(argv))
        return answers[len(asked) - 1]

    def step() -> str:
        out = io.StringIO()
        with redirect_stdout(out):
            assert run(target, True, query=query, reconfigure=lambda: reconfigs.append(1)) == 0
        return out.getvalue()

    assert "MigdPoolMaxVRAM = 143771" in step()
    assert "MIGD_POOL_MAX_VRAM = 143771\nMIGD_POOL_MODES = mig,mps\n" in target.read_text()
    assert reconfigs == [1]
    step()  # the same pool: no write, no reconfig
    assert reconfigs == [1]
    step()  # the collector knows no migd node: the last values stay
    assert "MIGD_POOL_MAX_VRAM = 143771" in target.read_text() and reconfigs == [1]
    step()  # the H200 left the pool
    assert "MIGD_POOL_MAX_VRAM = 40448\nMIGD_POOL_MODES = mig\n" in target.read_text()
    assert reconfigs == [1, 1]
    assert asked[0] == QUERY
