"""The reconciler: what migd's books say against what the GPUs have.

At start-up it decides how each discovered GPU is managed (:meth:`Reconciler.manage`),
adopts the MIG instances it finds, reloads the leases of the state db and reclaims those
whose GPU, instance or holder is gone (:meth:`Reconciler.reconcile`). Later, a GPU is
re-read (:meth:`Reconciler.resync_gpu`) after failed work and while it has instances
migd cannot explain.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import structlog

from migd.core.geometry import Profile
from migd.core.gpus import GpuMode, InstanceStatus, ManagedGpu, OffState, Origin, mode_state
from migd.core.health import HealthSource
from migd.core.leases import Lease
from migd.core.states import StateSpace, state_space
from migd.daemon.context import DaemonContext
from migd.daemon.leases.executor import GpuExecutor
from migd.daemon.leases.service import LeaseService
from migd.daemon.supervision.mps import MpsSupervisor
from migd.errors import ConfigError, MigdError
from migd.ports import GpuInfo, MigInstance

log = structlog.get_logger("migd")


class Reconciler:
    """See the module docstring."""

    def __init__(
        self,
        ctx: DaemonContext,
        executor: GpuExecutor,
        leases: LeaseService,
        mps: MpsSupervisor,
        reap: Callable[[float, float], Awaitable[None]],
    ) -> None:
        self.ctx = ctx
        self.executor = executor
        self.leases = leases
        self.mps = mps
        self.reap = reap
        self._configured_space: dict[int, StateSpace] = {}  # GPU -> its policy.profiles space
        # GPUs whose last resync found only reads older than their books: read again.
        self._unsettled: set[int] = set()

    # -- how each GPU is managed ------------------------------------------------------------

    def manage(self, info: GpuInfo) -> ManagedGpu:
        """How a discovered GPU is managed; what keeps it from work is its ``startup``
        health condition."""
        config, backend, now = self.ctx.config, self.ctx.backend, self.ctx.clock.now()
        if not info.mig_mode_known:
            # Unknown is not "no MIG": a MIG GPU managed whole would be handed out wrongly.
            unknown = ManagedGpu(
                index=info.index,
                uuid=info.uuid,
                model=info.model or info.name,
                name=info.name,
                memory_total_mib=info.memory_total_mib,
                state=OffState(),
            )
            unknown.health.raise_(
                HealthSource.STARTUP,
                f"{info.mig_mode_error}; no work on this GPU: restart migd once "
                f"`nvidia-smi -q -i {info.index}` shows its MIG mode",
                now,
            )
            return unknown
        if info.persistence_mode is False:
            log.warning(
                "gpu.persistence_off",
                gpu=info.index,
                hint="an idle GPU can be de-initialised and lose its MIG instances; "
                "enable nvidia-persistenced (docs/operations.md)",
            )
        override = config.override_for(info.index, info.uuid)
        wanted = override.mode if override else "auto"
        # hybrid: a MIG GPU whose MPS hosts the hybrid policy decides (migd.core.hybrid)
        mps_in_mig = bool(override and (override.mps_in_mig or override.mode == "hybrid"))
        health = ""
        space = None
        mode: GpuMode
        if wanted == "off":
            mode = GpuMode.OFF
        elif wanted == "mps" and info.mig_current and not mps_in_mig:
            # MPS on the parent of a MIG GPU serves no MIG device: refuse it loudly.
            mode = GpuMode.MPS
            health = (
                "mode=mps but MIG is enabled on this GPU: set mps_in_mig = true for MPS "
                "inside MIG instances, or disable MIG (`nvidia-smi -i N -mig 0`, then reset)"
            )
        elif wanted == "mps" and not info.mig_current:
            mode = GpuMode.MPS
        elif wanted == "exclusive":
            mode = GpuMode.EXCLUSIVE
        elif info.mig_current:
            mode = GpuMode.MIG
        elif wanted in ("mig", "hybrid"):
            mode = GpuMode.MIG
            health = (
                "MIG mode is pending a GPU reset or reboot"
                if info.mig_pending
                else "MIG is disabled: `nvidia-smi -i N -mig 1`, then reset the GPU"
            )
        else:
            mode = GpuMode.MPS  # auto: MPS on GPUs without MIG enabled
        if info.mig_current and info.mig_pending is False:
            health = "MIG disable pending a reset: not placing new work"
        if mode is GpuMode.MIG and info.mig_current:
            try:
                geometry = backend.geometry(info.index)
                profiles = (override.profiles if override and override.profiles else None) or (
                    config.policy.profiles
                )
                space = state_space(geometry, profiles)
            except MigdError as exc:
                health = f"no MIG geometry: {exc.message}"
        elif mode is GpuMode.MIG:
            with contextlib.suppress(MigdError):
                space = state_space(backend.geometry(info.index), config.policy.profiles)
        name = info.model or info.name
        gpu = ManagedGpu(
            index=info.index,
            uuid=info.uuid,
            model=name,
            name=info.name,
            memory_total_mib=info.memory_total_mib,
            state=mode_state(mode, space),
        )
        if health:
            gpu.health.raise_(HealthSource.STARTUP, health, now)
        self.mps.configure(gpu, info, mps_in_mig, override.mps_profile if override else None)
        return gpu

    def apply_demand_prior(self) -> None:
        sched = self.ctx.sched
        # Per model: a name (or ID) means a different profile on each model it exists on.
        prior: dict[tuple[str, int], float] = {}
        spaces = [g.space for g in sched.gpus.values() if g.space is not None]
        for name, weight in self.ctx.config.policy.demand_prior.items():
            known = False
            for space in spaces:
                try:
                    prior[(space.geometry.model, space.member(name).profile_id)] = weight
                    known = True
                except MigdError:
                    continue
            if not known:
                raise ConfigError(f"no GPU has profile {name!r}", where="policy.demand_prior")
        sched.demand.prior = prior
        saved = self.ctx.db.get_meta("demand")
        if saved:
            sched.demand.load(saved.get("counts", {}), saved.get("last_s"))

    # -- start-up ---------------------------------------------------------------------------

    async def reconcile(self) -> None:
        """Adopt what the GPUs have, reload leases, reclaim those whose holder is gone."""
        ctx = self.ctx
        now, mono = ctx.now()
        found: list[tuple[int, str]] = []
        for gpu in ctx.sched.gpus.values():
            if gpu.mode is GpuMode.MIG and gpu.space is not None:
                found += [(gpu.index, note) for note in await self.resync_gpu(gpu.index)]
        for lease in ctx.db.live_leases():
            self._restore_lease(lease, now)
        await self.reap(now, mono)
        # The GPUs are read before the leases are back, so an instance whose job kept
        # running through the restart looks unexplained until its lease is restored; the
        # notes say what is true once leases are restored and reaped (after a kill -9 with
        # 100 jobs, 51 instances were listed unexplained though each had its lease back).
        for index, note in found:
            if self._still_true(index, note):
                ctx.notes.append(f"GPU {index}: {note}")
                log.info("reconcile.instance", gpu=index, note=note)
        self.leases.apply(ctx.sched.schedule(now, mono))

    def _restore_lease(self, lease: Lease, now: float) -> None:
        outcome = self.ctx.sched.restore(lease, now)
        if not outcome.transitions:
            self.leases.restored(lease)
            log.info(
                "lease.restored",
                lease_id=lease.lease_id,
                job_id=lease.request.job_id,
                gpu=lease.gpu,
                mode=lease.mode,
                holder_pid=lease.owner_pid,
            )
        for ended in outcome.ended:  # cancelled (it was waiting) or reclaimed (gone)
            self.leases.record(ended.state.value, ended, reason=ended.reason)
        self.leases.apply(outcome)

    def _still_true(self, index: int, note: str) -> bool:
        """False for a note that calls an instance unexplained which no longer is."""
        if ": unexplained" not in note:
            return True
        gpu = self.ctx.sched.gpus.get(index)
        if gpu is None:
            return False
        return any(
            note.startswith(f"{inst}: ")
            and inst.origin is Origin.UNEXPLAINED
            and inst.lease_id is None
            for inst in gpu.instances
        )

    def forget_explained(self, index: int) -> None:
        """Drop status notes about instances of GPU ``index`` that are explained now
        (adopted once their processes ended, leased, or gone)."""
        prefix = f"GPU {index}: "
        self.ctx.notes[:] = [
            note
            for note in self.ctx.notes
            if not note.startswith(prefix) or self._still_true(index, note.removeprefix(prefix))
        ]

    # -- re-reading a GPU -------------------------------------------------------------------

    def needs_resync(self, gpu: ManagedGpu) -> bool:
        """Instances that had processes without a lease are adopted once they empty;
        a GPU an earlier resync found wanting is judged again."""
        return (
            HealthSource.RESYNC in gpu.health.conditions
            or gpu.index in self._unsettled
            or any(i.origin is Origin.UNEXPLAINED for i in gpu.instances)
        )

    async def resync_gpu(self, index: int) -> list[str]:
        """Adopt what the GPU has; leave alone what migd cannot explain.

        An instance with processes on any of its compute instances (and no lease), one
        made by hand with several compute instances, or one of a profile outside
        ``policy.profiles`` is UNEXPLAINED: listed by ``migctl status``, never destroyed.
        For the last, the GPU's state machine is widened by that profile so its slices
        stay on the books, and the GPU takes no new work while it is there (so migd
        never places a profile the policy leaves out); its health says why.
        """
        ctx = self.ctx
        sched = ctx.sched
        gpu = sched.gpus[index]
        assert gpu.space is not None
        configured = self._configured_space.setdefault(index, gpu.space)
        # The GPU is read in its thread while the event loop goes on: work finishes and is
        # granted, leases end, teardowns are planned. The read is applied only if the
        # books did not change since it began (NodeScheduler.books_version); otherwise it
        # is read again, and after READ_TRIES the reaper's next round tries again.
        for _ in range(self.READ_TRIES):
            read_at = sched.books_version(index)
            try:
                # One call in the GPU's thread: work queued there cannot run between the
                # list and the process reads (a destroy did, and the process read failed).
                instances, in_use = await self.executor.on_gpu(index, self._read_gpu, index)
            except (MigdError, TimeoutError) as exc:
                reason = f"cannot read instances: {exc}"
                gpu.health.raise_(HealthSource.RESYNC, reason, ctx.clock.now())
                return [reason]
            if sched.books_version(index) == read_at:
                break
        else:
            self._unsettled.add(index)
            log.info("resync.deferred", gpu=index, reason="the GPU's books kept changing")
            return []
        self._unsettled.discard(index)
        return self._apply_read(index, configured, instances, in_use, read_at)

    #: Reads of one resync before it leaves the GPU to the reaper's next round.
    READ_TRIES = 5

    def _apply_read(
        self,
        index: int,
        configured: StateSpace,
        instances: list[MigInstance],
        in_use: set[int],
        read_at: int,
    ) -> list[str]:
        """Judge one read of GPU ``index`` taken at books version ``read_at`` (no awaits:
        the books and the health change in one step)."""
        ctx = self.ctx
        sched = ctx.sched
        gpu = sched.gpus[index]
        # An earlier resync's verdict is judged afresh below (no other source's is touched).
        gpu.health.clear(HealthSource.RESYNC)
        observed: list[tuple[Profile, int, int | None, str | None, int]] = []
        notes: list[str] = []
        untouchable: dict[int, str] = {}  # start -> why migd must leave it alone
        foreign: list[Profile] = []
        unknown: list[str] = []  # profiles the geometry itself lacks: cannot be booked
        busy: set[str] = set()
        for inst in instances:
            if len(inst.compute_instances) > 1:
                untouchable[inst.start] = (
                    f"{len(inst.compute_instances)} compute instances (made by hand); "
                    "migd never destroys it"
                )
            try:
                profile = configured.member(inst.profile_id)
            except MigdError:
                try:
                    profile = configured.geometry.by_id(inst.profile_id)
                except MigdError:
                    unknown.append(f"GPU instance {inst.gi_id} (profile id {inst.profile_id})")
                    continue
                untouchable[inst.start] = (
                    f"profile {profile.name} is not in policy.profiles; migd never touches it"
                )
                foreign.append(profile)
            if inst.uuid is not None and (inst.gi_id in in_use or inst.start in untouchable):
                busy.add(inst.uuid)
            observed.append((profile, inst.start, inst.gi_id, inst.uuid, inst.memory_total_mib))
        # The state machine must describe what is there; a GPU with a profile outside the
        # policy is unavailable meanwhile, so nothing of that profile is ever placed.
        mig = gpu.mig
        assert mig is not None
        mig.space = (
            state_space(configured.geometry, [p.name for p in (*configured.profiles, *foreign)])
            if foreign
            else configured
        )
        now, _ = ctx.now()
        own = ctx.db.own_instances(gpu.uuid)
        resynced = sched.resync(index, observed, busy, now, read_at=read_at)
        assert not resynced.stale, "read and applied with no await between the check and here"
        notes += resynced.notes
        self.leases.apply(resynced)
        for managed in gpu.instances:
            why = untouchable.get(managed.start)
            if why and managed.lease_id is None and managed.status is InstanceStatus.READY:
                if managed.origin is not Origin.UNEXPLAINED or managed.note != why:
                    notes.append(f"{managed}: unexplained ({why})")
                managed.origin, managed.note = Origin.UNEXPLAINED, why
        if foreign:
            gpu.health.raise_(
                HealthSource.RESYNC,
                "instances of profiles outside policy.profiles ("
                + ", ".join(sorted({p.name for p in foreign}))
                + "): no new work on this GPU until they are gone or policy.profiles lists them",
                now,
            )
        if unknown:
            gpu.health.raise_(
                HealthSource.RESYNC,
                f"{', '.join(unknown)} of a profile migd's geometry does not have: no new work "
                "on this GPU until it is gone",
                now,
            )
        present = {m.start for m in gpu.instances}
        for managed in gpu.instances:
            if managed.start in own and managed.origin is Origin.ADOPTED:
                managed.origin = Origin.MIGD
        for start in set(own) - present:
            ctx.db.forget_instance(gpu.uuid, start)  # work that never reached the GPU
        teardown = sched.discard_incomplete(index, own)
        for work in teardown.work:
            notes.append(f"destroying {', '.join(str(op) for op in work.ops)} (incomplete)")
        self.leases.apply(teardown)
        return notes

    def _read_gpu(self, index: int) -> tuple[list[MigInstance], set[int]]:
        """The GPU's instances and those in use, read together (GPU thread)."""
        instances = self.ctx.backend.list_instances(index)
        return instances, self._instances_in_use(index, instances)

    def _instances_in_use(self, index: int, instances: list[MigInstance]) -> set[int]:
        """GPU instance ids with processes on any of their compute instances (GPU thread)."""
        in_use: set[int] = set()
        for inst in instances:
            uuids = [ci.uuid for ci in inst.compute_instances]
            if any(self.ctx.backend.processes(index, uuid) for uuid in uuids):
                in_use.add(inst.gi_id)
        return in_use
