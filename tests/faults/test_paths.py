"""Item 6: what migd creates under its runtime and state directories is never redirected."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from migd.backends.mps import MpsManager, MpsManagerConfig
from migd.errors import ConfigError, MigdError
from migd.paths import check_directory_chain, ensure_dir


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def runtime(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    run.chmod(0o755)
    return run


def test_a_symlinked_mps_directory_is_refused_and_its_target_untouched(
    runtime: Path, tmp_path: Path
) -> None:
    """The attack of the issue: ``<runtime>/mps -> a private directory``; migd chmodded the
    target 0755 at start."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    (runtime / "mps").symlink_to(private)
    manager = MpsManager(runtime, MpsManagerConfig(binary="/bin/false"))
    with pytest.raises(MigdError, match="symlink"):
        manager.start()
    assert _mode(private) == 0o700


def test_a_symlinked_runtime_directory_is_refused(runtime: Path, tmp_path: Path) -> None:
    link = tmp_path / "run-link"
    link.symlink_to(runtime)
    with pytest.raises(ConfigError, match="symlink"):
        ensure_dir(link, "mps", 0o755)
    assert not (runtime / "mps").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_runtime_directory_owned_by_a_user_is_refused(runtime: Path) -> None:
    os.chown(runtime, 4242, 4242)
    with pytest.raises(ConfigError, match="uid 4242"):
        ensure_dir(runtime, "mps", 0o755)
    assert not (runtime / "mps").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_an_intermediate_directory_of_another_user_is_refused(runtime: Path) -> None:
    (runtime / "mps").mkdir()
    os.chown(runtime / "mps", 4242, 4242)
    with pytest.raises(ConfigError, match="uid 4242"):
        ensure_dir(runtime, "mps/dev", 0o755)
    assert not (runtime / "mps" / "dev").exists()


def test_world_writable_runtime_directory_is_refused(runtime: Path) -> None:
    runtime.chmod(0o777)
    with pytest.raises(ConfigError, match="world-writable"):
        check_directory_chain(runtime, "daemon.runtime_dir")


def test_a_symlink_deeper_down_is_refused_not_followed(runtime: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (runtime / "mps").mkdir()
    (runtime / "mps" / "dev").symlink_to(target)
    with pytest.raises(ConfigError, match="symlink"):
        ensure_dir(runtime, "mps/dev/pipe", 0o700)
    assert not (target / "pipe").exists()


def test_directories_are_made_with_their_mode_and_owner(runtime: Path) -> None:
    made = ensure_dir(runtime, "mps/dev/pipe", 0o700, owner=(os.getuid(), os.getgid()))
    assert made == runtime / "mps" / "dev" / "pipe"
    assert _mode(made) == 0o700 and _mode(runtime / "mps") == 0o755
    assert ensure_dir(runtime, "mps/dev/pipe", 0o711) == made  # again: idempotent
    assert _mode(made) == 0o711
