"""The ``status`` and ``explain`` replies (schema documented in docs/api.md; stable in v1)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from typing import Any

from migd import __version__
from migd.api import StatusReply
from migd.core.gpus import (
    ExclusiveState,
    GpuMode,
    ManagedGpu,
    ManagedInstance,
    MigState,
    ModeState,
    MpsState,
    OffState,
)
from migd.core.leases import Lease, LeaseState
from migd.core.mps import MpsPool
from migd.core.states import EMPTY, describe
from migd.daemon.context import DaemonContext
from migd.daemon.supervision.mps import cgroup_limits_status, mps_compute_mode_warning
from migd.daemon.supervision.startd_check import StartdReport
from migd.ports import GpuInfo

STATUS_SCHEMA = 1
#: Queued requests listed by status (the first, in policy order); queue_summary counts all.
STATUS_QUEUE_SHOWN = 20


def largest_placeable(daemon: DaemonContext, gpu: ManagedGpu) -> dict[str, Any] | None:
    """The biggest partition a new job could get on this GPU now (idle instances count)."""
    found = daemon.sched.mode_ops(gpu).largest_placeable(gpu) if gpu.available else None
    return None if found is None else {"profile": found[0], "memory_mib": found[1]}


def gpu_warnings(info: GpuInfo, gpu: ManagedGpu) -> list[str]:
    """GPU settings migd relies on but never changes (docs/operations.md)."""
    warnings = []
    if info.persistence_mode is False:
        warnings.append(
            "persistence mode is off: an idle GPU can be de-initialised and lose its MIG "
            "instances; enable nvidia-persistenced"
        )
    if gpu.mode is GpuMode.MPS or gpu.mps_in_mig:
        weak = mps_compute_mode_warning(info)
        if weak:
            warnings.append(weak)
    return warnings


def placeable(daemon: DaemonContext, gpu: ManagedGpu) -> int:
    """GPU memory new leases could still get on this GPU, in total (MiB); see
    :mod:`migd.core.capacity`. 0 when the GPU takes no work."""
    return daemon.sched.mode_ops(gpu).placeable_mib(gpu) if gpu.available else 0


def _gpu_status(daemon: DaemonContext, gpu: ManagedGpu, now: float) -> dict[str, Any]:
    info = next((g for g in daemon.gpus if g.index == gpu.index), None)
    out: dict[str, Any] = {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "model": gpu.model,
        "mode": gpu.mode.value,
        "mig_current": info.mig_current if info else None,
        "mig_pending": info.mig_pending if info else None,
        # condor_gpu_discovery's per-GPU properties (DriverVersion, MaxSupportedVersion,
        # Capability): `migctl gpu-inventory` advertises them so require_gpus matches.
        "driver_version": info.driver_version if info else None,
        "cuda_version": info.cuda_version if info else None,
        "compute_capability": (
            f"{info.compute_capability[0]}.{info.compute_capability[1]}"
            if info and info.compute_capability
            else None
        ),
        "health": str(gpu.health),
        "healthy": gpu.health.available,
        "conditions": [c.to_dict() for c in gpu.health.conditions.values()],
        "persistence_mode": info.persistence_mode if info else None,
        "compute_mode": info.compute_mode if info else None,
        "warnings": gpu_warnings(info, gpu) if info else [],
        "draining": gpu.draining,
        "memory_total_mib": gpu.memory_total_mib,
        "memory_used_mib": gpu.used_mib,
        "largest_placeable": largest_placeable(daemon, gpu),
        "placeable_mib": placeable(daemon, gpu),
        "instances": [],
    }
    out.update(_mode_status(daemon, gpu, gpu.state, now))
    return out


def _mode_status(
    daemon: DaemonContext, gpu: ManagedGpu, state: ModeState, now: float
) -> dict[str, Any]:
    """What only a GPU in this mode has: one function per mode's state, so a new mode
    adds a case here and a function, not branches through ``_gpu_status``."""
    match state:
        case MigState():
            return _mig_status(daemon, gpu, state, now)
        case MpsState():
            return {"mps": _mps_pool_status(daemon, daemon.sched.mps_pool(gpu))}
        case ExclusiveState():
            lease = daemon.sched.leases.get(state.lease_id or "")
            return {
                "exclusive": {
                    "lease_id": state.lease_id,
                    "job_id": lease.request.job_id if lease else None,
                }
            }
        case OffState():
            return {}


def _mig_status(
    daemon: DaemonContext, gpu: ManagedGpu, state: MigState, now: float
) -> dict[str, Any]:
    """The state machine's view (state, reachability, what can be created) and each
    instance; without a state machine (an unknown model: the GPU is unhealthy) only
    ``mps_in_mig``."""
    out: dict[str, Any] = {"mps_in_mig": state.mps_in_mig}
    space = state.space
    if space is None:
        return out
    try:
        key = gpu.view().key
        out.update(
            state=describe(space, key),
            reachability=space.reachability(key),
            reachability_max=space.reachability(EMPTY),
            creatable=space.creatable(key),
        )
    except Exception as exc:  # a layout the state machine does not know
        out.update(state=f"unknown ({exc})", reachability=None, creatable={})
    out["units"] = space.geometry.units
    out["compute_slices"] = space.geometry.compute_slices
    out["full_profile_mib"] = max(p.memory_mib for p in space.profiles)
    out["instances"] = [
        _instance_status(daemon, inst, now)
        for inst in sorted(state.instances, key=lambda i: i.start)
    ]
    return out


def _instance_status(daemon: DaemonContext, inst: ManagedInstance, now: float) -> dict[str, Any]:
    lease = daemon.sched.leases.get(inst.lease_id or "")
    return {
        "profile": inst.profile.name,
        "profile_id": inst.profile.profile_id,
        "start": inst.start,
        "size": inst.profile.memory_slices,
        "memory_mib": inst.memory_mib,
        "memory_used_mib": inst.used_mib,
        "status": inst.status.value,
        "origin": inst.origin.value,
        "busy": inst.busy,
        "gi_id": inst.gi_id,
        "uuid": inst.uuid,
        "lease_id": inst.lease_id,
        "job_id": lease.request.job_id if lease else None,
        "idle_s": round(now - inst.idle_since_s, 1)
        if inst.idle_since_s is not None and not inst.busy
        else None,
        "note": inst.note,
        **({"mps": _mps_pool_status(daemon, inst.mps_pool)} if inst.mps_pool else {}),
    }


def _mps_pool_status(daemon: DaemonContext, pool: MpsPool) -> dict[str, Any]:
    """An MPS device's shares and its control daemon as last read off the event loop
    (``daemons[].age_s``: seconds since; the daemon is never asked from here)."""
    sched = daemon.sched
    shares = []
    for share in pool.shares:
        lease = sched.leases.get(share.share_id)
        shares.append(
            {
                "lease_id": share.share_id,
                "job_id": lease.request.job_id if lease else None,
                "pinned_mib": share.memory_mib,
                "clients": share.clients,
                "thread_percentage": share.thread_percentage,
                "uid": share.uid,
                "warning": lease.warning if lease else "",
            }
        )
    return {
        "device_uuid": pool.device_uuid,
        "shares": shares,
        "pinned_mib": pool.used_mib,
        "capacity_mib": pool.capacity_mib,
        "clients": pool.clients,
        "max_clients": pool.max_clients,
        "clients_cap_seen": pool.clients_cap_seen,
        "cgroup_limits": cgroup_limits_status(daemon, pool),
        "uid": pool.owner_uid,
        "draining_for_uid": pool.draining_for_uid,
        "multi_user": sched.policy.mps_multi_user,
        "daemons": daemon.mps.cached_status_for(pool.device_uuid) if daemon.mps is not None else [],
    }


def _latency(daemon: DaemonContext) -> dict[str, dict[str, float]]:
    """Service time per op over the last requests: p50/p99/max in ms, and the count."""
    out = {}
    for op, samples in daemon.latency_s.items():
        if not samples:
            continue
        ordered = sorted(samples)
        out[op] = {
            "n": len(ordered),
            "p50": round(ordered[len(ordered) // 2] * 1000, 3),
            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 3),
            "max": round(ordered[-1] * 1000, 3),
        }
    return out


def build_status(daemon: DaemonContext) -> StatusReply:
    now, mono = daemon.now()
    sched = daemon.sched
    counts = {s.value: 0 for s in (LeaseState.QUEUED, LeaseState.PREPARING, LeaseState.ACTIVE)}
    for lease in sched.active_leases():
        counts[lease.state.value] = counts.get(lease.state.value, 0) + 1
    # The head of the queue and a summary, not the whole queue: with 10k waiting requests
    # the full list made status take seconds and ~1.6 MB (one sort of the queue stays).
    order = sched.queue.order(mono)
    summary = {
        "length": len(order),
        "shown": 0,
        "memory_mib": sum(item.memory_mib for item in order),
        "oldest_waiting_s": round(max((i.age_s(mono) for i in order), default=0.0), 1),
    }
    queue = []
    for n, item in enumerate(order[:STATUS_QUEUE_SHOWN], start=1):
        queued = sched.leases.get(item.payload)
        if queued is None:
            continue
        lease = queued
        queue.append(
            {
                "lease_id": lease.lease_id,
                "job_id": lease.request.job_id,
                "memory_mib": lease.request.memory_mib,
                "mode": lease.request.mode,
                "position": n,
                "waiting_s": round(item.age_s(mono), 1),
                "deadline_s": lease.deadline_s,
            }
        )
    cfg = daemon.config
    return {
        "schema": STATUS_SCHEMA,
        "node": socket.gethostname(),
        "daemon": {
            "version": __version__,
            "pid": __import__("os").getpid(),
            "started_s": daemon.started_s,
            "uptime_s": round(now - daemon.started_s, 1),
            "backend": cfg.backend.kind,
            "socket": str(cfg.api.socket),
            "latency_ms": _latency(daemon),
            "policy": {
                "placement": cfg.policy.placement,
                "gpu_choice": cfg.policy.gpu_choice,
                "queue": cfg.policy.queue,
                "fission_fusion": cfg.policy.fission_fusion,
                "idle_policy": cfg.policy.idle_policy,
                "profiles": cfg.policy.profiles,
            },
        },
        "gpus": [
            _gpu_status(daemon, g, now) for g in sorted(sched.gpus.values(), key=lambda g: g.index)
        ],
        "queue": queue,
        "queue_summary": {**summary, "shown": len(queue)},
        "leases": counts,
        # A node-level condition: while the state disk refuses writes, migd refuses new
        # leases (state_disk errors) and serves everything else.
        "state_disk": {
            "ok": daemon.db.failing is None,
            "reason": daemon.db.failing or "",
            "since_s": daemon.db.failing_since,
        },
        # A node-level condition: the startd's configuration bypasses migd
        # (startd_check.py); migd serves on, HTCondor's jobs go around it.
        "startd": (daemon.startd_report or StartdReport()).to_dict(),
        "notes": list(daemon.notes[-50:]),
    }


def explain_job(
    daemon: DaemonContext, job_id: str, view: Callable[[Lease], Mapping[str, Any]]
) -> dict[str, Any]:
    """A job's leases (each as ``view`` shows it to the asking peer) and its history."""
    leases = {lease.lease_id: lease for lease in daemon.db.leases_for_job(job_id)}
    for lease in daemon.sched.leases.values():
        if lease.request.job_id == job_id:
            leases[lease.lease_id] = lease
    # Bounded like a history page: the reply stays small however large the rows are.
    history = daemon.db.history(
        limit=200, job_id=job_id, max_bytes=daemon.config.api.max_reply_bytes // 2
    )
    return {
        "job_id": job_id,
        "leases": [
            {**view(lease), "decision": lease.decision}
            for lease in sorted(leases.values(), key=lambda lease: lease.created_s)
        ],
        "history": [row.to_dict() for row in reversed(history)],
    }
