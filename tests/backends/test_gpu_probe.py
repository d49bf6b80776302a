"""scripts/gpu_probe.py is read-only, and SimNode.from_probe reproduces what it recorded."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from sim_support import DATA

from migd.backends.nvml import NvmlBackend
from migd.backends.simulated import FakePynvml, SimNode, simulated_backend
from migd.backends.simulated.fake_pynvml import WRITE_CALLS
from migd.errors import MigModeError

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_probe.py"
EXAMPLE = DATA / "probe_example_a100.json"


@pytest.fixture(scope="module")
def gpu_probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_probe", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUSY_NODE = """
[[gpu]]
model = "A100-40GB"
instances = [["3g.20gb", 4], ["2g.10gb", 0]]
processes = [{pid = 77, device = "3g.20gb@4", used_mib = 512}]
[[gpu]]
model = "V100-32GB"
processes = [{pid = 78, used_mib = 100}]
"""


def test_probe_changes_nothing_and_records_everything(gpu_probe: ModuleType) -> None:
    node = SimNode.from_description(BUSY_NODE)

    def state() -> list[object]:
        procs = [node.process(pid) for pid in (77, 78)]
        return [
            node.instances(0),
            node.instances(1),
            [(p.device_uuid, p.used_mib) for p in procs if p is not None],
        ]

    before = state()
    # The PIDs are simulated, so their names come from the test, not from this host's /proc
    # (where PID 78 may well exist).
    looked_up: list[int] = []

    def command_name(pid: int) -> str | None:
        looked_up.append(pid)
        return {77: "python3"}.get(pid)

    record = gpu_probe.probe(NvmlBackend(FakePynvml(node)), command_name=command_name)
    assert state() == before and len(before[2]) == 2  # type: ignore[arg-type]
    assert all(node.call_counts[call] == 0 for call in WRITE_CALLS)
    assert json.loads(json.dumps(record)) == record  # plain JSON
    a100, v100 = record["gpus"]
    assert a100["uuid"] == node.gpu(0).uuid and a100["model"] == "A100-40GB"
    assert {(i["profile_id"], i["start"]) for i in a100["mig"]["instances"]} == {(9, 4), (14, 0)}
    assert [(p["pid"], p["name"]) for p in a100["processes"]] == [(77, "python3")]
    assert len(a100["mig"]["profiles"]) == 7
    assert all(p["placements"] for p in a100["mig"]["profiles"])
    assert v100["mig_current"] is None and "mig" not in v100
    assert v100["processes"] == [
        {"pid": 78, "used_mib": 100, "mig_uuid": None, "mps": False, "name": None}
    ]
    assert a100["errors"] == {} and v100["errors"] == {}
    assert sorted(looked_up) == [77, 78]


def test_a_real_node_names_processes_from_proc(gpu_probe: ModuleType) -> None:
    """Without a lookup, a real node's process names come from /proc: this test's own
    process is the one PID certain to exist on any host."""
    assert gpu_probe._command_name(os.getpid()) == Path("/proc/self/comm").read_text().strip()
    node = SimNode.from_description(f"""
[[gpu]]
model = "V100-32GB"
processes = [{{pid = {os.getpid()}, used_mib = 100}}]
""")
    real = gpu_probe.probe(NvmlBackend(FakePynvml(node)))
    simulated = gpu_probe.probe(NvmlBackend(FakePynvml(node)), simulated="test")
    assert real["gpus"][0]["processes"][0]["name"] == gpu_probe._command_name(os.getpid())
    assert simulated["gpus"][0]["processes"][0]["name"] is None  # not this host's PIDs


def no_name(pid: int) -> str | None:
    return None


def test_probe_without_root_records_what_it_could_not_read(gpu_probe: ModuleType) -> None:
    node = SimNode.from_description(BUSY_NODE, root=False)
    record = gpu_probe.probe(NvmlBackend(FakePynvml(node)))
    a100 = record["gpus"][0]
    assert a100["mig"]["instances"] == []
    assert all(p["placements"] is None for p in a100["mig"]["profiles"])
    assert a100["errors"]["instances"].startswith("GpuPermissionDenied")
    assert a100["errors"]["placements[9]"].startswith("GpuPermissionDenied")


def _example() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(EXAMPLE.read_text())
    return data


def test_the_example_is_marked_synthetic() -> None:
    data = _example()
    assert data["synthetic"] is True and "SYNTHETIC, NOT RECORDED" in data["_comment"]


def test_a_node_built_from_a_probe_reports_what_was_recorded() -> None:
    data = _example()
    backend, _node = simulated_backend(SimNode.from_probe(EXAMPLE))
    for info, recorded in zip(backend.discover(), data["gpus"], strict=True):
        assert (info.uuid, info.name, info.pci_bus_id, info.pci_device_id) == (
            recorded["uuid"],
            recorded["name"],
            recorded["pci_bus_id"],
            recorded["pci_device_id"],
        )
        assert (info.memory_total_mib, info.mig_current, info.mig_pending) == (
            recorded["memory_total_mib"],
            recorded["mig_current"],
            recorded["mig_pending"],
        )
        assert (info.driver_version, info.cuda_version) == (
            data["driver_version"],
            data["cuda_version"],
        )
    recorded_mig = data["gpus"][0]["mig"]
    geometry = backend.geometry(0)
    assert geometry.source == "nvml"
    assert {p.profile_id: (p.memory_mib, p.starts) for p in geometry.profiles} == {
        p["id"]: (p["memory_mib"], tuple(s for s, _ in p["placements"]))
        for p in recorded_mig["profiles"]
    }
    assert [(m.gi_id, m.profile_id, m.start, m.uuid) for m in backend.list_instances(0)] == [
        (i["gi_id"], i["profile_id"], i["start"], i["uuid"]) for i in recorded_mig["instances"]
    ]
    assert [(p.pid, p.used_mib, p.mig_uuid) for p in backend.processes(0)] == [
        (p["pid"], p["used_mib"], p["mig_uuid"]) for p in data["gpus"][0]["processes"]
    ]
    with pytest.raises(MigModeError, match="pending"):  # GPU 1: MIG enable pending a reset
        backend.create_instance(1, 9, 0)


def test_probing_the_simulated_probe_gives_the_probe_back(gpu_probe: ModuleType) -> None:
    data = _example()
    record = gpu_probe.probe(
        NvmlBackend(FakePynvml(SimNode.from_probe(EXAMPLE))), command_name=no_name
    )
    assert record["gpus"] == data["gpus"]
    assert (record["driver_version"], record["cuda_version"]) == (
        data["driver_version"],
        data["cuda_version"],
    )


def test_probe_cli_on_a_simulated_node(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--simulate", "2xA30-24GB", "--gpu", "1", "-o", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["synthetic"] is True and record["simulated"] == "2xA30-24GB"
    assert [g["index"] for g in record["gpus"]] == [1]
    assert SimNode.from_probe(out).gpu(0).uuid == record["gpus"][0]["uuid"]


def test_the_probe_cannot_call_anything_that_changes_a_gpu(gpu_probe: ModuleType) -> None:
    node = SimNode.from_description("1xA100-40GB")
    nvml = gpu_probe.ReadOnlyNvml(FakePynvml(node))
    nvml.nvmlInit()
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(device) == [1, 1]  # queries pass
    for call in (*WRITE_CALLS, "nvmlDeviceSetMigMode", "nvmlDeviceResetGpuLockedClocks"):
        assert not gpu_probe.ReadOnlyNvml.allowed(call), call
    with pytest.raises(PermissionError, match="read-only"):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, 9, None)
    assert node.call_counts["nvmlDeviceCreateGpuInstanceWithPlacement"] == 0
    used = [n for n in dir(nvml) if n.startswith("nvml") and callable(getattr(FakePynvml, n, None))]
    refused = {n for n in used if not gpu_probe.ReadOnlyNvml.allowed(n)}
    assert refused == set(WRITE_CALLS)  # every other call of the simulated pynvml is a query


def test_a_probe_records_what_rebuilding_the_node_needs(
    gpu_probe: ModuleType, tmp_path: Path
) -> None:
    text = """
[[gpu]]
model = "A100-40GB"
mig_idle_used_mib = 11
instances = [
  {profile = "3g.20gb", start = 4, compute_instances = [
    {slices = 1, uuid = "MIG-00000000-0000-4000-8000-0000000000a1"}, {slices = 2}]},
  ["1g.5gb", 0],
]
processes = [
  {pid = 90, device = "MIG-00000000-0000-4000-8000-0000000000a1", used_mib = 300},
  {pid = 91, device = "1g.5gb@0", used_mib = 200, mps_pinned_limit_mib = 1000},
]
[[gpu]]
model = "V100-32GB"
idle_used_mib = 7
"""
    original = SimNode.from_description(text)
    record = gpu_probe.probe(NvmlBackend(FakePynvml(original)), simulated="test")
    split = next(i for i in record["gpus"][0]["mig"]["instances"] if i["start"] == 4)
    assert [c["slices"] for c in split["compute_instances"]] == [1, 2]
    assert [p["mps"] for p in record["gpus"][0]["processes"]] == [False, True]
    (tmp_path / "probe.json").write_text(json.dumps(record))
    rebuilt = SimNode.from_probe(tmp_path / "probe.json")
    assert [v.uuids for v in rebuilt.instances(0)] == [v.uuids for v in original.instances(0)]
    assert rebuilt.gpus[0].spec.mig_idle_used_mib == 11
    assert rebuilt.gpus[1].spec.idle_used_mib == 7
    again = gpu_probe.probe(NvmlBackend(FakePynvml(rebuilt)), simulated="test")
    assert again["gpus"] == record["gpus"]  # memory figures included
