"""What the MPS manager keeps of each daemon, on disk and in memory.

On disk, per MPS device, under ``<runtime>/mps/<uuid>/``: the daemon's ``pipe``
directory (with the pid file the daemon writes), per-user ``log/uid-<N>``
directories and migd's own record, :data:`RECORD_FILE_NAME`, of a daemon it
started. A later migd reads these back to adopt live daemons and clean up dead
ones (:meth:`migd.backends.mps.MpsManager.start`); logs are kept for post-mortems.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from migd.core.mps import MpsShare
from migd.errors import ConfigError, MpsError
from migd.paths import ensure_dir

from .procs import daemon_env_value, daemon_visible_devices
from .runner import RunAs

PID_FILE_NAME = "nvidia-cuda-mps-control.pid"  # written by the daemon into its pipe dir
CONTROL_SOCKET_NAME = "control"  # "Starting control daemon using socket <pipe>/control"
RECORD_FILE_NAME = "migd-mps.json"
# AF_UNIX sun_path holds 108 bytes with the terminator. Past it the daemon cannot bind
# its control socket and the front end only says it cannot find the daemon.
SOCKET_PATH_MAX_BYTES = 107


class MpsLayout:
    """Where each device's daemon lives under ``root`` (``<runtime>/mps``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def dir_name(device_uuid: str) -> str:
        """Directory name for a device: the UUID, with the legacy MIG form's ``/`` as ``_``."""
        name = re.sub(r"[^A-Za-z0-9._-]", "_", device_uuid)
        if not name or name in {".", ".."}:
            raise MpsError(f"unusable device UUID {device_uuid!r}")
        return name

    def device_dir(self, device_uuid: str) -> Path:
        return self.root / self.dir_name(device_uuid)

    def pipe_dir(self, device_uuid: str) -> Path:
        return self.device_dir(device_uuid) / "pipe"

    def log_dir(self, device_uuid: str, uid: int | None = None) -> Path:
        """The log directory of the daemon that serves ``uid`` on the device.

        Each user gets their own (``log/uid-<N>``): a per-user daemon runs as its user and
        owns its logs, and the next user's daemon must not read the last one's.
        ``uid=None`` is the device's log root.
        """
        root = self.device_dir(device_uuid) / "log"
        return root if uid is None else root / f"uid-{uid}"

    def make_dir(self, path: Path, mode: int, owner: RunAs | None = None) -> None:
        # Through migd.paths: the runtime directory is checked like the socket's,
        # and nothing under it is followed if it is a symlink (a user's `mps -> /root`
        # must not make migd chmod /root). Only the directory is chowned: log directories
        # are per user, so nothing in them belongs to anybody else.
        base = self.root.parent
        try:
            ensure_dir(
                base,
                path.relative_to(base),
                mode,
                owner=(owner.uid, owner.gid) if owner is not None else None,
            )
        except ConfigError as exc:
            raise MpsError(
                f"unsafe MPS directory {path}: {exc.message}", hint=exc.hint, where=exc.where
            ) from exc
        except (OSError, ValueError) as exc:
            raise MpsError(
                f"cannot prepare MPS directory {path}: {exc}",
                hint="migd needs to own its runtime directory (run it as root)",
            ) from exc


@dataclass
class DaemonRecord:
    """What the manager knows of a control daemon it started (persisted as JSON)."""

    device_uuid: str
    pid: int
    pipe_dir: str
    log_dir: str
    uid: int  # the user the daemon runs as
    gid: int
    serves_uid: int  # the user whose server it runs (0 in multi-user mode)
    multi_user: bool
    started_at: float
    default_limit_mib: int = 0
    # Active thread percentage set on the daemon and its servers (100: the daemon's own
    # default, nothing set).
    thread_percentage: int = 100
    run_as_self: bool = False  # not root: could not switch user, ran as migd's own uid
    scope_unit: str = ""  # the transient systemd scope it runs in ("" when none)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DaemonRecord:
        data = json.loads(text)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class AdoptionReport:
    adopted: tuple[str, ...] = ()  # device UUIDs whose live daemon was taken over
    cleaned: tuple[str, ...] = ()  # directories removed (no live daemon)
    # Device UUIDs whose recorded daemon (started by an earlier migd) was dead or wedged:
    # the clients of leases on them are gone.
    lost: tuple[str, ...] = ()


@dataclass
class Daemon:
    """A control daemon the manager runs: its record and what it has seen of it since."""

    record: DaemonRecord
    shares: dict[str, MpsShare] = field(default_factory=dict)
    idle_since: float | None = None
    known_servers: set[int] = field(default_factory=set)
    log_offsets: dict[str, int] = field(default_factory=dict)
    healthy: bool = True
    last_error: str = ""
    reported: tuple[str, str] | None = None  # (problem, detail) from a client's report
    # Refused clients while the server served others (client cap, or a sick server):
    # how many, and the most clients connected at a refusal (the device's cap as seen).
    refusals: int = 0
    clients_at_refusal: int | None = None
    # A refusal came while clients were connected: restart once they are gone (a restart
    # now would kill every one of them), if the device still refuses then.
    restart_when_drained: bool = False

    def count_refusal(self, connected: int | None) -> None:
        """A client was refused with ``connected`` clients on the device (None or 0: it
        could not say, and the cap as seen stays what it was)."""
        self.refusals += 1
        if connected:
            self.clients_at_refusal = max(self.clients_at_refusal or 0, connected)


def write_record(record: DaemonRecord) -> None:
    path = Path(record.pipe_dir).parent / RECORD_FILE_NAME
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(record.to_json(), encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise MpsError(f"cannot write {path}: {exc}") from exc


def read_record(device_dir: Path) -> DaemonRecord | None:
    try:
        return DaemonRecord.from_json((device_dir / RECORD_FILE_NAME).read_text("utf-8"))
    except (OSError, ValueError, TypeError):
        return None


def record_for_foreign(
    device_dir: Path, pid: int, *, multi_user: bool, now: float
) -> DaemonRecord | None:
    """A record for a live daemon found in our directory without one (record lost)."""
    try:
        stat = Path(f"/proc/{pid}").stat()
    except OSError:
        return None
    uuid = daemon_visible_devices(pid) or device_dir.name
    return DaemonRecord(
        device_uuid=uuid,
        pid=pid,
        pipe_dir=str(device_dir / "pipe"),
        log_dir=daemon_env_value(pid, "CUDA_MPS_LOG_DIRECTORY") or str(device_dir / "log"),
        uid=stat.st_uid,
        gid=stat.st_gid,
        serves_uid=stat.st_uid,
        multi_user=multi_user,
        started_at=now,
        run_as_self=os.geteuid() != 0,
    )


def remove_stale(device_dir: Path) -> None:
    """Drop a device's pipe directory and record; keep its logs for post-mortems."""
    shutil.rmtree(device_dir / "pipe", ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        (device_dir / RECORD_FILE_NAME).unlink()
