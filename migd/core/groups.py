"""Lease groups: one job, several GPUs, granted all or none (pure).

A job that asks for N GPUs (HTCondor's ``request_GPUs = N``, ``migd-run --gpus N``)
is one *group* of N leases, one per GPU. The scheduler places a group in one step:
it tries every member in turn on the books, and when one cannot be placed now it puts
the books back as they were (:class:`Trial`), so no member ever holds a partition
while the group waits for the rest (docs/api.md, "Several GPUs per job"). A group
waits in the queue as one request (its first member's entry); its other members are
``queued`` leases with no entry of their own.

What the members' environments become for the one job process is
:func:`merge_environments`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from migd.core.gpus import ManagedGpu, MigState, Work
from migd.core.leases import Lease
from migd.errors import InvalidRequest

#: Variables whose per-device values a multi-GPU job's process takes as one
#: comma-separated list, in device order (the CUDA and NVIDIA container syntax). MPS
#: variables are not: a pinned limit names a device by its index behind its own MPS
#: server, and a process has one pipe directory.
LIST_VARIABLES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _put_back(obj: Any, saved: Mapping[str, Any]) -> None:
    for name, value in saved.items():
        setattr(obj, name, value)


class Trial:
    """The books a group placement may change, taken before it, to put back in place.

    Placing a lease changes only its GPU's mode state (MIG instances and their MPS
    pools, an MPS pool, an exclusive owner), the lease itself, and the scheduler's
    pending work and change log: exactly what is saved here. Objects are restored in
    place (never swapped for copies), so nobody holding one sees a stale object.
    ``books_version`` bumps made by the trial are left: a bump only ever makes a GPU
    read count as stale and be read again.
    """

    def __init__(
        self,
        gpus: Iterable[ManagedGpu],
        leases: Iterable[Lease],
        pending: dict[int, Work],
        changed: dict[str, tuple[Lease, Any]],
    ) -> None:
        self._gpus: list[tuple[ManagedGpu, Any, dict[str, Any], list[Any]]] = []
        for gpu in gpus:
            state = gpu.state
            instances = []
            if isinstance(state, MigState):
                instances = [(inst, _fields(inst)) for inst in state.instances]
            self._gpus.append((gpu, state, _fields(state), instances))
        self._leases = [(lease, _fields(lease)) for lease in leases]
        self._pending = (pending, dict(pending))
        self._changed = (changed, dict(changed))

    def undo(self) -> None:
        """Put every saved object back as it was when the trial began."""
        for gpu, state, saved, instances in self._gpus:
            gpu.state = state
            _put_back(state, saved)
            if isinstance(state, MigState):
                state.instances = [inst for inst, _ in instances]
                for inst, fields in instances:
                    _put_back(inst, fields)
        for lease, fields in self._leases:
            _put_back(lease, fields)
        pending, saved_pending = self._pending
        pending.clear()
        pending.update(saved_pending)
        changed, saved_changed = self._changed
        changed.clear()
        changed.update(saved_changed)


def pinned(lease: Lease) -> bool:
    """Whether a group member's request names one GPU (the one HTCondor assigned it)."""
    return len(lease.request.gpu_uuids or ()) == 1


def place_group(
    members: Sequence[Lease],
    gpus: Iterable[ManagedGpu],
    pending: dict[int, Work],
    changed: dict[str, tuple[Lease, Any]],
    place: Callable[[Lease, frozenset[int]], Work | None],
) -> list[Work] | None:
    """Place every member now with ``place(lease, avoid)``, or none: the books of
    ``gpus`` (their candidates), the members, ``pending`` work and the ``changed`` log
    are put back as they were (:class:`Trial`)."""
    trial = Trial(gpus, members, pending, changed)
    taken: set[int] = set()
    works: list[Work] = []
    for lease in members:
        # A member pinned by its request may share a GPU with another (HTCondor
        # assigned both shares there); an unpinned one takes a GPU of its own.
        placed = place(lease, frozenset() if pinned(lease) else frozenset(taken))
        if placed is None:
            trial.undo()
            return None
        assert lease.gpu is not None
        taken.add(lease.gpu)
        works.append(placed)
    return works


class LeaseGroups:
    """Which leases form a group, while the scheduler keeps them.

    A waiting group is known by its first member (its leader, whose queue entry is the
    group's); every member maps to its leader until it is forgotten.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[str, ...]] = {}
        self._leader_of: dict[str, str] = {}

    def add(self, ids: Sequence[str]) -> None:
        """A new group, waiting; ``ids[0]`` leads it."""
        for lease_id in ids:
            self._leader_of[lease_id] = ids[0]
        self._waiting[ids[0]] = tuple(ids)

    def remove(self, ids: Sequence[str]) -> None:
        """Forget a group that was refused (none of its members is kept)."""
        self._waiting.pop(ids[0], None)
        for lease_id in ids:
            self._leader_of.pop(lease_id, None)

    def waiting(self, leader_id: str) -> tuple[str, ...] | None:
        """The members of the group ``leader_id`` leads while it waits to be placed."""
        return self._waiting.get(leader_id)

    def stop_waiting(self, leader_id: str) -> tuple[str, ...]:
        """The group left the queue (placed, expired, released): its members (none if
        ``leader_id`` leads no waiting group)."""
        return self._waiting.pop(leader_id, ())

    def leader_of(self, lease_id: str) -> str | None:
        """The leader of ``lease_id``'s group; None when it is in none."""
        return self._leader_of.get(lease_id)

    def members(self, lease_id: str) -> tuple[str, ...]:
        """The members of ``lease_id``'s group (itself alone when it has none)."""
        leader = self._leader_of.get(lease_id)
        if leader is None:
            return (lease_id,)
        return self._waiting.get(leader) or tuple(
            k for k, v in self._leader_of.items() if v == leader
        )

    def forget(self, lease_id: str) -> None:
        """Drop one ended member; the group goes with its last member."""
        leader = self._leader_of.pop(lease_id, None)
        if leader is not None and leader not in self._leader_of.values():
            self._waiting.pop(leader, None)


def merge_environments(leases: Sequence[Lease]) -> dict[str, str]:
    """The one environment a job holding ``leases`` (in GPU order) runs with.

    ``CUDA_VISIBLE_DEVICES`` (and ``NVIDIA_VISIBLE_DEVICES``) list
    every member's value, comma-separated, in order; any other variable must be the same
    in every member (one process has one ``CUDA_MPS_PIPE_DIRECTORY``).

    Raises:
        InvalidRequest: two members need different values of one variable (MPS shares
            behind two different MPS servers).
    """
    merged: dict[str, str] = {}
    lists: dict[str, list[str]] = {}
    for lease in leases:
        for key, value in lease.env.items():
            if key in LIST_VARIABLES:
                lists.setdefault(key, []).append(value)
            elif merged.setdefault(key, value) != value:
                raise InvalidRequest(
                    f"the job's GPUs need different {key} ({merged[key]!r} and {value!r}): "
                    "one process cannot use MPS shares of two MPS servers",
                    hint='ask for MIG partitions (MigdMode = "mig", migd-run --mode mig)',
                )
    for key, values in lists.items():
        merged[key] = ",".join(values)
    return merged


__all__ = [
    "LIST_VARIABLES",
    "LeaseGroups",
    "Trial",
    "merge_environments",
    "pinned",
    "place_group",
]
