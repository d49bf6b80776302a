"""migd's one exception tree.

Every error a user or admin can meet derives from :class:`MigdError`. Each
carries a stable machine-readable ``code`` (sent over the API and printed by
``migctl``), a one-line message that says what happened, and a ``hint`` that
says what to do about it. Backends translate foreign errors (NVML, OS, SQLite,
HTCondor) into this tree once, at their boundary, with ``raise ... from exc``.

::

    MigdError
    ├── ConfigError                 bad config file, variable or flag (has ``where``)
    ├── GeometryError
    │   ├── UnknownModel            no placement table for a GPU model
    │   ├── UnknownProfile          a profile name/id the model does not have
    │   └── IllegalTransition       an allocate/release the state machine refuses
    │       ├── InvalidStart        start is not a legal placement of the profile
    │       ├── PlacementOverlap    slices already taken
    │       ├── InstanceLimitReached  profile's maximum instance count reached
    │       ├── ExclusiveConflict   e.g. a second ``+me`` instance (one OFA)
    │       └── InstanceNotFound    release of an instance that is not there
    ├── RequestError
    │   ├── InvalidRequest          malformed or out-of-range request
    │   ├── RequestTooLarge         can never fit on this node
    │   └── NoCapacity              cannot fit now (caller may queue)
    ├── GpuError                    NVML / GPU backend
    │   ├── GpuBusy                 "in use" (processes, DCGM, persistenced): retryable
    │   ├── InsufficientResources   slices taken (NVML_ERROR_INSUFFICIENT_RESOURCES)
    │   ├── GpuPermissionDenied     not root
    │   ├── MigModeError            MIG disabled, or a mode change pending a reset
    │   ├── GpuNotFound             unknown index/UUID, or the GPU fell off the bus
    │   ├── GpuUnsupported          the GPU or driver cannot do this
    │   └── DriverUnavailable       no NVML library / driver not loaded
    ├── MpsError                    MPS control daemon or server trouble
    ├── LeaseError
    │   ├── LeaseNotFound
    │   ├── NotAuthorized           peer credentials do not allow the operation
    │   └── LeaseTimeout            queued request passed its deadline
    ├── StateStoreError             SQLite state unreadable or corrupt
    │   └── StateDiskError          the state disk is full, read-only or failing
    ├── AlreadyRunning              another migd holds the state or runtime directory
    ├── ApiError
    │   ├── ProtocolError           malformed, oversized or unknown message
    │   └── DaemonUnavailable       no daemon answering on the socket
    └── JobAdError                  HTCondor job/machine ad missing or unreadable
"""

from __future__ import annotations

from typing import Any, ClassVar


class MigdError(Exception):
    """Base of every error migd raises on purpose.

    Args:
        message: what happened, in one line.
        hint: what to do about it, in one line (optional).
        **details: structured context (GPU index, profile, ...) for logs and the API.
    """

    code: ClassVar[str] = "migd_error"
    default_hint: ClassVar[str] = ""

    def __init__(self, message: str, *, hint: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint
        self.details = details

    def __str__(self) -> str:
        return f"{self.message} (hint: {self.hint})" if self.hint else self.message

    def to_dict(self) -> dict[str, Any]:
        """The error as the API sends it: code, message, hint, details."""
        return {
            "code": self.code,
            "message": self.message,
            "hint": self.hint,
            "details": {k: _jsonable(v) for k, v in self.details.items()},
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


class ConfigError(MigdError):
    """Invalid configuration; ``where`` names the key, e.g. ``gpus[1].mode``."""

    code = "config_error"
    default_hint = "fix the setting named; `migd --check-config` checks the whole configuration"

    def __init__(self, message: str, *, where: str = "", hint: str | None = None) -> None:
        super().__init__(f"{where}: {message}" if where else message, hint=hint, where=where)
        self.where = where


class GeometryError(MigdError):
    code = "geometry_error"


class UnknownModel(GeometryError):
    code = "unknown_model"
    default_hint = "run `migctl states --list-models`; unknown models work from NVML data"


class UnknownProfile(GeometryError):
    code = "unknown_profile"


class IllegalTransition(GeometryError):
    code = "illegal_transition"


class InvalidStart(IllegalTransition):
    code = "invalid_start"


class PlacementOverlap(IllegalTransition):
    code = "placement_overlap"


class InstanceLimitReached(IllegalTransition):
    code = "instance_limit"


class ExclusiveConflict(IllegalTransition):
    code = "exclusive_conflict"


class InstanceNotFound(IllegalTransition):
    code = "instance_not_found"
    default_hint = "`migctl status` lists the instances"


class RequestError(MigdError):
    code = "request_error"


class InvalidRequest(RequestError):
    code = "invalid_request"


class RequestTooLarge(RequestError):
    code = "request_too_large"
    default_hint = "ask for less GPU memory, or submit to a node with bigger GPUs"


class NoCapacity(RequestError):
    code = "no_capacity"
    default_hint = "the request can be queued (wait_s > 0) until a partition frees up"


class GpuError(MigdError):
    code = "gpu_error"


class GpuBusy(GpuError):
    code = "gpu_busy"
    default_hint = (
        "processes or another NVML client (DCGM, nvidia-persistenced, a monitor) hold the "
        "GPU/instance; migd retries, stop the other client if it persists"
    )


class InsufficientResources(GpuError):
    code = "insufficient_resources"
    default_hint = "the slices are taken; `migctl status` shows the current layout"


class GpuPermissionDenied(GpuError):
    code = "permission_denied"
    default_hint = "MIG management needs root: run migd as root (the systemd unit does)"


class MigModeError(GpuError):
    code = "mig_mode"
    default_hint = (
        "enable MIG with `nvidia-smi -i N -mig 1` while the GPU is idle, then reset the GPU "
        "or reboot if the mode is pending"
    )


class GpuNotFound(GpuError):
    code = "gpu_not_found"
    default_hint = "check `nvidia-smi -L`; a GPU that fell off the bus needs a node reboot"


class GpuUnsupported(GpuError):
    code = "gpu_unsupported"


class DriverUnavailable(GpuError):
    code = "driver_unavailable"
    default_hint = "is the NVIDIA driver loaded? `nvidia-smi` should work"


class MpsError(MigdError):
    code = "mps_error"


class LeaseError(MigdError):
    code = "lease_error"


class LeaseNotFound(LeaseError):
    code = "lease_not_found"
    default_hint = "`migctl leases` lists the current leases"


class NotAuthorized(LeaseError):
    code = "not_authorized"
    default_hint = "the daemon decides from the caller's uid/gid; see [api] in migd.toml"


class LeaseTimeout(LeaseError):
    code = "lease_timeout"
    default_hint = "no partition became free before the deadline; retry later or wait longer"


class StateStoreError(MigdError):
    code = "state_store_error"
    default_hint = (
        "the state database is unreadable; migd moved it aside and started empty, "
        "leases are re-adopted from the GPUs"
    )


class StateDiskError(StateStoreError):
    """The file system under the state directory refuses writes (full, read-only, I/O
    error). Nothing is wrong with the database itself: it is left where it is."""

    code = "state_disk"
    default_hint = (
        "free space on (or remount read-write) the file system of migd's state directory "
        "(`df -h /var/lib/migd`); migd retries by itself and recovers when writes succeed"
    )


class AlreadyRunning(MigdError):
    """Another migd holds the lock of the state or runtime directory: two daemons on one
    database would release each other's leases."""

    code = "already_running"
    default_hint = (
        "stop the other migd first (`systemctl stop migd`), or give this one its own "
        "--state-dir and --runtime-dir"
    )


class ApiError(MigdError):
    code = "api_error"


class ProtocolError(ApiError):
    code = "protocol_error"
    default_hint = "send one JSON object per line with a 'version' and an 'op' field"


class DaemonUnavailable(ApiError):
    code = "daemon_unavailable"
    default_hint = "is migd running? `systemctl status migd`"


class JobAdError(MigdError):
    code = "job_ad_error"
    default_hint = (
        "check the job's submit file (request_VRAM, request_GPUs, +Migd* attributes; "
        "docs/wrapper.md)"
    )


class ChirpError(MigdError):
    """``condor_chirp`` could not update the job ad (no IO proxy, timeout, refused)."""

    code = "chirp_error"
    default_hint = "submit with `+WantIOProxy = true`"


class StartdError(MigdError):
    """migd could not tell the node's startd which GPUs are out of service."""

    code = "startd_error"
    default_hint = (
        "check that condor_reconfig works as root on this node and that the HTCondor "
        "configuration includes migd's offline file (docs/operations.md, GPU health)"
    )


ERROR_CLASSES: dict[str, type[MigdError]] = {}


def _register(cls: type[MigdError]) -> None:
    ERROR_CLASSES[cls.code] = cls
    for sub in cls.__subclasses__():
        _register(sub)


_register(MigdError)


def error_from_dict(data: dict[str, Any]) -> MigdError:
    """Rebuild an error sent over the API (client side)."""
    cls = ERROR_CLASSES.get(str(data.get("code", "")), MigdError)
    err = MigdError.__new__(cls)
    MigdError.__init__(
        err,
        str(data.get("message", "unknown error")),
        hint=str(data.get("hint") or ""),
        **dict(data.get("details") or {}),
    )
    if isinstance(err, ConfigError):
        err.where = str(err.details.get("where", ""))
    return err
