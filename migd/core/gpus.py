"""A GPU as the scheduler books it: what every GPU has, and the state of its mode.

Every GPU runs in one :class:`GpuMode`, and holds exactly that mode's state as a
value (:class:`MigState`, :class:`MpsState`, :class:`ExclusiveState`,
:class:`OffState`), so a MIG-only field cannot be set or read on an MPS GPU by
mistake. What the scheduler *does* per mode lives in :mod:`migd.core.gpu_modes`.

:data:`RequestMode` is a different thing: what a job asks for (``mig``, ``mps`` or
``auto``), which several GPU modes may serve (an ``mps`` request runs on an MPS GPU
or inside a MIG instance that hosts MPS).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Literal

from migd.core.geometry import Profile
from migd.core.health import GpuHealth
from migd.core.mps import MpsPool, observe_client_cap
from migd.core.planner import Decision, DestroyOp, GpuView, Instance, Op
from migd.core.states import StateSpace


class GpuMode(StrEnum):
    """What a GPU runs (configured per GPU); each has its own state and mode driver."""

    MIG = "mig"  # migd creates and destroys MIG instances
    MPS = "mps"  # the whole GPU is shared through one MPS daemon
    EXCLUSIVE = "exclusive"  # the whole GPU goes to one job (no MIG, no MPS)
    OFF = "off"  # not managed by migd


#: What a job asks for, as opposed to what a GPU runs (:class:`GpuMode`): ``mig`` a MIG
#: instance of its own, ``mps`` an MPS share (on an MPS GPU or inside a MIG instance),
#: ``auto`` whatever fits.
RequestMode = Literal["mig", "mps", "auto"]


class InstanceStatus(StrEnum):
    READY = "ready"
    CREATING = "creating"
    DESTROYING = "destroying"


class Origin(StrEnum):
    MIGD = "migd"  # created by migd (this run or before a restart)
    ADOPTED = "adopted"  # found at start-up, explainable, now managed
    UNEXPLAINED = "unexplained"  # processes without a lease, or not a state of the model


@dataclass
class ManagedInstance:
    """A MIG instance migd tracks on one GPU."""

    profile: Profile
    start: int
    memory_mib: int
    gi_id: int | None = None
    uuid: str | None = None
    status: InstanceStatus = InstanceStatus.READY
    origin: Origin = Origin.MIGD
    lease_id: str | None = None
    idle_since_s: float | None = None  # wall clock: shown
    # (the idle_since_s it was taken for, the monotonic time it went idle): what the idle
    # timeout is measured from, so a wall-clock step moves no teardown (NodeScheduler).
    idle_mono: tuple[float, float] | None = field(default=None, compare=False)
    used_mib: int | None = None
    note: str = ""
    # MPS inside MIG: the instance hosts an MPS daemon whose shares are these (no
    # lease_id then: many leases share it).
    mps_pool: MpsPool | None = None

    @property
    def busy(self) -> bool:
        """Planner view: anything but an idle, ready, explained instance is untouchable."""
        return (
            self.lease_id is not None
            or self.status is not InstanceStatus.READY
            or self.origin is Origin.UNEXPLAINED
            or (self.mps_pool is not None and bool(self.mps_pool.shares))
        )

    @property
    def lease_ids(self) -> list[str]:
        """The leases the instance serves: its own, or the shares of an MPS host."""
        ids = [self.lease_id] if self.lease_id else []
        if self.mps_pool is not None:
            ids += [s.share_id for s in self.mps_pool.shares]
        return ids

    def __str__(self) -> str:
        return f"{self.profile.name}@{self.start}"


@dataclass
class MigState:
    """A MIG GPU's books: its state machine, its instances and MPS inside MIG."""

    mode: ClassVar[GpuMode] = GpuMode.MIG
    #: None when migd could not build the model's state machine (the GPU is unhealthy).
    space: StateSpace | None = None
    instances: list[ManagedInstance] = field(default_factory=list)
    # Small and mode=mps requests get an MPS share inside an instance of mps_profile
    # (default: the smallest profile) that migd creates for MPS.
    mps_in_mig: bool = False
    mps_profile: str | None = None

    def take(self, decision: Decision, owner: str | None) -> ManagedInstance:
        """Carry ``decision`` out in the books: the idle instances it destroys are being
        destroyed, and the instance it grants is reused or being created for ``owner``
        (None: an MPS host, which belongs to no lease)."""
        for op in decision.ops:
            if isinstance(op, DestroyOp):
                victim = _find(self.instances, op.start, InstanceStatus.READY)
                assert victim is not None and not victim.busy, "planner chose a busy instance"
                victim.status = InstanceStatus.DESTROYING
        if decision.action == "reuse":
            inst = _find(self.instances, decision.start, InstanceStatus.READY)
            assert inst is not None
            return inst
        inst = ManagedInstance(
            profile=decision.profile,
            start=decision.start,
            memory_mib=decision.profile.memory_mib,
            status=InstanceStatus.CREATING,
            lease_id=owner,
        )
        self.instances.append(inst)
        return inst


@dataclass
class MpsState:
    """An MPS GPU's books: one pool for the whole GPU."""

    mode: ClassVar[GpuMode] = GpuMode.MPS
    #: Created on first use from the scheduler's policy (reserve, client cap, users).
    pool: MpsPool | None = None


@dataclass
class ExclusiveState:
    """An EXCLUSIVE GPU's books: the one lease that holds it."""

    mode: ClassVar[GpuMode] = GpuMode.EXCLUSIVE
    lease_id: str | None = None


@dataclass
class OffState:
    """A GPU migd does not manage: nothing to book."""

    mode: ClassVar[GpuMode] = GpuMode.OFF


ModeState = MigState | MpsState | ExclusiveState | OffState


def mode_state(
    mode: GpuMode, space: StateSpace | None = None, *, mps_in_mig: bool = False
) -> ModeState:
    """The empty books of a GPU in ``mode`` (``space`` and ``mps_in_mig``: MIG only)."""
    if mode is GpuMode.MIG:
        return MigState(space=space, mps_in_mig=mps_in_mig)
    if space is not None or mps_in_mig:
        raise ValueError(f"a state space and MPS inside MIG are for MIG GPUs, not {mode}")
    if mode is GpuMode.MPS:
        return MpsState()
    if mode is GpuMode.EXCLUSIVE:
        return ExclusiveState()
    return OffState()


@dataclass
class ManagedGpu:
    """One GPU as the scheduler sees it: what every GPU has, and its mode's state.

    The read-only accessors below (``space``, ``instances``, ``mps_in_mig``,
    ``mps_pool``, ``exclusive_lease``) are for status, metrics and the daemon; each
    reads one mode's state and gives an empty value (``None``, ``()``, ``False``) on a
    GPU in another mode. Code that changes a mode's books takes its state
    (``gpu.mig``, ``gpu.mps``, ``gpu.exclusive``), which is ``None`` in other modes.
    """

    index: int
    uuid: str
    model: str
    name: str
    memory_total_mib: int
    state: ModeState
    draining: bool = False
    #: Conditions that keep new work off the GPU, each owned by its source (core.health).
    health: GpuHealth = field(default_factory=GpuHealth)
    used_mib: int | None = None
    # Compute slices of the whole GPU (MIG geometry, also known for MPS-mode GPUs of MIG
    # models); None when the model has none. min_compute is read against it.
    compute_slices: int | None = None
    # The last view() and what it was made from: a node plans every GPU for every
    # request, and most GPUs have not changed since the last one (see view).
    _view: tuple[tuple[object, ...], GpuView] | None = field(
        default=None, init=False, compare=False, repr=False
    )

    @property
    def mode(self) -> GpuMode:
        return self.state.mode

    @property
    def mig(self) -> MigState | None:
        return self.state if isinstance(self.state, MigState) else None

    @property
    def mps(self) -> MpsState | None:
        return self.state if isinstance(self.state, MpsState) else None

    @property
    def exclusive(self) -> ExclusiveState | None:
        return self.state if isinstance(self.state, ExclusiveState) else None

    @property
    def space(self) -> StateSpace | None:
        """MIG: the state machine (None if it could not be built); None in other modes."""
        return self.state.space if isinstance(self.state, MigState) else None

    @property
    def instances(self) -> Sequence[ManagedInstance]:
        """MIG: the instances migd tracks; empty in other modes."""
        return self.state.instances if isinstance(self.state, MigState) else ()

    @property
    def mps_in_mig(self) -> bool:
        """Whether the GPU hosts MPS inside MIG instances (False unless MIG)."""
        return isinstance(self.state, MigState) and self.state.mps_in_mig

    @property
    def mps_pool(self) -> MpsPool | None:
        """MPS mode: the whole GPU's pool (None before first use); None in other modes."""
        return self.state.pool if isinstance(self.state, MpsState) else None

    @property
    def exclusive_lease(self) -> str | None:
        """EXCLUSIVE mode: the lease that holds the GPU; None when free or in other modes."""
        return self.state.lease_id if isinstance(self.state, ExclusiveState) else None

    @property
    def available(self) -> bool:
        return not self.draining and self.health.available

    def instance_at(
        self, start: int, status: InstanceStatus | None = None
    ) -> ManagedInstance | None:
        """The instance at ``start`` (with ``status``, if given).

        During a repartition an instance being destroyed and its replacement being
        created can share a start, so callers that act on one of them name its status.
        """
        return _find(self.instances, start, status)

    def instance_of(self, lease_id: str) -> ManagedInstance | None:
        for inst in self.instances:
            if inst.lease_id == lease_id:
                return inst
        return None

    def view(self) -> GpuView:
        """The planner's view of a MIG GPU with a state machine."""
        space = self.space
        assert space is not None, f"GPU {self.index} has no MIG state machine"
        reason = (
            "draining" if self.draining else ("" if self.health.available else str(self.health))
        )
        # Instances being destroyed are already gone from the intended layout: work on a
        # GPU runs in order, so a later plan may reuse their slices.
        # An MPS host (even with no share now) is kept for MPS: plain MIG requests
        # neither reuse nor repartition it; idle teardown still removes it.
        destroying = InstanceStatus.DESTROYING
        seen = tuple(
            (i.profile, i.start, i.busy or i.mps_pool is not None, i.gi_id)
            for i in self.instances
            if i.status is not destroying
        )
        # The view is immutable: the same inputs give back the same one, with the state
        # key and atoms it has worked out already (cheaper than building it again).
        # (the space by id: the cached view holds it, so the id is its own meanwhile)
        made_of = (self.index, id(space), self.available, reason, seen)
        last = self._view
        if last is not None and last[0] == made_of:
            return last[1]
        view = GpuView(
            index=self.index,
            space=space,
            instances=tuple(Instance(p, s, b, f"gi:{g}") for p, s, b, g in seen),
            available=self.available,
            unavailable_reason=reason,
        )
        self._view = (made_of, view)
        return view


def _find(
    instances: Sequence[ManagedInstance], start: int, status: InstanceStatus | None
) -> ManagedInstance | None:
    for inst in instances:
        if inst.start == start and (status is None or inst.status is status):
            return inst
    return None


@dataclass(frozen=True)
class Work:
    """NVML work the caller must execute, in order, on one GPU."""

    gpu: int
    ops: tuple[Op, ...]
    lease_id: str | None = None  # lease that becomes ACTIVE when the work is done
    kind: Literal["grant", "teardown"] = "grant"
    work_id: int = 0


def observe_mps_client_cap(
    gpus: Iterable[ManagedGpu], device_uuid: str, clients_at_refusal: int
) -> bool:
    """Lower the client capacity of MPS device ``device_uuid`` (an MPS-mode GPU or an MPS
    host instance) to the cap it showed at a refusal
    (:func:`migd.core.mps.observe_client_cap`); whether the books changed."""
    for gpu in gpus:
        state = gpu.state
        pool = state.pool if isinstance(state, MpsState) else None
        if pool is not None and pool.device_uuid == device_uuid:
            assert isinstance(state, MpsState)
            state.pool = observe_client_cap(pool, clients_at_refusal)
            return state.pool is not pool
        for inst in gpu.instances:
            if inst.mps_pool is not None and inst.mps_pool.device_uuid == device_uuid:
                new = observe_client_cap(inst.mps_pool, clients_at_refusal)
                changed, inst.mps_pool = new is not inst.mps_pool, new
                return changed
    return False
