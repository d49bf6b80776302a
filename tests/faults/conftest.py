"""Fault injection: a small tmpfs for a full or read-only state disk, misbehaving clients.

The tmpfs needs root (``mount``); without it these tests skip, they do not pretend.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# The daemon-process fixture (a real migd on simulated GPUs) is shared with tests/process.
from tests.process.conftest import daemon  # noqa: F401


@dataclass
class SmallDisk:
    """A tmpfs of a few hundred KiB that a test can fill, free and remount read-only."""

    path: Path

    def fill(self) -> None:
        """Write until the file system says ENOSPC (the filler is kept until :meth:`free`)."""
        fd = os.open(self.path / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        finally:
            os.close(fd)
        # Smaller writes fill the last partial page too.
        fd = os.open(self.path / "filler", os.O_WRONLY | os.O_APPEND)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0")
        os.close(fd)

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / "filler").unlink()

    def read_only(self, on: bool = True) -> None:
        mode = "remount,ro" if on else "remount,rw"
        subprocess.run(["mount", "-o", mode, str(self.path)], check=True)

    def files(self) -> dict[str, int]:
        return {p.name: p.stat().st_size for p in self.path.iterdir() if p.name != "filler"}


def mount_small_disk(path: Path, size: str = "768k") -> SmallDisk:
    if os.geteuid() != 0:
        pytest.skip("a tmpfs state disk needs root (mount)")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    return SmallDisk(path)


def unmount(disk: SmallDisk) -> None:
    subprocess.run(["umount", "-l", str(disk.path)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    disk = mount_small_disk(tmp_path / "state")
    try:
        yield disk
    finally:
        unmount(disk)
