"""paths.InstanceLock: one migd per state and runtime directory (issue 23, section 1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from migd.errors import AlreadyRunning, ConfigError
from migd.paths import InstanceLock


def dirs(tmp_path: Path) -> list[tuple[Path, str]]:
    for name in ("state", "run"):
        (tmp_path / name).mkdir(mode=0o700, exist_ok=True)
    return [(tmp_path / "state", "daemon.state_dir"), (tmp_path / "run", "daemon.runtime_dir")]


def test_a_second_holder_is_refused_with_the_first_ones_pid_until_released(
    tmp_path: Path,
) -> None:
    first = InstanceLock.acquire(dirs(tmp_path))
    with pytest.raises(AlreadyRunning) as refused:
        InstanceLock.acquire(dirs(tmp_path))
    assert f"another migd (pid {os.getpid()}) is running on {tmp_path / 'state'}" in str(
        refused.value
    )
    assert refused.value.details["holder_pid"] == os.getpid()
    # Only the runtime directory shared: refused as well, by that one's lock.
    (tmp_path / "other").mkdir(mode=0o700)
    with pytest.raises(AlreadyRunning, match=r"daemon\.runtime_dir"):
        InstanceLock.acquire([(tmp_path / "other", "daemon.state_dir"), dirs(tmp_path)[1]])
    first.release()
    InstanceLock.acquire(dirs(tmp_path)).release()


def test_all_or_none_and_one_lock_for_one_directory(tmp_path: Path) -> None:
    state, run = dirs(tmp_path)
    held = InstanceLock.acquire([run])
    with pytest.raises(AlreadyRunning):
        InstanceLock.acquire([state, run])
    held.release()
    InstanceLock.acquire([state]).release()  # the failed try left the state one free
    same = InstanceLock.acquire([state, (state[0], "daemon.runtime_dir")])  # no self-deadlock
    same.release()


def test_a_symlinked_lock_file_is_refused_not_followed(tmp_path: Path) -> None:
    state, _ = dirs(tmp_path)
    target = tmp_path / "victim"
    target.write_text("precious\n")
    (state[0] / "migd.lock").symlink_to(target)
    with pytest.raises(ConfigError, match="symlink"):
        InstanceLock.acquire([state])
    assert target.read_text() == "precious\n"
