"""require_writable probes the state disk with a write of its own only when the disk
might refuse one (issue 26 §4: a committed probe before every lease)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from migd.daemon.store.state import StateStore


def probes(path: Path) -> int:
    """How many commits wrote the probe row (its value changes with each)."""
    with sqlite3.connect(path) as db:
        row = db.execute("SELECT value FROM meta WHERE key = 'disk_probe'").fetchone()
    return 0 if row is None else 1


def test_a_disk_with_room_is_not_probed_and_a_tight_one_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.db"
    store = StateStore(path)
    for _ in range(100):
        store.require_writable()
    assert probes(path) == 0  # tmp_path has more than 16 MiB free
    monkeypatch.setattr(StateStore, "PROBE_HEADROOM_BYTES", 1 << 62)  # no disk is that free
    store.require_writable()
    assert probes(path) == 1
    store.close()


def test_after_a_failed_write_every_request_is_probed(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = StateStore(path)
    store.failing = "the state disk refuses writes: full (test)"
    store.require_writable()  # the write goes through: the disk is back
    assert probes(path) == 1 and store.failing is None
    store.close()
