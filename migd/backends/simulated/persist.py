"""The file that keeps a simulated node's GPUs across restarts, as real GPUs keep theirs.

Real MIG instances outlive the process that created them: after ``kill -9 migd``
the GPUs still hold every instance, and the processes still run on them. With
``backend.sim_state_file`` set, :class:`~migd.backends.simulated.node.SimNode`
gives the simulated GPUs the same property: it writes its whole state to this
file after every change, and a new node built with the same file starts from it.

This module is the file I/O only: the atomic write, the checked read and the
errors. What the state holds (and how it is checked on load) is in
:meth:`SimNode.snapshot <migd.backends.simulated.node.SimNode.snapshot>`.

Atomicity: the state is written to a temporary file in the same directory,
flushed and ``fsync``-ed, then renamed over the old file with :func:`os.replace`
(atomic on POSIX), and the directory is ``fsync``-ed. A crash at any moment
leaves the old state or the new one, never a mix; at worst a stray temporary
file, which the next node removes.

One node per file: two live nodes on the same file overwrite each other's state.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from migd.errors import ConfigError

SIM_STATE_SCHEMA = "migd-sim-state/1"
WHERE = "backend.sim_state_file"


def write_atomic(path: Path, payload: bytes) -> None:
    """Replace ``path``'s content with ``payload``: after a crash, old or new, never a mix.

    The directory is created if missing.

    Raises:
        OSError: the directory cannot be created, is not writable or is full (``path``
            is unchanged).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
    temp_path = Path(temp_name)
    try:
        with os.fdopen(fd, "wb") as temp:
            temp.write(payload)
            temp.flush()
            # Durable before it becomes visible: a rename of an unsynced file can survive a
            # power cut as an empty file on some file systems.
            os.fsync(temp.fileno())
        temp_path.replace(path)  # os.replace: atomic on POSIX
    except BaseException:
        with contextlib.suppress(OSError):
            temp_path.unlink()
        raise
    _fsync_directory(path.parent)


def temp_prefix(path: Path) -> str:
    """Name prefix of :func:`write_atomic`'s temporary files for ``path``."""
    return f".{path.name}."


def remove_stale_temps(path: Path) -> list[Path]:
    """Delete temporary files a crashed writer of ``path`` left behind; returns them.

    Only call this while no other writer uses ``path`` (one node per file).
    """
    removed: list[Path] = []
    prefix = temp_prefix(path)
    try:
        candidates = list(path.parent.iterdir())
    except OSError:
        return removed
    for candidate in candidates:
        if candidate.name.startswith(prefix) and candidate.name.endswith(".tmp"):
            with contextlib.suppress(OSError):
                candidate.unlink()
                removed.append(candidate)
    return removed


def read_state(path: Path) -> dict[str, Any] | None:
    """The saved state in ``path``, or ``None`` when there is no such file yet.

    Only the envelope is checked here (JSON object, schema); the node checks the rest.

    Raises:
        ConfigError: the file is unreadable, not JSON, or not a simulated-node state
            (``where="backend.sim_state_file"``; the hint says to delete it).
    """
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(
            f"cannot read {path}: {exc.strerror or exc}",
            where=WHERE,
            hint="fix the file's permissions, or point backend.sim_state_file elsewhere",
        ) from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise corrupt(path, f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise corrupt(path, "not a JSON object")
    if data.get("schema") != SIM_STATE_SCHEMA:
        raise corrupt(
            path, f"schema is {data.get('schema')!r}, this migd reads {SIM_STATE_SCHEMA!r}"
        )
    return data


def encode_state(state: dict[str, Any]) -> bytes:
    """The bytes :func:`write_atomic` stores for ``state`` (stable key order, one line)."""
    return json.dumps(state, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def corrupt(path: Path, detail: str) -> ConfigError:
    """The error for a state file that cannot be used (and what to do about it)."""
    return ConfigError(
        f"{path} is not a usable simulated-GPU state file ({detail})",
        where=WHERE,
        hint=(
            f"delete {path} to start with empty simulated GPUs (the instances it held, "
            "and the leases on them, are then gone)"
        ),
    )


def mismatch(path: Path, detail: str) -> ConfigError:
    """The error for a state file written for other GPUs than the description names."""
    return ConfigError(
        f"{path} holds the state of other GPUs than the description: {detail}",
        where=WHERE,
        hint=(
            "start with the description the file was written with (backend.simulate), "
            f"or delete {path} to start with empty simulated GPUs"
        ),
    )


def _fsync_directory(directory: Path) -> None:
    # The rename itself is durable only once the directory entry is on disk.
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (e.g. certain FUSE mounts) refuse fsync on directories
    finally:
        os.close(fd)


__all__ = [
    "SIM_STATE_SCHEMA",
    "WHERE",
    "corrupt",
    "encode_state",
    "mismatch",
    "read_state",
    "remove_stale_temps",
    "write_atomic",
]
