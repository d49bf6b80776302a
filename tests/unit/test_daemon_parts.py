"""Daemon building blocks: config, API decoding (fuzzed), state store, renderers, unit file."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import structlog.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from migd.api import LeaseRequestMsg, decode_request
from migd.backends.accounts import SystemAccounts
from migd.cli.condor_ad import render_condor_ad, render_inventory
from migd.cli.migctl import slice_bar
from migd.core.condor_shares import short_uuid
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.daemon.api.server import check_socket_path
from migd.daemon.config import (
    MigdConfig,
    changed_restart_keys,
    example_toml,
    load_config,
    validate_config,
)
from migd.daemon.store.database import WAL_LIMIT_BYTES, StateDatabase
from migd.daemon.store.state import StateStore
from migd.daemon.systemd import Notifier
from migd.errors import ConfigError, ProtocolError
from tests.waiting import limit, wait_for

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


def test_environment_names_of_neighbours_are_not_migds(tmp_path: Path) -> None:
    """MIGD_<section>_* is migd's; the test harness's MIGD_CONDOR_ROOT and the package
    build's MIGD_PACKAGE_CACHE must never be read as settings (a ``[condor]`` section
    once made both refuse to start), while a typo in migd's own sections still is."""
    path = tmp_path / "migd.toml"
    path.write_text("version = 1\n")
    env = {"MIGD_CONDOR_ROOT": "/var/tmp/x", "MIGD_PACKAGE_CACHE": "/tmp/p"}
    assert load_config(path, environ=env).htcondor.offline_gpus is True
    assert (
        load_config(path, environ={"MIGD_HTCONDOR_OFFLINE_GPUS": "false"}).htcondor.offline_gpus
        is False
    )
    with pytest.raises(ConfigError, match="MIGD_HTCONDOR_OFFLINE_GPU"):
        load_config(path, environ={"MIGD_HTCONDOR_OFFLINE_GPU": "false"})


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
    assert isinstance(req, LeaseRequestMsg) and req.memory_mib == 4096


def test_a_lease_s_memory_has_one_name_and_the_wire_name_every_daemon_took() -> None:
    """``memory_mib`` in the code; ``gpu_memory_mib`` on the wire from every wrapper so
    far (and still, for daemons older than the new name); a missing one is named by the
    wire name."""
    line = b'{"version":1,"op":"lease","job_id":"12.0","memory_mib":2048}'
    req = decode_request(line)
    assert isinstance(req, LeaseRequestMsg) and req.memory_mib == 2048
    with pytest.raises(ProtocolError, match="gpu_memory_mib: Field required"):
        decode_request(b'{"version":1,"op":"lease","job_id":"12.0"}')


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


def test_background_checkpoints_fold_the_wal_back(tmp_path: Path) -> None:
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
    store.last_checkpoint = None  # only a round after the writes counts

    def folded() -> bool:
        last = store.last_checkpoint
        return last is not None and last[0] == last[1]

    wait_for(folded, what="the background thread to fold the WAL")
    store.close()
    assert len(StateStore(path).live_leases()) == 3000


def test_the_checkpointer_outlives_errors_logs_each_spell_once_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With wal_autocheckpoint off, nothing but the checkpointer folds the WAL: a thread
    that died on one error (its connection, say, on a disk that failed for a moment)
    would let the WAL grow until the disk is full. It tries again every round, says so
    once per spell, and says when it works again."""
    store = StateStore(tmp_path / "migd.db")
    real = StateDatabase._checkpoint_connection
    failures = iter(range(5))

    def flaky(self: StateDatabase) -> tuple[sqlite3.Connection, int]:
        if next(failures, None) is not None:
            raise sqlite3.OperationalError("disk I/O error")
        return real(self)

    monkeypatch.setattr(StateDatabase, "_checkpoint_connection", flaky)
    with structlog.testing.capture_logs() as logs:
        store.checkpoint_in_background(interval_s=0.01)
        for n in range(1, 51):
            store.save_lease(_lease(n))
        wait_for(
            lambda: store.last_checkpoint is not None,
            what="the checkpointer to fold the WAL after its connection failed",
        )
        store.close()
    events = [e["event"] for e in logs if e["event"].startswith("state.checkpoint")]
    assert events == ["state.checkpoint_failed", "state.checkpoint_recovered"]
    assert next(e for e in logs if e["event"] == "state.checkpoint_failed")["error"] == (
        "disk I/O error"
    )


def test_a_passive_checkpoint_that_could_not_run_is_not_a_round_without_commits() -> None:
    """SQLite answers (1, -1, -1) to a PASSIVE checkpoint while another connection (the
    writer's restart) checkpoints: read as frames == folded == the last round's, it
    would truncate the WAL as idle under load."""

    class Busy:
        def execute(self, sql: str) -> Any:
            assert sql == "PRAGMA wal_checkpoint(PASSIVE)"
            return sqlite3.connect(":memory:").execute("SELECT 1, -1, -1")

    db = StateDatabase.__new__(StateDatabase)
    db.last_checkpoint = (7, 7)
    assert db._passive(Busy()) is None  # type: ignore[arg-type]
    assert db.last_checkpoint == (7, 7)


def test_a_failed_wal_restart_is_not_retried_at_every_commit(tmp_path: Path) -> None:
    """Each try syncs the database on the event loop: after SQLite fails one, the
    checkpointer's next round decides whether to ask again."""
    store = StateStore(tmp_path / "migd.db")
    real = store._db

    class Refusing:
        in_transaction = False

        def __init__(self) -> None:
            self.restarts = 0

        def execute(self, sql: str, *args: Any) -> Any:
            if "wal_checkpoint(RESTART)" in sql:
                self.restarts += 1
                raise sqlite3.OperationalError("disk I/O error")
            return real.execute(sql, *args)

    refusing = Refusing()
    store._db = refusing  # type: ignore[assignment]
    try:
        store._wal_over_bound = True
        store._restart_wal_if_asked()
        store._restart_wal_if_asked()
    finally:
        store._db = real
    assert refusing.restarts == 1 and not store._wal_over_bound and store.wal_restarts == 0
    store.close()


@pytest.mark.parametrize("commits", ["one by one", "grouped as the daemon's"])
def test_the_wal_stays_bounded_while_writes_never_pause_and_shrinks_after(
    tmp_path: Path, commits: str
) -> None:
    """Under unbroken load a PASSIVE checkpoint folds every frame it saw, but SQLite starts
    the WAL over only when a write begins after all of them were folded, and some commit
    always came first: the file grew by every commit (717 MB in a minute at saturation,
    bench/results/wal_growth.md). Past its bound the checkpointer has the writer start
    it over at a commit. Here commits come back to back, as from a saturated loop: the
    WAL starts over again and again and never grows far past its bound; once they stop,
    the file is given back; nothing written is lost. The daemon's commits are deferred
    groups of batches (StateDatabase.defer_commits); here the group is committed at once,
    as the loop's next turn would."""
    path = tmp_path / "migd.db"
    wal = Path(f"{path}-wal")
    bound = 256 * 1024
    store = StateStore(path, wal_limit_bytes=bound)
    assert StateStore(tmp_path / "default.db").wal_limit_bytes == WAL_LIMIT_BYTES
    store.checkpoint_in_background(interval_s=0.01)
    grouped = commits != "one by one"
    if grouped:
        store.defer_commits(lambda commit: None)
    deadline = time.monotonic() + limit(60)
    peak, n = 0, 0
    try:
        while store.wal_restarts < 3:
            n += 1
            if grouped:
                with store.batch():
                    store.save_lease(_lease(n))
                store.commit_pending()
            else:
                store.save_lease(_lease(n))  # one commit each
            # Paced at about a saturated daemon's rate (0.5 ms a commit), not a bare loop's
            # 20,000 a second: commits still land inside every checkpoint round (so SQLite
            # never starts the WAL over by itself), and the ceiling below is seconds of
            # commits, not the 0.35 s a round of slow fsyncs on a busy disk could take.
            time.sleep(0.0005)
            peak = max(peak, wal.stat().st_size)
            # The ceiling is far above what a round of the checkpointer lets through, even
            # late on a loaded host; without the bound this loop writes 1 GB in seconds.
            if time.monotonic() > deadline or peak > 512 * bound:
                pytest.fail(
                    f"the WAL was not started over under {n} back-to-back commits: {peak} "
                    f"bytes, {store.wal_restarts} restarts, last checkpoint "
                    f"{store.last_checkpoint}"
                )
        # The write after a restart starts the WAL over: a frame or two in use, the file
        # still at its high-water mark, which is what the idle truncation gives back.
        assert store.probe()  # (one small row: a page or two)
        wait_for(lambda: wal.stat().st_size == 0, what="the idle WAL to be truncated")
    finally:
        store.close()
    assert len(StateStore(path).live_leases()) == n


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
    assert 'regexp("GPU-s[0-9]+-61342749", AssignedGPUs ?: "")' in per_gpu
    inventory = render_inventory([{"uuid": "GPU-61342749-a9b5", "mode": "mig"}], shares=3)
    assert inventory.startswith(
        'DetectedGPUs="GPU-s00-61342749, GPU-s01-61342749, GPU-s02-61342749"\n'
    )  # and a property ad per ID: tests/condor/test_device_hiding.py
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


# -- config: where a bad value came from -----------------------------------------------------


def test_env_and_flag_errors_name_their_source_once(tmp_path: Path) -> None:
    path = tmp_path / "migd.toml"
    path.write_text("version = 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={"MIGD_POLICY_QUEUE": "lifo"})
    message = err.value.message
    assert message.startswith("MIGD_POLICY_QUEUE (policy.queue): Input should be")
    assert message.count("policy.queue") == 1 and str(path) not in message
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={}, overrides={"policy.queue": "lifo"})
    assert err.value.message.startswith("--set policy.queue: Input should be")
    with pytest.raises(ConfigError) as err:
        load_config(
            path, environ={}, overrides={"api.socket": 5}, flag_names={"api.socket": "--socket"}
        )
    assert err.value.message.startswith("--socket (api.socket): ")
    path.write_text('version = 1\n[policy]\nqueue = "lifo"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert err.value.message == f"{path}: policy.queue: Input should be 'fifo' or 'size'"
    assert "reload" not in err.value.hint


def test_a_misspelt_migd_variable_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, environ={"MIGD_POLICY_QUEUEE": "size"})
    assert err.value.where == "MIGD_POLICY_QUEUEE"
    assert "did you mean MIGD_POLICY_QUEUE?" in err.value.hint
    # variables of other migd parts are not config keys and stay allowed
    cfg = load_config(None, environ={"MIGD_MAX_VRAM": "1", "MIGD_GPU_MEMORY_LIMIT_MIB": "2"})
    assert cfg == MigdConfig()


def test_start_up_config_error_says_how_to_fix_not_reload(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from migd.daemon.main import main

    assert main(["--set", "policy.queue=lifo", "--check-config"]) == 2
    err = capsys.readouterr().err
    assert "--set policy.queue: Input should be 'fifo' or 'size'" in err
    assert "reload" not in err and "--check-config" in err


# -- API decoding: nesting and version types --------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=30_000), st.sampled_from([b"[", b'{"a":']))
def test_decoder_refuses_deep_nesting_cleanly(depth: int, opener: bytes) -> None:
    closer = b"]" if opener == b"[" else b"}"
    inner = opener * depth + b"1" + closer * depth
    for payload in (inner, b'{"version":1,"op":"ping","x":' + inner + b"}"):
        with pytest.raises(ProtocolError) as err:
            decode_request(payload)
        if depth > 32:
            assert "nested deeper than 32" in err.value.message


@pytest.mark.parametrize("version", ["true", "1.0", '"1"', "null"])
def test_version_must_be_the_integer_1(version: str) -> None:
    with pytest.raises(ProtocolError, match="unsupported API version"):
        decode_request(f'{{"version": {version}, "op": "ping"}}'.encode())


def test_clients_do_not_import_pydantic() -> None:
    code = "import sys, migd.cli.migctl, migd.client; print('pydantic' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    assert out.strip() == "False"


# -- socket path safety -----------------------------------------------------------------------


@pytest.fixture
def tmp_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="migd-sockpath-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_socket_path_checks_every_ancestor(tmp_root: Path) -> None:
    safe = tmp_root / "a" / "b"
    safe.mkdir(parents=True, mode=0o755)
    check_socket_path(safe / "migd.sock")  # /tmp (sticky, root's) above is fine
    (tmp_root / "a").chmod(0o775)  # group-writable, not sticky, two levels up
    with pytest.raises(ConfigError, match="a is group-writable"):
        check_socket_path(safe / "migd.sock")
    (tmp_root / "a").chmod(0o1777)  # sticky but its owner is root: fine above the socket's
    check_socket_path(safe / "migd.sock")
    os.chown(tmp_root / "a", 65534, 65534)  # sticky, but another user owns it
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        check_socket_path(safe / "migd.sock")
    os.chown(tmp_root / "a", 0, 0)
    (tmp_root / "a").chmod(0o755)
    safe.chmod(0o1777)  # the socket's own directory may not be writable by others at all
    with pytest.raises(ConfigError, match="b is world-writable"):
        check_socket_path(safe / "migd.sock")
    safe.chmod(0o755)
    (tmp_root / "link").symlink_to(tmp_root / "a")  # a symlinked component above
    with pytest.raises(ConfigError, match="link is a symlink") as err:
        check_socket_path(tmp_root / "link" / "b" / "migd.sock")
    assert str(tmp_root / "a") in err.value.hint


# -- logs ---------------------------------------------------------------------------------------

LOG_SCRIPT = """
import structlog, sys
from migd.daemon.logs import configure_logging
configure_logging(sys.argv[1])
log = structlog.get_logger("migd")
log.info("one", x=1)
log.warning("two")
log.error("three")
"""


def _log_lines(tmp_path: Path, fmt: str, journal: bool) -> list[str]:
    out = tmp_path / f"log-{fmt}-{journal}"
    with out.open("w") as stream:
        env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
        if journal:
            st = os.fstat(stream.fileno())
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        subprocess.run(
            [sys.executable, "-c", LOG_SCRIPT, fmt], stderr=stream, env=env, check=True, cwd=REPO
        )
    return out.read_text().splitlines()


def test_log_format_selection_and_journal_priorities(tmp_path: Path) -> None:
    plain = _log_lines(tmp_path, "auto", journal=False)  # a file: JSON, no prefix
    assert [json.loads(line)["event"] for line in plain] == ["one", "two", "three"]
    journal = _log_lines(tmp_path, "auto", journal=True)
    assert [line[:3] for line in journal] == ["<6>", "<4>", "<3>"]
    assert json.loads(journal[1][3:])["level"] == "warning"
    console = _log_lines(tmp_path, "console", journal=False)
    assert "one" in console[0] and not console[0].startswith("{")
    # JOURNAL_STREAM inherited by a process whose stderr goes elsewhere does not count
    from migd.daemon.logs import stderr_is_journal

    with (tmp_path / "other").open("w") as stream:
        assert not stderr_is_journal(stream, {"JOURNAL_STREAM": "1:2"})
        st = os.fstat(stream.fileno())
        assert stderr_is_journal(stream, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})


# -- process start ticks ------------------------------------------------------------------------


def test_holder_start_is_kept_in_ticks_since_boot(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    from migd.backends.procs import PsutilProcessTable

    table = PsutilProcessTable()
    pid = os.getpid()
    start = table.start_time(pid)
    assert start is not None
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    assert start == ticks / os.sysconf("SC_CLK_TCK")
    assert start < time.clock_gettime(time.CLOCK_BOOTTIME)
    assert table.alive(pid, start)
    assert not table.alive(pid, start + 1 / os.sysconf("SC_CLK_TCK"))  # another process
    # A wall-clock step moves the kernel's boot time (and psutil's create_time) but not
    # the ticks: the holder stays alive.
    monkeypatch.setattr(psutil, "boot_time", lambda: time.time() - 1e6)
    assert table.alive(pid, start)
    monkeypatch.undo()
    # Leases written by older versions hold the wall-clock start: still understood.
    legacy = psutil.Process(pid).create_time()
    assert table.alive(pid, legacy) and not table.alive(pid, legacy - 1.0)


# -- condor ad ----------------------------------------------------------------------------------


def test_per_gpu_ad_has_free_memory_largest_profile_mode_and_health() -> None:
    status = _status(
        [
            {"memory_mib": 9984, "busy": True},
            {"memory_mib": 4864, "busy": False},
        ]
    )
    mps = {
        "index": 1,
        "uuid": "GPU-aaaaaaaa-0000",
        "model": "V100-32GB",
        "mode": "mps",
        "healthy": True,
        "health": "ok",
        "draining": True,
        "memory_total_mib": 32768,
        "instances": [],
        "mps": {"pinned_mib": 4000},
        "largest_placeable": {"profile": "mps", "memory_mib": 27000},
    }
    status["gpus"].append(mps)  # type: ignore[attr-defined]
    ad = render_condor_ad(status, per_gpu=True)
    gpu0, gpu1 = ad.split("- migd_gpu0")[0].split("- migd\n")[1], ad.split("- migd_gpu0")[1]
    assert "MigdGpuFreeMB = 30976" in gpu0  # 40960 - the busy 9984
    assert 'MigdGpuLargestPlaceableProfile = "3g.20gb"' in gpu0
    assert "MigdGpuLargestPlaceableMB = 20091" in gpu0 and "MigdGpuMemoryMB = 40960" in gpu0
    assert 'MigdGpuMode = "mig"' in gpu0 and "MigdGpuHealthy = true" in gpu0
    # a drained GPU offers nothing and says why
    assert "MigdGpuHealthy = false" in gpu1 and 'MigdGpuReason = "draining"' in gpu1
    assert "MigdGpuFreeMB = 0" in gpu1 and 'MigdGpuLargestPlaceableProfile = ""' in gpu1
    assert "MigdFreeMB = 30976" in ad  # node-wide: usable GPUs only


def test_release_job_permission_follows_hook_users() -> None:
    from migd.backends.simulated.accounts import FakeAccounts
    from migd.daemon.api.auth import Authorizer, Peer

    # The hook's user by name, as sites write it; the accounts are the test's, not the host's.
    accounts = FakeAccounts(users={0: "root", 4242: "condorhook"}, groups={"hooks": 4242})
    api = MigdConfig().api
    auth = Authorizer(api, accounts)
    assert auth.may_release_any(Peer(1, 0, 0))  # root
    assert not auth.may_release_any(Peer(1, 4242, 4242))
    hook = Authorizer(api.model_copy(update={"hook_users": ["condorhook"]}), accounts)
    assert hook.may_release_any(Peer(1, 4242, 4242))
    assert not hook.may_lease(Peer(1, 4242, 4242))  # a hook user is not a lease user
    assert not hook.may_release_any(Peer(1, 4243, 4243))  # another user is not


# -- watchdog -----------------------------------------------------------------------------------


class _Pings(Notifier):
    def __init__(self) -> None:
        super().__init__(environ={})
        self.watchdog_s = 1.0
        self.sent: list[tuple[float, str]] = []

    def notify(self, *fields: str) -> bool:
        self.sent.extend((time.monotonic(), f) for f in fields)
        return True

    def pings(self, since: float, until: float) -> list[float]:
        return [t for t, f in self.sent if f == "WATCHDOG=1" and since <= t <= until]


class _GatedBackend:
    """The simulated backend, with creations slowed and heartbeats that can hang."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.create_s = 0.0
        self.hang = threading.Event()
        self.unhang = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def heartbeat(self, gpu: int) -> None:
        if self.hang.is_set():
            self.unhang.wait(30)
        self.inner.heartbeat(gpu)

    def create_instance(self, gpu: int, profile_id: int, start: int) -> Any:
        time.sleep(self.create_s)
        return self.inner.create_instance(gpu, profile_id, start)


@pytest.mark.slow  # real threads and the real clock: several seconds
def test_watchdog_fed_through_a_slow_create_and_starved_by_a_hung_thread(tmp_root: Path) -> None:
    """WatchdogSec 1 s: a 2.5 s creation (within daemon.work_timeout_s) keeps the pings
    coming; a heartbeat that hangs stops them."""
    from migd.backends.procs import PsutilProcessTable
    from migd.backends.simulated import simulated_backend
    from migd.client import MigdClient
    from migd.daemon.service import Daemon

    config = validate_config(
        {
            "daemon": {
                "state_dir": str(tmp_root / "state"),
                "runtime_dir": str(tmp_root / "run"),
                "work_timeout_s": 30,
            },
            "backend": {"kind": "simulated"},
            "api": {"socket": str(tmp_root / "run" / "migd.sock")},
        }
    )
    inner, _ = simulated_backend("2xA100-40GB")
    backend = _GatedBackend(inner)
    notifier = _Pings()

    async def scenario() -> None:
        daemon = Daemon(
            config,
            backend,  # type: ignore[arg-type]
            PsutilProcessTable(),
            accounts=SystemAccounts(),
            notifier=notifier,
        )
        await daemon.start()
        try:
            await asyncio.sleep(0.6)
            backend.create_s = 2.5
            began = time.monotonic()
            client = MigdClient(config.api.socket, timeout_s=30)
            lease = await asyncio.to_thread(
                client.lease, job_id="w.0", gpu_memory_mib=4000, wait_s=30
            )
            ended = time.monotonic()
            assert lease["prepared"] and ended - began >= 2.5
            pings = notifier.pings(began, ended)
            gaps = [b - a for a, b in zip([began, *pings], [*pings, ended], strict=True)]
            # pinged every 0.5 s; what systemd needs is no gap near WatchdogSec (2 s), and a
            # loaded CI host may delay one ping by a scheduler tick or two
            assert len(pings) >= 4 and max(gaps) < 1.5, (pings, gaps)
            backend.hang.set()  # the next heartbeat of each GPU thread never returns
            hung = time.monotonic()
            await asyncio.sleep(2.5)
            assert notifier.pings(hung + 1.2, time.monotonic()) == []
            assert daemon.executor.starved_gpus(0.5) == [0, 1]
        finally:
            backend.unhang.set()
            await daemon.close()

    try:
        asyncio.run(scenario())
    finally:
        gc.unfreeze()


def test_api_doc_lists_every_field_of_the_status_schema() -> None:
    schema = json.loads((REPO / "docs" / "status.schema.json").read_text())
    doc = (REPO / "docs" / "api.md").read_text()
    block = doc.split("## Status (`migctl status --json`), schema 1", 1)[1].split("## ", 1)[0]
    assert "docs/status.schema.json" in block
    listed = set(re.findall(r"[a-z_0-9]+", block))

    def fields(node: object) -> set[str]:
        out: set[str] = set()
        if isinstance(node, dict):
            out |= set(node.get("properties", {}))
            for value in node.values():
                out |= fields(value)
        elif isinstance(node, list):
            for value in node:
                out |= fields(value)
        return out

    missing = sorted(fields(schema) - listed)
    assert missing == [], f"docs/api.md's status block does not list {missing}"


def test_socket_group_is_looked_up_through_the_accounts_port() -> None:
    """The socket's group by name comes from the accounts port (not the host's group
    database), so it follows the same SIGHUP-cleared cache as the access rules."""
    from migd.backends.simulated.accounts import FakeAccounts
    from migd.daemon.api.server import socket_access
    from migd.daemon.config import ApiSection

    accounts = FakeAccounts(groups={"gpu-users": 4242})

    def private(group: str) -> ApiSection:
        return ApiSection(socket_group=group, status_public=False)

    assert socket_access(private("gpu-users"), accounts) == (0o660, 4242)
    assert socket_access(private("77"), accounts) == (0o660, 77)
    public = ApiSection(socket_group="gpu-users", lease_users=["*"], status_public=False)
    assert socket_access(public, accounts) == (0o666, 4242)
    with pytest.raises(ConfigError) as caught:
        socket_access(private("no-such-group"), accounts)
    assert caught.value.where == "api.socket_group" and "getent group" in (caught.value.hint or "")
