"""scripts/mig_calibrate.py: what it refuses, what it leaves behind, what it records
(run against the simulated GPU: its dry run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_gpu_recordings import CALIBRATE, calibrate_simulated

from migd.backends.nvml import NvmlBackend
from migd.backends.simulated import FakePynvml, SimNode


def calibration(node: SimNode) -> object:
    sleeps = CALIBRATE.Counter(lambda _s: None)
    return CALIBRATE.Calibration(NvmlBackend(FakePynvml(node), sleep=sleeps), 0, sleeps)


@pytest.mark.parametrize(
    ("description", "why"),
    [
        ("1xA100-40GB:mig=off", "MIG mode must already be on"),
        ("1xA100-40GB:mig=pending", "MIG mode must already be on"),
        ("1xV100-32GB", "MIG mode must already be on"),
        ('[[gpu]]\nmodel = "A100-40GB"\ninstances = [["1g.5gb", 0]]\n', "has MIG instances"),
    ],
)
def test_it_refuses_a_gpu_that_is_not_idle_in_mig_mode(description: str, why: str) -> None:
    node = SimNode.from_description(description)
    before = node.snapshot()
    with pytest.raises(CALIBRATE.Refused, match=why):
        calibration(node).run()  # type: ignore[attr-defined]
    assert node.snapshot()["gpus"] == before["gpus"]


def test_it_leaves_the_gpu_as_it_found_it_and_changes_no_setting() -> None:
    node = SimNode.from_description("1xH100-80GB")
    record = calibrate_simulated(node)
    assert node.instances(0) == []
    assert node.gpus[0].mig_current is True and node.gpus[0].mig_pending is True
    changed = [c for c, n in node.call_counts.items() if n and ("Set" in c or "Reset" in c)]
    assert changed == []
    by_start = {(p["profile_id"], p["start"]): p["gi_id"] for p in record["placements"]}
    assert by_start[(19, 6)] == 13 and by_start[(9, 4)] == 2 and by_start[(0, 0)] == 0
    assert record["in_use"]["nvml_error"] == "NVML_ERROR_IN_USE"
    assert {lim["profile_id"]: lim["created"] for lim in record["limits"]}[19] == 7


def test_the_command_line_dry_run_writes_a_synthetic_record(tmp_path: Path) -> None:
    out = tmp_path / "cal.json"
    assert CALIBRATE.main(["--simulate", "1xA30-24GB", "-o", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["synthetic"] is True and record["simulated"] == "1xA30-24GB"
    assert record["schema"] == CALIBRATE.SCHEMA and record["placements"]


def test_the_command_line_refuses_with_exit_code_3(capsys: pytest.CaptureFixture[str]) -> None:
    assert CALIBRATE.main(["--simulate", "1xA100-40GB:mig=off"]) == 3
    assert "refusing" in capsys.readouterr().err
