"""Recordings from real GPUs, replayed against the simulated GPU (issue 13).

Every JSON in ``tests/data/gpu/`` was written by ``scripts/mig_calibrate.py`` or
``scripts/gpu_probe.py``. Each is replayed here on a simulated node of the same model,
and any difference in what the simulator answers fails the test: one hour on a real GPU
becomes a permanent fidelity test. Files named ``synthetic-*`` were made BY THE
SIMULATOR (``--simulate``) and only keep the replay machinery honest; they are not
hardware and prove nothing about it. Latencies, idle memory and handle look-ups are
recorded for the simulator's tables but not compared (docs/nvml.md, known differences).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from sim_support import DATA

from migd.backends.nvml import NvmlBackend
from migd.backends.simulated import FakePynvml, SimNode

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
RECORDINGS = sorted((DATA / "gpu").glob("*.json"))


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CALIBRATE = load_script("mig_calibrate")
PROBE = load_script("gpu_probe")


def recordings(schema: str) -> list[Path]:
    """The recordings of one kind (each test replays its own kind, so none is skipped)."""
    return [p for p in RECORDINGS if json.loads(p.read_text()).get("schema") == schema]


CALIBRATIONS = recordings(CALIBRATE.SCHEMA)
PROBES = recordings(PROBE.PROBE_SCHEMA)

# What a replay compares: the driver's answers, not timings or idle memory.
PLACEMENT_KEYS = ("profile_id", "start", "gi_id", "size", "ci_ids", "memory_total_mib", "error")


def simulated_node(record: dict[str, Any]) -> SimNode:
    if record.get("simulated"):
        return SimNode.from_description(record["simulated"])
    model = record["gpu"].get("model")
    if not model:
        pytest.skip(f"{record['gpu'].get('name')}: no catalog model to simulate")
    return SimNode.from_description(f"1x{model}")


def calibrate_simulated(node: SimNode) -> dict[str, Any]:
    sleeps = CALIBRATE.Counter(lambda _s: None)
    backend = NvmlBackend(FakePynvml(node), sleep=sleeps)
    busy = CALIBRATE.simulated_busy(node, pid=4_000_001)
    return CALIBRATE.Calibration(backend, 0, sleeps, busy=busy).run()


def comparable(record: dict[str, Any]) -> dict[str, Any]:
    return {
        "placements": [
            {k: p.get(k) for k in (*PLACEMENT_KEYS, "nvml_error")} for p in record["placements"]
        ],
        "overlaps": record["overlaps"],
        "limits": record["limits"],
        "in_use": record["in_use"],
    }


@pytest.mark.parametrize("path", CALIBRATIONS, ids=[p.name for p in CALIBRATIONS])
def test_the_simulator_answers_as_the_recorded_gpu_did(path: Path) -> None:
    record = json.loads(path.read_text())
    if not path.name.startswith("synthetic-"):
        assert not record.get("synthetic"), f"{path.name}: a simulator's record must be synthetic-*"
    replayed = comparable(calibrate_simulated(simulated_node(record)))
    recorded = comparable(record)
    for key in recorded:
        assert replayed[key] == recorded[key], f"{path.name}: the simulator differs in {key}"


@pytest.mark.parametrize("path", PROBES, ids=[p.name for p in PROBES])
def test_the_simulator_rebuilt_from_a_probe_reports_the_same(path: Path) -> None:
    record = json.loads(path.read_text())
    node = SimNode.from_probe(path)
    node.set_root(bool(record.get("is_root", True)))
    replayed = PROBE.probe(NvmlBackend(PROBE.ReadOnlyNvml(FakePynvml(node))))
    for recorded, again in zip(record["gpus"], replayed["gpus"], strict=True):
        for key in ("uuid", "memory_total_mib", "mig_current", "persistence_mode", "compute_mode"):
            assert again[key] == recorded[key], f"{path.name}: {key}"
        if "mig" in recorded:
            assert again["mig"]["profiles"] == recorded["mig"]["profiles"], path.name
            assert again["mig"]["instances"] == recorded["mig"]["instances"], path.name


HARDWARE_PROBES = [p for p in PROBES if not json.loads(p.read_text()).get("synthetic")]
# What the simulator's own model of a board must say as the real one did (not settings such
# as persistence or compute mode, nor the board's UUID and PCI address).
IDENTITY = ("name", "model", "pci_device_id", "memory_total_mib", "compute_capability")


@pytest.mark.parametrize("path", HARDWARE_PROBES, ids=[p.name for p in HARDWARE_PROBES])
def test_the_simulators_model_of_a_recorded_board_is_that_board(path: Path) -> None:
    """``--simulate 1x<model>`` (no probe) presents the board a real probe recorded."""
    record = json.loads(path.read_text())
    for recorded in record["gpus"]:
        node = SimNode.from_description(f"1x{recorded['model']}")
        node.set_mig_mode(0, recorded["mig_current"])
        [again] = PROBE.probe(NvmlBackend(PROBE.ReadOnlyNvml(FakePynvml(node))))["gpus"]
        for key in IDENTITY:
            assert again[key] == recorded[key], f"{path.name}: {key}"
        if not recorded["processes"] and not recorded["mig_current"]:
            # the driver's own use of an idle GPU
            assert again["memory_used_mib"] == recorded["memory_used_mib"], path.name


def test_every_recording_is_of_a_kind_a_test_replays() -> None:
    """A file of an unknown schema would otherwise be silently left out of both replays."""
    assert sorted(CALIBRATIONS + PROBES) == RECORDINGS
    assert CALIBRATIONS and PROBES and HARDWARE_PROBES


def test_recordings_made_by_the_simulator_are_named_synthetic() -> None:
    for path in RECORDINGS:
        record = json.loads(path.read_text())
        if record.get("synthetic") or record.get("simulated"):
            assert path.name.startswith("synthetic-"), path.name


def test_a_replay_catches_a_simulator_that_numbers_instances_differently(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from migd.backends.simulated import mig_ops

    (path,) = [p for p in RECORDINGS if p.name == "synthetic-a100-40gb-calibration.json"]
    record = json.loads(path.read_text())
    monkeypatch.setattr(mig_ops, "placement_gi_id", lambda units, size, start: 99)
    replayed = comparable(calibrate_simulated(simulated_node(record)))
    assert replayed["placements"] != comparable(record)["placements"]
