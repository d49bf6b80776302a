"""scripts/mig_calibrate.py: what it refuses, what it leaves behind, what it records
(run against the simulated GPU: its dry run)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_gpu_recordings import CALIBRATE, SCRIPTS, calibrate_simulated

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


# -- issue 25: clean up on every signal and error, and keep what was measured ---------------


def test_an_error_in_one_overlap_step_is_recorded_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = SimNode.from_description("1xA100-40GB")
    cal = calibration(node)
    real = CALIBRATE.Calibration._overlap

    def broken(self: object, profile_id: int, geometry: object) -> dict[str, object]:
        if profile_id == 9:  # 3g.20gb: holds an instance when it fails, as a real bug might
            self.create(9, self.starts(9)[0])  # type: ignore[attr-defined]
            raise KeyError("unexpected")
        return real(self, profile_id, geometry)  # type: ignore[no-any-return]

    monkeypatch.setattr(CALIBRATE.Calibration, "_overlap", broken)
    steps = CALIBRATE.Steps(None)
    record = cal.run(steps)  # type: ignore[attr-defined]
    failed = [o for o in record["overlaps"] if "unexpected" in o]
    assert failed == [{"unexpected": "KeyError: 'unexpected'", "args": [9]}]
    assert len(record["overlaps"]) > 1 and record["limits"] and record["in_use"]
    assert record["status"] == "complete" and record["left_on_gpu"] == []
    assert node.instances(0) == []
    assert [line["step"] for line in steps.lines][-1] == "end"


def test_an_error_in_the_in_use_step_is_recorded_and_its_instance_destroyed() -> None:
    node = SimNode.from_description("1xA100-40GB")
    sleeps = CALIBRATE.Counter(lambda _s: None)

    def busy(_uuid: str) -> object:
        raise OSError("the busy command could not start")

    cal = CALIBRATE.Calibration(NvmlBackend(FakePynvml(node), sleep=sleeps), 0, sleeps, busy=busy)
    record = cal.run()
    assert record["in_use"]["unexpected"] == "OSError: the busy command could not start"
    assert record["placements"] and record["status"] == "complete"
    assert node.instances(0) == [] and record["left_on_gpu"] == []


def test_an_error_outside_any_step_still_cleans_up_and_keeps_the_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = SimNode.from_description("1xA100-40GB")
    cal = calibration(node)
    calls = {"n": 0}
    real_starts = CALIBRATE.Calibration.starts

    def starts(self: object, profile_id: int) -> list[int]:
        calls["n"] += 1
        if calls["n"] == 3:  # while placements are listed: outside every guarded step
            self.create(profile_id, real_starts(self, profile_id)[0])  # type: ignore[attr-defined]
            raise RuntimeError("NVML went away")
        return real_starts(self, profile_id)  # type: ignore[no-any-return]

    monkeypatch.setattr(CALIBRATE.Calibration, "starts", starts)
    record = cal.run()  # type: ignore[attr-defined]
    assert record["status"] == "error: RuntimeError: NVML went away"
    assert record["placements"]  # the placements of the first profiles are kept
    assert node.instances(0) == [] and record["left_on_gpu"] == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_mid_run_leaves_a_clean_gpu_and_the_partial_record(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """The script as ``gpu_checks.sh`` runs it (``timeout`` sends SIGTERM), on a simulated
    GPU kept in a file, so that the GPU can be looked at after the process is gone."""
    state, out = tmp_path / "gpu.json", tmp_path / "cal.json"
    steps = tmp_path / "cal.json.steps.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPTS / "mig_calibrate.py"),
            *("--simulate", "1xA100-40GB", "--sim-state", str(state)),
            *("--sim-time-scale", "0.5", "-o", str(out)),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Wait (generously: a busy 2-core machine) until two placements are recorded, so
        # that the signal comes mid-run with an instance likely held.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if steps.exists() and steps.read_text().count('"step": "placement"') >= 2:
                break
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.05)
        else:
            pytest.fail("waited 120 s for mig_calibrate.py to record two placements")
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + int(sig), err
    lines = [json.loads(line) for line in steps.read_text().splitlines()]
    assert lines[0]["step"] == "gpu" and lines[-1] == {
        "step": "end",
        "status": f"interrupted by {sig.name}",
        "left_on_gpu": [],
    }
    record = json.loads(out.read_text())
    assert record["status"] == f"interrupted by {sig.name}" and len(record["placements"]) >= 2
    assert SimNode.from_description("1xA100-40GB", state_file=state).instances(0) == []
