"""``migctl condor-ad --watch``: a new ad as soon as migd's state changes, and only then."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from typing import IO, Any

from migd.cli.condor_ad import max_vram, render_unavailable, watch
from migd.core.ad_updates import AdUpdates
from migd.errors import DaemonUnavailable
from tests.process.conftest import DaemonProcess


def _status(free_profile_mib: int, queued: int = 0) -> dict[str, Any]:
    gpu = {
        "index": 0,
        "uuid": "GPU-61342749-a9b5",
        "model": "A100-40GB",
        "mode": "mig",
        "healthy": True,
        "health": "ok",
        "draining": False,
        "memory_total_mib": 40960,
        "full_profile_mib": 40448,
        "largest_placeable": {"profile": "7g.40gb", "memory_mib": free_profile_mib}
        if free_profile_mib
        else None,
        "instances": [],
    }
    return {"daemon": {"version": "1"}, "gpus": [gpu], "queue": [None] * queued}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def _ads(text: str) -> list[str]:
    return [block for block in text.split("- migd update:true\n") if block]


def test_watch_writes_an_ad_only_when_the_node_changed() -> None:
    states = iter([_status(0), _status(0), _status(0), _status(40448), _status(40448)])
    out, clock = io.StringIO(), Clock()
    watch(lambda: next(states), out, sleep=clock.sleep, clock=lambda: clock.now, rounds=5)
    ads = _ads(out.getvalue())
    assert len(ads) == 2  # the first look, and the freed partition
    assert "MigdLargestPlaceableMB = 0" in ads[0]
    assert "MigdLargestPlaceableMB = 40448" in ads[1]
    assert clock.sleeps == [0.5] * 5  # a look every interval; migd is asked, not NVML


def test_watch_sends_a_queue_change_to_the_startd_only() -> None:
    states = iter([_status(40448), _status(40448, queued=2), _status(40448, queued=2)])
    out, clock = io.StringIO(), Clock()
    watch(lambda: next(states), out, sleep=clock.sleep, clock=lambda: clock.now, rounds=3)
    text = out.getvalue()
    # the first ad updates the collector; the queue change is merged by the startd (START
    # and the next periodic update see it) without an update of every slot ad
    assert text.count("- migd update:true\n") == 1
    assert text.count("- migd\n") == 1 and text.endswith("- migd\n")
    assert "MigdQueued = 2" in text.split("- migd update:true\n")[1]


def test_watch_repeats_the_ad_after_the_keepalive_and_reports_a_down_daemon() -> None:
    calls = 0

    def fetch() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise DaemonUnavailable("migd is not running")
        return _status(40448)

    out, clock = io.StringIO(), Clock()
    watch(
        fetch,
        out,
        sleep=clock.sleep,
        clock=lambda: clock.now,
        interval_s=1.0,
        updates=AdUpdates(rand=lambda: 0.0, keepalive_s=1.5),
        rounds=5,
    )
    ads = _ads(out.getvalue())
    # t=0 ad; t=1 same ad, within the keep-alive: nothing; t=2 migd down; t=3 back;
    # t=4 unchanged but 1 s is short of the keep-alive: nothing
    assert len(ads) == 3
    assert ads[1] + "- migd update:true\n" == render_unavailable("migd is not running")
    assert "MigdHealthy = true" in ads[2]


def test_max_vram_is_the_largest_partition_of_a_managed_gpu() -> None:
    gpus = [
        {"uuid": "GPU-a", "mode": "mig", "vram_mib": 40448},
        {"uuid": "GPU-b", "mode": "mps", "vram_mib": 32768},
        {"uuid": "GPU-c", "mode": "off", "vram_mib": 81920},
    ]
    assert max_vram(gpus) == 40448
    assert max_vram([]) == 0


def test_migctl_watch_publishes_a_freed_partition_at_once(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xA100-40GB"
    daemon.start()
    client = daemon.client()
    lease = client.lease(job_id="1.0", gpu_memory_mib=40000, mode="mig", wait_s=10)
    migctl = [sys.executable, "-m", "migd.cli.migctl", "--socket", str(daemon.socket_path)]
    proc = subprocess.Popen(
        [*migctl, "condor-ad", "--watch", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = _read_ad(proc.stdout)
        assert "MigdLargestPlaceableMB = 0" in first  # the whole GPU is held
        released = time.monotonic()
        client.release(lease["lease_id"], reason="job ended")
        freed = _read_ad(proc.stdout)
        latency = time.monotonic() - released
        assert "MigdLargestPlaceableMB = 40448" in freed
        # Published at the next 0.2 s poll, not the 60 s heartbeat: a bound a quarter of the
        # heartbeat tells the two apart and is far above what a loaded host needs.
        assert latency < 15.0, f"the freed partition took {latency:.2f} s to be published"
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def _read_ad(stream: IO[str]) -> str:
    lines = []
    for line in stream:
        lines.append(line)
        if line.startswith("-"):
            return "".join(lines)
    raise AssertionError(f"the watcher ended: {''.join(lines)}")


def test_migctl_max_vram_prints_the_node_value(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xA100-40GB,1xH100-80GB"
    daemon.start()
    result = subprocess.run(
        [sys.executable, "-m", "migd.cli.migctl", "--socket", str(daemon.socket_path), "max-vram"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    full = max(g["full_profile_mib"] for g in daemon.client().status()["gpus"])
    assert full > 40448  # the H100's full profile, not the A100's
    assert result.stdout == f"MIGD_MAX_VRAM = {full}\n"
