"""Matching a MIG GPU's books against a read of the GPU (NVML): the heart of
:meth:`migd.core.scheduler.NodeScheduler.resync`, apart from the scheduler's leases and
queue. The scheduler checks the read is not older than its books, reclaims the leases of
the instances that disappeared and commits the new instance list; this module only
decides what the list is, instance by instance, and says so in words.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from migd.core.geometry import Profile
from migd.core.gpus import InstanceStatus, ManagedInstance, MigState, Origin


@dataclass
class ReadMatch:
    """The books after a read: the instances (by start), those that disappeared (their
    leases are reclaimed by the caller), and what changed, in words."""

    instances: list[ManagedInstance]
    gone: list[ManagedInstance]
    notes: list[str]


def match_read(
    instances: Iterable[ManagedInstance],
    observed: Iterable[tuple[Profile, int, int | None, str | None, int]],
    busy_uuids: set[str],
    now_s: float,
    *,
    destroying: Callable[[int], bool],
) -> ReadMatch:
    """Match the books' ``instances`` against ``observed`` (``(profile, start, gi_id,
    mig_uuid, memory_mib)`` per instance on the GPU); ``busy_uuids``: the MIG devices
    with processes; ``destroying(start)``: whether pending work destroys the instance at
    ``start``.

    Instances the books know keep their lease; new ones are adopted (idle) unless
    processes run on them without a lease, which makes them UNEXPLAINED: reported, never
    destroyed. Instances being created or destroyed by pending work stay as they are.
    """
    notes: list[str] = []
    lost: list[ManagedInstance] = []
    # A start can be in the books twice while work is pending (an instance being
    # destroyed and the one planned in its place): each is matched by its profile.
    known: dict[tuple[int, int], ManagedInstance] = {
        (i.start, i.profile.profile_id): i for i in instances
    }
    fresh: list[ManagedInstance] = []
    for profile, start, gi_id, uuid, memory in observed:
        inst = known.pop((start, profile.profile_id), None)
        if inst is not None:
            inst.gi_id, inst.uuid, inst.memory_mib = gi_id, uuid, memory
            if inst.status is InstanceStatus.DESTROYING and destroying(start):
                pass  # its destroy is queued: it stays out of reach until then
            elif inst.status is not InstanceStatus.CREATING:
                inst.status = InstanceStatus.READY
            if inst.origin is Origin.UNEXPLAINED and uuid is not None and uuid not in busy_uuids:
                inst.origin, inst.note = Origin.ADOPTED, ""
                inst.idle_since_s = now_s
                notes.append(f"{inst} is idle now; adopted")
            elif (
                uuid in busy_uuids
                and inst.lease_id is None
                and inst.mps_pool is None  # an MPS host's server is a process of its own
                and inst.status is InstanceStatus.READY
                and inst.origin is not Origin.UNEXPLAINED
            ):
                # An idle instance with processes (a job's child that outlived its
                # lease): never handed out or destroyed until they exit.
                inst.origin = Origin.UNEXPLAINED
                inst.note = "processes run on it without a migd lease"
                notes.append(f"{inst}: unexplained ({inst.note})")
            fresh.append(inst)
            continue
        origin, note = Origin.ADOPTED, ""
        if uuid is None:
            origin, note = Origin.UNEXPLAINED, "GPU instance without a compute instance"
        elif uuid in busy_uuids:
            origin, note = Origin.UNEXPLAINED, "processes run on it without a migd lease"
        new = ManagedInstance(
            profile=profile,
            start=start,
            memory_mib=memory,
            gi_id=gi_id,
            uuid=uuid,
            origin=origin,
            idle_since_s=now_s,
            note=note,
        )
        fresh.append(new)
        notes.append(f"{new}: {origin.value}" + (f" ({note})" if note else ""))
    for gone in known.values():
        if gone.status is InstanceStatus.CREATING:
            fresh.append(gone)  # creation still in flight
            continue
        if gone.status is InstanceStatus.DESTROYING and destroying(gone.start):
            continue  # destroyed on the GPU; its work's result is on its way
        notes.append(f"{gone} disappeared")
        lost.append(gone)
    return ReadMatch(sorted(fresh, key=lambda i: i.start), lost, notes)


def layout_problem(mig: MigState) -> str | None:
    """Why a MIG GPU's committed layout is not a valid state of its state machine, in
    words; None when it is."""
    assert mig.space is not None
    try:
        mig.space.key_of((i.profile, i.start) for i in mig.instances)
    except Exception as exc:
        return f"layout not understood: {exc}"
    return None
