"""The file that keeps a simulated node's GPUs across restarts, as real GPUs keep theirs.

Real MIG instances outlive the process that created them: after ``kill -9 migd``
the GPUs still hold every instance, and the processes still run on them. With
``backend.sim_state_file`` set, :class:`~migd.backends.simulated.node.SimNode`
gives the simulated GPUs the same property: it writes its whole state to this
file after every change, and a new node built with the same file starts from it.

This module is the state file's one job: what it holds (:func:`snapshot`), how a node
is rebuilt from it and checked on load (:func:`restore`), the atomic write, the checked
read and the errors.

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
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from migd.backends.simulated import nvml_api as api
from migd.backends.simulated.state import SimGpu, SimProcess
from migd.errors import ConfigError, MigdError, StateStoreError

if TYPE_CHECKING:
    from migd.backends.simulated.node import SimNode

# The node's log: a process dropped on load is news about the simulated node.
_log = logging.getLogger("migd.backends.simulated.node")

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


def save(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` (:func:`snapshot`'s) to ``path`` atomically.

    Raises:
        StateStoreError: the file cannot be written (``path`` keeps the older state).
    """
    try:
        write_atomic(path, encode_state(state))
    except OSError as exc:
        raise StateStoreError(
            f"cannot save the simulated GPUs' state to {path}: {exc.strerror or exc}",
            hint=(
                "make the directory writable and give it free space; until then the "
                "file holds an older state than the simulated GPUs"
            ),
            path=str(path),
        ) from exc


# -- what the file holds: a node's state, and its checked restore ---------------------------


def snapshot(node: SimNode) -> dict[str, Any]:
    """The node's state as JSON-ready data: what ``state_file`` holds.

    Per GPU: identity (model, name, UUID, checked against the description on load),
    MIG mode (current and pending), lost or not, and every GPU instance with its GI
    id, profile, placement start and compute instances (CI id, CI profile, MIG
    UUID). Per process: PID, device, the instance it runs on (GI/CI id), memory in
    use, MPS settings and the host start time of its PID. Plus the id counters:
    the handle serial and the MIG UUID generator's state, so a reloaded node never
    hands out a MIG UUID it handed out before.

    Not kept (they are not GPU state): injected faults, call counters, ``set_root``.
    """
    with node.lock:
        version, internal, gauss = node.mig.rng.getstate()
        return {
            "schema": SIM_STATE_SCHEMA,
            "seed": node.seed,
            "next_serial": node.mig.serials,
            "mig_uuid_rng": [version, list(internal), gauss],
            "gpus": [
                {
                    "index": gpu.index,
                    "model": gpu.spec.model,
                    "name": gpu.spec.name,
                    "uuid": gpu.uuid,
                    "mig_current": gpu.mig_current,
                    "mig_pending": gpu.mig_pending,
                    "lost": gpu.lost,
                    "instances": [
                        {
                            "gi_id": gi.gi_id,
                            "profile_id": gi.profile.profile_id,
                            "start": gi.start,
                            "cis": [
                                {
                                    "ci_id": ci.ci_id,
                                    "profile_index": ci.profile_index,
                                    "uuid": ci.uuid,
                                }
                                for _, ci in sorted(gi.cis.items())
                            ],
                        }
                        for _, gi in sorted(gpu.instances.items())
                    ],
                }
                for gpu in node.gpus
            ],
            "processes": [
                {
                    "pid": proc.pid,
                    "gpu": proc.gpu,
                    "gi_id": node.mig.gi_by_serial[proc.gi_serial][1].gi_id
                    if proc.gi_serial is not None
                    else None,
                    "ci_id": node.mig.ci_by_serial[proc.ci_serial][2].ci_id
                    if proc.ci_serial is not None
                    else None,
                    "device_uuid": proc.device_uuid,
                    "used_mib": proc.used_mib,
                    "mps": proc.mps,
                    "mps_pinned_limit_mib": proc.mps_pinned_limit_mib,
                    "host_start_s": proc.host_start_s,
                    "mps_server": proc.mps_server,
                }
                for _, proc in sorted(node.procs.by_pid.items())
            ],
        }


def restore(node: SimNode, saved: dict[str, Any], path: Path) -> None:
    """Replace the description's initial state by ``saved`` (see :func:`snapshot`).

    Everything is checked as the driver would: placements legal, ids unique,
    compute slices and memory within the instance's. Processes whose PID no longer
    runs on the host (or runs a different process) are dropped into
    :attr:`SimNode.pruned_on_load`: a dead process's CUDA context is gone.

    Raises:
        ConfigError: ``saved`` was written for other GPUs, or is inconsistent.
    """
    try:
        _check_identity(node, saved["gpus"], path)
        _restore_checked(node, saved)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, MigdError, api.NVMLError) as exc:
        raise corrupt(path, f"{type(exc).__name__}: {exc}") from exc


def _check_identity(node: SimNode, saved_gpus: list[dict[str, Any]], path: Path) -> None:
    if not isinstance(saved_gpus, list):
        raise TypeError("'gpus' is not a list")
    if len(saved_gpus) != len(node.gpus):
        raise mismatch(
            path,
            f"the file has {len(saved_gpus)} GPU(s), the description {len(node.gpus)}",
        )
    for gpu, saved in zip(node.gpus, saved_gpus, strict=True):
        if not isinstance(saved, dict):
            raise TypeError(f"gpus[{gpu.index}] is not an object")
        mine = (gpu.spec.model, gpu.spec.name, gpu.uuid)
        theirs = (saved.get("model"), saved.get("name"), saved.get("uuid"))
        if mine != theirs:
            raise mismatch(
                path,
                f"GPU {gpu.index} is {_gpu_label(*theirs)} in the file but "
                f"{_gpu_label(*mine)} in the description",
            )


def _restore_checked(node: SimNode, saved: dict[str, Any]) -> None:
    node.procs.by_pid = {}
    node.mig.gi_by_serial = {}
    node.mig.ci_by_serial = {}
    node.mig.by_uuid = {}
    for gpu, entry in zip(node.gpus, saved["gpus"], strict=True):
        gpu.instances = {}
        gpu.lost = _bool(entry["lost"], "lost")
        if gpu.geometry is None:
            if entry["mig_current"] is not None or entry["mig_pending"] is not None:
                raise ValueError(f"GPU {gpu.index} has no MIG but a MIG mode is saved")
            gpu.mig_current = gpu.mig_pending = None
        else:
            gpu.mig_current = _bool(entry["mig_current"], "mig_current")
            gpu.mig_pending = _bool(entry["mig_pending"], "mig_pending")
        for inst in entry["instances"]:
            _restore_instance(node, gpu, inst)
    for entry in saved["processes"]:
        proc = _restored_process(node, entry)
        if proc is None:
            continue
        if not node.procs.host.alive(proc.pid, proc.host_start_s):
            # A dead process's context (and memory) go with it, as on a real GPU.
            node.pruned_on_load.append(proc)
            _log.info(
                "simulated process %d (%s) no longer runs on the host; dropped on load",
                proc.pid,
                proc.device_uuid,
            )
            continue
        node.procs.by_pid[proc.pid] = proc
    for gpu in node.gpus:
        for gi in gpu.instances.values():
            total, used = node.procs.memory_mib(gpu.index, gi.serial)
            if used > total:
                raise ValueError(f"processes use {used} MiB of GI {gi.gi_id}'s {total} MiB")
    node.mig.serials = max(node.mig.serials, _int(saved["next_serial"], "next_serial"))
    version, internal, gauss = saved["mig_uuid_rng"]
    node.mig.rng.setstate((int(version), tuple(int(x) for x in internal), gauss))


def _restore_instance(node: SimNode, gpu: SimGpu, inst: dict[str, Any]) -> None:
    where = f"GPU {gpu.index}"
    if gpu.geometry is None or not gpu.mig_current:
        raise ValueError(f"{where} has instances but MIG is not enabled")
    profile_id = _int(inst["profile_id"], "profile_id")
    profile = next((p for p in gpu.geometry.profiles if p.profile_id == profile_id), None)
    if profile is None:
        raise ValueError(f"{where} has no profile id {profile_id}")
    start, gi_id = _int(inst["start"], "start"), _int(inst["gi_id"], "gi_id")
    if gi_id in gpu.instances:
        raise ValueError(f"{where}: GPU instance id {gi_id} saved twice")
    refusal = node.mig.refusal(gpu, profile, start, profile.memory_slices)
    if refusal is not None:
        raise ValueError(
            f"{where}: {profile.name}@{start} is not placeable ({api.error_name(refusal)})"
        )
    gi = node.mig.add_gi(gpu, profile, start, gi_id=gi_id)
    for ci_entry in inst["cis"]:
        ci_id = _int(ci_entry["ci_id"], "ci_id")
        profile_index = _int(ci_entry["profile_index"], "profile_index")
        uuid = ci_entry["uuid"]
        if not isinstance(uuid, str) or not uuid.startswith("MIG-"):
            raise ValueError(f"{where}: {uuid!r} is not a MIG UUID")
        if uuid in node.mig.by_uuid:
            raise ValueError(f"{where}: MIG UUID {uuid} saved twice")
        if ci_id in gi.cis:
            raise ValueError(f"{where}: compute instance id {ci_id} saved twice in GI {gi_id}")
        slices, _ = node.mig.ci_profile(gi, profile_index)
        if sum(ci.slices for ci in gi.cis.values()) + slices > profile.compute_slices:
            raise ValueError(f"{where}: GI {gi_id}'s compute instances exceed its slices")
        node.mig.add_ci(gpu, gi, profile_index, uuid=uuid, ci_id=ci_id)


def _restored_process(node: SimNode, entry: dict[str, Any]) -> SimProcess | None:
    pid = _int(entry["pid"], "pid")
    if pid in node.procs.by_pid or any(p.pid == pid for p in node.pruned_on_load):
        raise ValueError(f"pid {pid} saved twice")
    gpu_index = _int(entry["gpu"], "gpu")
    if not 0 <= gpu_index < len(node.gpus):
        raise ValueError(f"pid {pid}: no GPU {gpu_index}")
    gpu = node.gpus[gpu_index]
    device_uuid = entry["device_uuid"]
    gi_serial = ci_serial = None
    if entry["gi_id"] is None:
        if device_uuid != gpu.uuid:
            raise ValueError(f"pid {pid}: {device_uuid!r} is not GPU {gpu.index}")
    else:
        gi = gpu.instances[_int(entry["gi_id"], "gi_id")]
        ci = gi.cis[_int(entry["ci_id"], "ci_id")]
        if device_uuid != ci.uuid:
            raise ValueError(f"pid {pid}: {device_uuid!r} is not the saved MIG device")
        gi_serial, ci_serial = gi.serial, ci.serial
    used_mib = _int(entry["used_mib"], "used_mib")
    raw_limit = entry["mps_pinned_limit_mib"]
    limit = None if raw_limit is None else _int(raw_limit, "mps_pinned_limit_mib")
    start_s = entry["host_start_s"]
    if used_mib < 0 or (limit is not None and used_mib > limit):
        raise ValueError(f"pid {pid}: {used_mib} MiB in use is out of range")
    if start_s is not None and not isinstance(start_s, int | float):
        raise TypeError(f"pid {pid}: host_start_s is not a number")
    return SimProcess(
        pid=pid,
        gpu=gpu.index,
        gi_serial=gi_serial,
        ci_serial=ci_serial,
        device_uuid=device_uuid,
        used_mib=used_mib,
        mps=_bool(entry["mps"], "mps"),
        mps_pinned_limit_mib=limit,
        host_start_s=None if start_s is None else float(start_s),
        mps_server=_bool(entry.get("mps_server", False), "mps_server"),
    )


def _int(value: Any, name: str) -> int:
    # bool is an int subclass; a saved true/false where a number belongs is corruption.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} is {value!r}, not an integer")
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} is {value!r}, not true/false")
    return value


def _gpu_label(model: Any, name: Any, uuid: Any) -> str:
    return f"{model or name} ({uuid})"


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
    "restore",
    "save",
    "snapshot",
    "write_atomic",
]
