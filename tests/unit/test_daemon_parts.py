"""Daemon building blocks: config, API decoding (fuzzed), state store, renderers, unit file."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migd.api import LeaseRequestMsg, decode_request
from migd.cli.condor_ad import render_condor_ad, render_inventory, short_uuid
from migd.cli.migctl import slice_bar
from migd.core.leases import LeaseState
from migd.core.scheduler import Lease, LeaseRequest
from migd.daemon.config import (
    MigdConfig,
    changed_restart_keys,
    example_toml,
    load_config,
    validate_config,
)
from migd.daemon.store import StateStore
from migd.errors import ConfigError, ProtocolError

REPO = Path(__file__).resolve().parents[2]

# -- config -----------------------------------------------------------------------------------


def test_precedence_file_env_flag(tmp_path: Path) -> None:
    path = tmp_path / "migd.toml"
    path.write_text('version = 1\n[policy]\nqueue = "size"\naging_s = 5\n')
    assert load_config(path, environ={}).policy.queue == "size"
    env = {"MIGD_POLICY_AGING_S": "7", "MIGD_API_LEASE_USERS": '["*"]'}
    cfg = load_config(path, environ=env)
    assert cfg.policy.aging_s == 7 and cfg.api.lease_users == ["*"]
    cfg = load_config(path, environ=env, overrides={"policy.aging_s": 9})
    assert cfg.policy.aging_s == 9


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('version = 1\n[policy]\nqueue = "lifo"\n', "policy.queue"),
        ("version = 1\n[policy]\naging_s = -1\n", "policy.aging_s"),
        ("version = 1\n[api]\nsockett = 1\n", "api.sockett"),
        ('version = 1\n[[gpu]]\nmatch = "0"\nmode = "warp"\n', "gpu[0].mode"),
        ("version = 2\n", "version"),
        ("version = 1\n[policy\n", "migd.toml"),
    ],
)
def test_config_errors_name_the_place(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "migd.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert where in err.value.message


def test_missing_explicit_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml", environ={})


def test_example_config_is_valid_and_complete() -> None:
    data = tomllib.loads(example_toml())
    cfg = validate_config(data)
    assert cfg == MigdConfig()
    for section in ("daemon", "backend", "api", "policy", "reaper", "mps"):
        assert section in data


def test_restart_keys_are_detected() -> None:
    old = MigdConfig()
    new = validate_config({"api": {"socket": "/tmp/x.sock"}, "policy": {"queue": "size"}})
    assert changed_restart_keys(old, new) == ["api.socket"]


# -- API decoding -----------------------------------------------------------------------------


def test_decode_a_valid_lease() -> None:
    req = decode_request(
        b'{"version":1,"op":"lease","job_id":"12.0","gpu_memory_mib":4096,"mode":"mig"}'
    )
    assert isinstance(req, LeaseRequestMsg) and req.gpu_memory_mib == 4096


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_decoder_never_crashes_on_bytes(data: bytes) -> None:
    try:
        decode_request(data)
    except ProtocolError as exc:
        assert exc.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=500, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "version",
                "op",
                "job_id",
                "gpu_memory_mib",
                "lease_id",
                "gpu",
                "mode",
                "wait_s",
                "pid",
                "mib",
                "extra",
            ]
        ),
        json_values,
        max_size=8,
    )
)
def test_decoder_never_crashes_on_json(obj: dict[str, object]) -> None:
    obj.setdefault("version", 1)
    try:
        req = decode_request(json.dumps(obj).encode())
    except ProtocolError as exc:
        assert exc.message
    else:
        assert req.version == 1


# -- state store ------------------------------------------------------------------------------


def _lease(n: int) -> Lease:
    return Lease(
        f"L{n}",
        LeaseRequest(f"{n}.0", 1000 * n, wait_s=5),
        1000,
        4242,
        1.0,
        state=LeaseState.ACTIVE,
        gpu=0,
        profile="1g.5gb",
        start=6,
        mig_uuid="MIG-x",
    )


def test_store_round_trips_leases(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "migd.db")
    store.save_lease(_lease(1))
    store.record("granted", {"profile": "1g.5gb"}, lease_id="L1", job_id="1.0")
    store.close()
    again = StateStore(tmp_path / "migd.db")
    [lease] = again.live_leases()
    assert lease.to_dict() == _lease(1).to_dict()
    assert again.history(job_id="1.0")[0].data == {"profile": "1g.5gb"}
    assert sqlite3.connect(tmp_path / "migd.db").execute("PRAGMA journal_mode").fetchone() == (
        "wal",
    )


def test_background_checkpoints_keep_the_wal_bounded(tmp_path: Path) -> None:
    """With checkpoints moved to their thread, commits never checkpoint inline (the stall
    this avoids), the thread folds the WAL back, and close leaves no WAL behind."""
    path = tmp_path / "migd.db"
    wal = Path(str(path) + "-wal")
    store = StateStore(path)
    store.checkpoint_in_background(interval_s=3600)  # the thread waits: nothing folds
    assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
    for n in range(1, 1501):  # > 1000 pages: SQLite would have checkpointed inline
        store.save_lease(_lease(n))
    grown = wal.stat().st_size
    assert grown > 1000 * 4096
    store.close()
    assert not wal.exists() or wal.stat().st_size == 0
    assert len(StateStore(path).live_leases()) == 1500

    store = StateStore(path)
    store.checkpoint_in_background(interval_s=0.02)
    for n in range(1501, 3001):
        store.save_lease(_lease(n))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        last = store.last_checkpoint
        if last is not None and last[0] > 0 and last[0] == last[1]:
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"the WAL was not checkpointed: {store.last_checkpoint}")
    store.close()
    assert len(StateStore(path).live_leases()) == 3000


def test_corrupt_state_db_is_moved_aside(tmp_path: Path) -> None:
    db = tmp_path / "migd.db"
    db.write_bytes(b"this is not a sqlite database" * 100)
    store = StateStore(db)
    assert store.recovered_from is not None and store.recovered_from.exists()
    assert store.live_leases() == []
    store.save_lease(_lease(2))
    assert [lease.lease_id for lease in store.live_leases()] == ["L2"]


def test_an_unreadable_lease_row_does_not_stop_the_rest(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "migd.db")
    store.save_lease(_lease(3))
    store._db.execute("INSERT INTO leases VALUES('bad','x','active',0,0,'{not json')")
    assert [lease.lease_id for lease in store.live_leases()] == ["L3"]


# -- renderers --------------------------------------------------------------------------------


def _status(instances: list[dict[str, object]], **gpu: object) -> dict[str, object]:
    g = {
        "index": 0,
        "uuid": "GPU-61342749-a9b5-435e-9462-b9afcc9e0ac2",
        "model": "A100-40GB",
        "mode": "mig",
        "healthy": True,
        "health": "ok",
        "draining": False,
        "memory_total_mib": 40960,
        "units": 8,
        "instances": instances,
        "largest_placeable": {"profile": "3g.20gb", "memory_mib": 20091},
    }
    g.update(gpu)
    return {"gpus": [g], "queue": [], "daemon": {"version": "0.1.0"}}


def test_slice_bar_draws_each_unit() -> None:
    status = _status(
        [
            {
                "profile": "3g.20gb",
                "start": 0,
                "size": 4,
                "busy": True,
                "job_id": "7.0",
                "status": "ready",
                "origin": "migd",
            },
            {
                "profile": "1g.5gb",
                "start": 6,
                "size": 1,
                "busy": False,
                "job_id": None,
                "status": "ready",
                "origin": "migd",
            },
        ]
    )
    bar = slice_bar(status["gpus"][0], cell=9)  # type: ignore[index]
    assert len(bar) == 8 * 9
    assert bar.startswith("[") and "3g.20gb 7.0" in bar and "1g.5gb" in bar
    assert bar.count("free") == 3


def test_condor_ad_and_inventory() -> None:
    status = _status([])
    ad = render_condor_ad(status)
    assert "MigdHealthy = true" in ad and "MigdLargestPlaceableMB = 20091" in ad
    assert ad.rstrip().endswith("update:true")
    per_gpu = render_condor_ad(status, per_gpu=True)
    assert 'regexp("GPU-61342749_s", AssignedGPUs ?: "")' in per_gpu
    assert render_inventory([{"uuid": "GPU-61342749-a9b5", "mode": "mig"}], shares=3) == (
        'DetectedGPUs = "GPU-61342749_s0, GPU-61342749_s1, GPU-61342749_s2"\n'
    )
    assert short_uuid("GPU-61342749-a9b5-435e") == "GPU-61342749"
    unhealthy = render_condor_ad(_status([], healthy=False, health="NVML hung"))
    assert "MigdHealthy = false" in unhealthy and "MigdLargestPlaceableMB = 0" in unhealthy


# -- the systemd unit -------------------------------------------------------------------------


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is missing (apt-get install systemd)")
    migd = shutil.which("migd") or str(Path(__file__).resolve().parents[2] / ".venv/bin/migd")
    text = (REPO / "systemd" / "migd.service").read_text()
    assert "Type=notify" in text and "WatchdogSec=" in text
    assert "After=network.target nvidia-persistenced.service" in text
    assert "RuntimeDirectory=migd" in text and "StateDirectory=migd" in text
    unit = tmp_path / "migd.service"
    unit.write_text(text.replace("/usr/bin/migd", migd))
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, check=False, timeout=60
    )
    problems = [line for line in result.stderr.splitlines() if "migd.service" in line]
    assert result.returncode == 0 and problems == [], result.stderr


def test_configuration_doc_shows_the_current_example() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert example_toml() in doc, "regenerate docs/configuration.md's example block"
