"""Start-up reconciliation against instances an admin made by hand (the real daemon).

migd adopts what it can explain and leaves the rest alone: an instance split into
several compute instances, one with processes, or one of a profile outside
``policy.profiles`` is reported by ``migctl status`` and never destroyed, whatever
``migctl reset`` or the idle policy would do to an idle instance of its own.
"""

from __future__ import annotations

import time
from typing import Any

from migd.errors import MigdError
from tests.process.conftest import DaemonProcess

CI0 = "MIG-00000000-0000-4000-8000-0000000000c0"
CI1 = "MIG-00000000-0000-4000-8000-0000000000c1"

# An admin's 3g.20gb@4 split into two 1-slice compute instances, a CUDA process on the
# second one; a second GPU left empty.
SPLIT_BY_HAND = f"""
seed = 3
[[gpu]]
model = "A100-40GB"
instances = [{{profile = "3g.20gb", start = 4, compute_instances = [
    {{slices = 1, uuid = "{CI0}"}}, {{slices = 1, uuid = "{CI1}"}}]}}]
processes = [{{pid = 4242, device = "{CI1}", used_mib = 100}}]
[[gpu]]
model = "A100-40GB"
"""


def instance_at(status: dict[str, Any], gpu: int, start: int) -> dict[str, Any]:
    [inst] = [i for i in status["gpus"][gpu]["instances"] if i["start"] == start]
    return inst  # type: ignore[no-any-return]


def mig_device_exists(daemon: DaemonProcess, uuid: str, pid: int) -> bool:
    """Whether a CUDA process can open ``uuid`` (then it leaves again)."""
    client = daemon.client()
    result = client.call("sim_attach", pid=pid, device_uuid=uuid)
    client.call("sim_detach", pid=pid)
    return "cuda_error" not in result


def test_an_instance_split_by_hand_is_never_destroyed_even_when_idle(
    daemon: DaemonProcess,
) -> None:
    daemon.simulate = SPLIT_BY_HAND
    daemon.start()
    client = daemon.client()
    inst = instance_at(client.status(), 0, 4)
    assert (inst["profile"], inst["origin"], inst["busy"]) == ("3g.20gb", "unexplained", True)
    assert "2 compute instances" in inst["note"]
    result = client.call("reset", gpu="0")
    assert result["destroying"] == [] and "3g.20gb@4" in result["kept_busy"]
    client.call("sim_detach", pid=4242)  # its process ends: still not migd's to destroy
    time.sleep(1.0)  # five reaper cycles (reaper.interval_s=0.2): each resyncs GPU 0
    inst = instance_at(client.status(), 0, 4)
    assert inst["origin"] == "unexplained" and inst["busy"]
    assert client.call("reset", gpu="0")["destroying"] == []
    assert mig_device_exists(daemon, CI0, 5) and mig_device_exists(daemon, CI1, 6)
    # Work goes elsewhere: the free half of GPU 0 or GPU 1, never into 3g.20gb@4.
    lease = client.lease(job_id="1.0", gpu_memory_mib=15000, wait_s=5)
    assert (lease["gpu"], lease["start"]) != (0, 4)


def test_an_instance_of_a_profile_outside_the_policy_keeps_its_slices(
    daemon: DaemonProcess,
) -> None:
    daemon.simulate = """
[[gpu]]
model = "A100-40GB"
instances = [["2g.10gb", 0]]
[[gpu]]
model = "A100-40GB"
"""
    daemon.config_text = 'version = 1\n[policy]\nprofiles = "1g.5gb,3g.20gb"\n'
    daemon.start()
    client = daemon.client()
    status = client.status()
    gpu = status["gpus"][0]
    inst = instance_at(status, 0, 0)
    assert (inst["profile"], inst["origin"], inst["busy"]) == ("2g.10gb", "unexplained", True)
    assert "not in policy.profiles" in inst["note"]
    assert "outside policy.profiles" in gpu["health"] and not gpu["healthy"]
    [condition] = gpu["conditions"]
    assert condition["source"] == "resync" and condition["reason"] == gpu["health"]
    # Its units (0 and 1) are not offered as free.
    assert not {0, 1} & set(gpu["creatable"].get("1g.5gb", []))
    assert "2g.10gb" not in status["gpus"][1]["creatable"]  # the policy still rules GPU 1
    lease = client.lease(job_id="2.0", gpu_memory_mib=4000, wait_s=5)
    assert lease["gpu"] == 1 and lease["profile"] == "1g.5gb"
    assert client.call("reset", gpu="0")["destroying"] == []
    try:
        client.lease(job_id="3.0", gpu_memory_mib=9000, wait_s=0, gpus=["0"])
    except MigdError as exc:  # GPU 0 takes no new work while the instance is there
        assert exc.code == "no_capacity", exc
    else:
        raise AssertionError("GPU 0 took new work")
