"""The starter's device-hiding list names exactly the GPU the job's lease is on.

HTCondor's starter (as root, with cgroups) hides every NVIDIA device that is not
in ``join(",",evalInEachContext(strcat("GPU-",DeviceUuid),AvailableGPUs))``
evaluated on the slot ad (``src/condor_starter.V6.1/vanilla_proc.cpp``, see
docs/htcondor-notes.md (q)); a value that is not a string hides them all. These
tests build the slot ad from what ``migctl gpu-inventory`` prints, evaluate the
starter's own expression with the real ClassAd library, and lease through the
wrapper's request path on a simulated node, for MIG and MPS leases on every GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import classad2
import pytest

from migd.cli.condor_ad import (
    gpus_for_inventory,
    render_inventory,
    share_attr,
    share_id,
)
from migd.wrapper.jobspec import spec_from_ads
from tests.process.conftest import DaemonProcess

STARTER_HIDE_EXPR = 'join(",",evalInEachContext(strcat("GPU-",DeviceUuid),AvailableGPUs))'
SHARES = 7


def dynamic_slot_ad(inventory: str, share_ids: list[str], name: str) -> Any:
    """A d-slot ad as the 23.9 startd builds it from the GPU inventory (seen with
    ``condor_status -long``): the property ads as ``GPUs_<attr>``, the assigned IDs,
    and ``AvailableGPUs`` listing the property ads of those IDs."""
    refs = ", ".join("GPUs_" + share_attr(i) for i in share_ids)
    text = "\n".join(
        [
            *("GPUs_" + line for line in inventory.strip().splitlines()[1:]),
            f'Name = "{name}"',
            f'AssignedGPUs = "{", ".join(share_ids)}"',
            f"AvailableGPUs = {{ {refs} }}",
        ]
    )
    return classad2.parseOne(text)


def allowed_devices(slot_ad: Any) -> object:
    return classad2.ExprTree(STARTER_HIDE_EXPR).eval(slot_ad)


@pytest.fixture
def node(daemon: DaemonProcess) -> Iterator[DaemonProcess]:
    # MIG GPUs, an MPS-only GPU and a MIG-capable GPU with MIG off (MPS there).
    daemon.simulate = "2xA100-40GB,1xV100-32GB,1xA100-40GB:mig=off"
    # MPS leases on the MIG GPUs too (an MPS share inside a MIG instance).
    daemon.config_text = "version = 1\n" + "".join(
        f'[[gpu]]\nmatch = "{i}"\nmps_in_mig = true\n' for i in (0, 1)
    )
    daemon.start()
    yield daemon


def test_the_starter_expression_names_the_leased_gpu_for_mig_and_mps(
    node: DaemonProcess,
) -> None:
    client = node.client()
    status = client.status()
    inventory = render_inventory(gpus_for_inventory(status), shares=SHARES)
    modes_seen = set()
    for gpu in status["gpus"]:
        modes = ["mig", "mps"] if gpu["mode"] == "mig" else ["mps"]
        for n, mode in enumerate(modes):
            share = share_id(gpu["uuid"], SHARES - 1 - n)
            slot = dynamic_slot_ad(inventory, [share], f"slot1_{gpu['index']}{n}@node")
            job_ad = {
                "GlobalJobId": f"ap#{gpu['index']}.{n}#1",
                "RequestGPUs": 1,
                "RequestVRAM": 2000,
                "MigdMode": mode,
            }
            machine_ad = {"Name": slot["Name"], "AssignedGPUs": slot["AssignedGPUs"]}
            spec = spec_from_ads(["/bin/true"], job_ad, machine_ad)
            lease = client.lease(
                job_id=spec.job_id,
                slot=spec.slot,
                gpu_memory_mib=spec.memory_mib,
                mode=spec.mode,
                gpus=list(spec.gpus) if spec.gpus else None,
                wait_s=10,
            )
            try:
                assert lease["state"] == "active", lease
                assert lease["mode"] == mode, lease
                # The job may open exactly the GPU its partition is on, and no other.
                assert allowed_devices(slot) == lease["gpu_uuid"] == gpu["uuid"]
                modes_seen.add((gpu["index"], lease["mode"]))
            finally:
                client.release(lease["lease_id"], reason="test")
    assert len({i for i, _ in modes_seen}) == len(status["gpus"]) == 4
    assert {m for _, m in modes_seen} == {"mig", "mps"}


def test_without_device_uuid_the_starter_hides_every_gpu(node: DaemonProcess) -> None:
    # What migd advertised before: share IDs with no property ads. The expression is
    # then not a string, which the starter reads as "hide all".
    gpu = node.client().status()["gpus"][0]
    share = share_id(gpu["uuid"], 0)
    bare = f'DetectedGPUs="{share}"\n'
    assert not isinstance(allowed_devices(dynamic_slot_ad(bare, [share], "slot1_1@n")), str)


def test_inventory_has_condor_gpu_discovery_properties(node: DaemonProcess) -> None:
    status = node.client().status()
    inventory = render_inventory(gpus_for_inventory(status), shares=2)
    first, *rest = inventory.strip().splitlines()
    # one nested ad per share; node-level properties (NvidiaDriver, for the 25.14 starter's
    # --nv) are plain attributes
    props = [line for line in rest if "=[" in line]
    assert [line.split("=")[0] for line in rest if "=[" not in line] == ["NvidiaDriver"]
    ids = [i.strip() for i in first.split("=", 1)[1].strip('"').split(",")]
    assert len(ids) == len(props) == 2 * len(status["gpus"])
    # share by share across the GPUs, in the order HTCondor sorts them
    assert ids == sorted(ids) and ids[:4] == [share_id(g["uuid"], 0) for g in status["gpus"]]
    ad = classad2.parseOne("\n".join(props))
    a100, v100 = status["gpus"][0], status["gpus"][2]
    prop = ad[share_attr(ids[0])]
    assert prop["id"] == ids[0] and prop["DeviceUuid"] == a100["uuid"].removeprefix("GPU-")
    assert prop["DeviceName"] == a100["name"]
    assert prop["Capability"] == 8.0 and ad[share_attr(ids[2])]["Capability"] == 7.0
    # The largest partition a job can get: the full MIG profile, the whole V100.
    assert prop["GlobalMemoryMb"] == a100["full_profile_mib"]
    assert ad[share_attr(ids[2])]["GlobalMemoryMb"] == v100["memory_total_mib"]
    assert prop["MaxSupportedVersion"] == 13000 and prop["DriverVersion"] == 13.0
    # require_gpus / gpus_minimum_memory as condor_submit writes them match a share.
    require = classad2.ExprTree("GlobalMemoryMb >= 20000 && Capability >= 8.0")
    assert require.eval(prop) is True
    assert classad2.ExprTree("GlobalMemoryMb >= 40960").eval(prop) is False
