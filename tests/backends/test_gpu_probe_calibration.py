"""What scripts/gpu_probe.py records for calibration (issue 13), on the simulated GPU."""

from __future__ import annotations

import json
from pathlib import Path

from test_gpu_recordings import load_script

from migd.backends.nvml import NvmlBackend
from migd.backends.simulated import FakePynvml, SimNode
from migd.backends.simulated.fake_pynvml import WRITE_CALLS

PROBE = load_script("gpu_probe")

NODE = """
[[gpu]]
model = "A100-40GB"
instances = [["1g.5gb", 6], ["3g.20gb", 0]]
processes = [{pid = 4000077, device = "3g.20gb@0", used_mib = 512}]
"""


def probe(ci_info_device: str = "parent") -> tuple[dict, SimNode]:
    node = SimNode.from_description(NODE)
    nvml = FakePynvml(node, ci_info_device=ci_info_device)  # type: ignore[arg-type]
    record = PROBE.probe(NvmlBackend(PROBE.ReadOnlyNvml(nvml)), simulated="test")
    assert all(node.call_counts[call] == 0 for call in WRITE_CALLS)
    return record, node


def test_each_instance_records_its_ci_profiles_memory_and_processes() -> None:
    record, _node = probe()
    (gpu,) = record["gpus"]
    assert (gpu["persistence_mode"], gpu["compute_mode"]) == (True, "DEFAULT")
    by_start = {i["start"]: i for i in gpu["mig"]["instances"]}
    big = by_start[0]
    assert big["memory_total_nvml_mib"] == big["memory_total_mib"]
    assert [(p["pid"], p["used_mib"]) for p in big["processes"]] == [(4000077, 512)]
    by_index = {c["index"]: c for c in big["ci_profiles"]}
    assert by_index[7]["constant"].endswith("_1_SLICE_REV1")
    assert by_index[7]["id"] == by_index[0]["id"]  # what a real driver answers is recorded
    assert by_index[8].get("error") == "NVML_ERROR_NOT_SUPPORTED"


def test_it_records_whether_the_ci_info_device_is_the_parent_or_the_mig_device() -> None:
    parent, _ = probe("parent")
    mig, _ = probe("mig")
    assert {i["ci_info_device"] for i in parent["gpus"][0]["mig"]["instances"]} == {"parent"}
    assert {i["ci_info_device"] for i in mig["gpus"][0]["mig"]["instances"]} == {"mig"}


def test_the_unprivileged_probe_records_what_nvml_refuses_a_user(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    assert PROBE.main(["--simulate", "1xA100-40GB", "--also-unprivileged", "-o", str(out)]) == 0
    record = json.loads(out.read_text())
    unprivileged = record["unprivileged"]
    assert record["synthetic"] is True and unprivileged["is_root"] is False
    errors = unprivileged["gpus"][0]["errors"]
    assert "NO_PERMISSION" in errors["instances"] and "NO_PERMISSION" in errors["memory"]
    # The record still rebuilds a simulated node.
    assert SimNode.from_probe(out).gpus[0].spec.model == "A100-40GB"


def test_a_recorded_mig_memory_total_is_replayed(tmp_path: Path) -> None:
    record, _node = probe()
    gpu = record["gpus"][0]
    (small,) = [i for i in gpu["mig"]["instances"] if i["start"] == 6]
    small["memory_total_nvml_mib"] = 4600  # what a driver might report for 1g.5gb
    gpu["compute_mode"] = "EXCLUSIVE_PROCESS"
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(record))
    spec = SimNode.from_probe(path).gpus[0].spec
    assert spec.mig_memory_mib == {"1g.5gb": 4600}
    assert spec.compute_mode == "EXCLUSIVE_PROCESS"
