"""The migd daemon: lifecycle, reconciliation, the API server and background loops.

Start-up order (systemd ``Type=notify``): load config, open the state db,
discover GPUs, reconcile (adopt instances, reload leases, reclaim dead ones),
bind the socket, then ``READY=1``. Decisions come from
:class:`migd.core.scheduler.NodeScheduler`; this module adds the I/O: NVML
work runs in one worker thread per GPU (so a slow creation on GPU 0 never
blocks GPU 1 or a status query), leases and history go to SQLite, and the
watchdog is fed only while every GPU's worker answers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import grp
import os
import re
import secrets
import signal
import socket
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import structlog

from migd import __version__
from migd.api import (
    ExplainRequest,
    GpuRequest,
    HistoryRequest,
    LeaseRef,
    LeaseRequestMsg,
    PingRequest,
    ReleaseJobRequest,
    ReportRequest,
    Request,
    SimRequest,
    StatusRequest,
    decode_request,
    error_reply,
    ok_reply,
)
from migd.core.geometry import Profile
from migd.core.leases import LeaseState
from migd.core.planner import CreateOp, DestroyOp, GpuChoice, PlacementRule, PlannerPolicy
from migd.core.queueing import QueuePolicy
from migd.core.scheduler import (
    GpuMode,
    InstanceStatus,
    Lease,
    LeaseRequest,
    ManagedGpu,
    NodeScheduler,
    Origin,
    SchedulerPolicy,
    Work,
    default_mps_env,
)
from migd.core.states import StateSpace, state_space
from migd.daemon.auth import Authorizer, Peer
from migd.daemon.config import ApiSection, MigdConfig, changed_restart_keys
from migd.daemon.status import build_status, explain_job
from migd.daemon.store import StateStore
from migd.daemon.systemd import Notifier
from migd.errors import (
    ConfigError,
    DaemonUnavailable,
    GpuBusy,
    GpuError,
    InvalidRequest,
    LeaseNotFound,
    LeaseTimeout,
    MigdError,
    NoCapacity,
    NotAuthorized,
    ProtocolError,
)
from migd.ports import (
    Clock,
    GpuBackend,
    GpuInfo,
    GpuProcess,
    MigInstance,
    ProcessTable,
    SystemClock,
)

T = TypeVar("T")
_CLUSTER_PROC = re.compile(r"\d+\.\d+")
log = structlog.get_logger("migd")
#: GPU health while an MPS daemon on it cannot be brought back (cleared once it serves).
MPS_UNHEALTHY = "MPS daemon cannot be restarted"


@dataclass
class Waiter:
    future: asyncio.Future[Lease]
    lease_id: str


@dataclass
class GpuWorker:
    """One thread per GPU: NVML calls for a GPU never run concurrently."""

    index: int
    executor: ThreadPoolExecutor
    queue: asyncio.Queue[Work] = field(default_factory=asyncio.Queue)
    last_ok_mono: float = 0.0
    heartbeat_pending: bool = False
    busy_since_mono: float | None = None


def scheduler_policy(config: MigdConfig) -> SchedulerPolicy:
    p = config.policy
    return SchedulerPolicy(
        planner=PlannerPolicy(
            placement=PlacementRule(p.placement),
            gpu_choice=GpuChoice(p.gpu_choice),
            fission_fusion=p.fission_fusion,
        ),
        queue=QueuePolicy(p.queue),
        aging_s=p.aging_s,
        starvation_s=p.starvation_s,
        backfill=p.backfill,
        idle_policy=p.idle_policy,
        idle_timeout_s=p.idle_timeout_s,
        demand_weighting=p.demand_weighting or p.placement == "weighted",
        demand_prior={},
        demand_half_life_s=p.demand_half_life_s,
        mps_reserve_mib=config.mps.reserve_mib,
        mps_max_clients=config.mps.max_clients,
        mps_multi_user=config.mps.multi_user,
    )


class Daemon:
    """One migd process. Construct with real or simulated ports, then ``await run()``."""

    def __init__(
        self,
        config: MigdConfig,
        backend: GpuBackend,
        procs: ProcessTable,
        *,
        clock: Clock | None = None,
        notifier: Notifier | None = None,
        reload_config: Callable[[], MigdConfig] | None = None,
        sim_node: Any = None,
        mps: Any = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.procs = procs
        self.clock = clock or SystemClock()
        self.notifier = notifier or Notifier()
        self.reload_config = reload_config
        self.sim_node = sim_node
        self.mps = mps
        self.auth = Authorizer(config.api)
        self.store: StateStore | None = None
        self.scheduler: NodeScheduler | None = None
        self.gpus: list[GpuInfo] = []
        self.workers: dict[int, GpuWorker] = {}
        self.waiters: dict[str, Waiter] = {}
        self.started_s = self.clock.now()
        self.stopping = asyncio.Event()
        self.notes: list[str] = []  # reconciliation findings for `migctl status`
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._clients = 0  # open connections, in all
        self._per_uid: dict[int, int] = {}  # open connections per peer uid
        self._readers = 0  # open connections of peers that may not lease
        self._watchdog_tripped = ""
        self._saved: dict[str, int] = {}  # lease id -> version last written
        self._mps_task: asyncio.Task[None] | None = None  # a running MPS housekeeping round
        self._mps_adopted_at_start: tuple[str, ...] = ()  # MPS devices found alive
        self._mps_lost_at_start: tuple[str, ...] = ()  # ... and found dead, at start-up
        self._logged: dict[str, LeaseState] = {}  # lease id -> state last logged
        self._work_seconds: dict[str, float] = {}  # lease id -> NVML time of its partition
        self._resync_health: dict[int, str] = {}  # GPU -> the health a resync set on it
        self._configured_space: dict[int, StateSpace] = {}  # GPU -> its policy.profiles space
        # Highest GPU memory seen for each active lease (its instance, its whole GPU, or
        # its MPS holder's processes), so the wrapper's OOM verdict has a peak even for
        # jobs shorter than its own sampling; see _sample_gpu.
        self.lease_peaks: dict[str, int] = {}
        # Service time per op (decoded request to reply written), last 2048 each, for
        # `migctl status` and the benchmark; see _latency_class.
        self.latency_s: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=2048)
        )

    # -- helpers ----------------------------------------------------------------------------

    @property
    def sched(self) -> NodeScheduler:
        assert self.scheduler is not None
        return self.scheduler

    @property
    def db(self) -> StateStore:
        assert self.store is not None
        return self.store

    def now(self) -> tuple[float, float]:
        return self.clock.now(), self.clock.monotonic()

    async def on_gpu(
        self, gpu: int, fn: Callable[..., T], *args: Any, timeout_s: float | None = None
    ) -> T:
        """Run a blocking backend call ``fn(*args)`` in the GPU's own thread."""
        worker = self.workers[gpu]
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(worker.executor, fn, *args)
        return await asyncio.wait_for(fut, timeout_s or self.config.daemon.work_timeout_s)

    def save(self, lease: Lease) -> None:
        self.db.save_lease(lease)
        self._saved[lease.lease_id] = lease.version
        if self._logged.get(lease.lease_id) is not lease.state:
            self._logged[lease.lease_id] = lease.state
            self._log_transition(lease)

    def _log_transition(self, lease: Lease) -> None:
        """Every lease decision in the log, with its explanation (each state change is
        persisted through :meth:`save`, so this sees them all)."""
        state = lease.state
        ids = {"lease_id": lease.lease_id, "job_id": lease.request.job_id}
        decision = lease.decision or {}
        if state is LeaseState.QUEUED:
            log.info(
                "lease.queued",
                **ids,
                memory_mib=lease.request.memory_mib,
                mode=lease.request.mode,
                position=self.sched.queue.position(lease.lease_id, self.clock.monotonic()),
                waiting=len(self.sched.queue),
                reason=f"no partition for {lease.request.memory_mib} MiB can be had now, "
                "or requests ahead of it go first",
            )
        elif state is LeaseState.PREPARING:
            log.info(
                "lease.preparing",
                **ids,
                gpu=lease.gpu,
                action=decision.get("action"),
                reason=decision.get("reason"),
            )
        elif state is LeaseState.ACTIVE:
            seconds = self._work_seconds.pop(lease.lease_id, None)
            self.record(
                "granted",
                lease,
                gpu=lease.gpu,
                mode=lease.mode,
                profile=lease.profile,
                start=lease.start,
                mig_uuid=lease.mig_uuid,
                seconds=seconds,
                decision=lease.decision,
            )
            log.info(
                "lease.granted",
                **ids,
                gpu=lease.gpu,
                mode=lease.mode,
                profile=lease.profile,
                start=lease.start,
                memory_limit_mib=lease.memory_limit_mib,
                reason=decision.get("reason"),
            )
        elif state.terminal:
            level = log.warning if state in (LeaseState.RECLAIMED, LeaseState.FAILED) else log.info
            level(f"lease.{state.value}", **ids, reason=lease.reason)

    def record(self, event: str, lease: Lease | None = None, /, **data: Any) -> None:
        # Positional-only: a client's report may use any key, "event" and "lease" too.
        self.db.record(
            event,
            data,
            lease_id=lease.lease_id if lease else None,
            job_id=lease.request.job_id if lease else data.get("job_id"),
            t=self.clock.now(),
        )

    # -- start-up ---------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        cfg.daemon.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = StateStore(cfg.daemon.state_dir / "migd.db")
        self.store.checkpoint_in_background()
        if self.store.recovered_from is not None:
            log.error(
                "state_db.corrupt",
                moved_to=str(self.store.recovered_from),
                error=self.store.corruption,
                hint="started with an empty state db; instances are re-adopted from the GPUs",
            )
            self.notes.append(f"state db was unreadable; moved to {self.store.recovered_from}")
        self.gpus = self.backend.discover()
        managed = [self._manage(info) for info in self.gpus]
        self.scheduler = NodeScheduler(managed, scheduler_policy(cfg), mps_env=self._mps_env)
        self._apply_demand_prior()
        draining = set(self.db.get_meta("draining", []))
        for gpu in managed:
            if gpu.uuid in draining:
                gpu.draining = True
            self.workers[gpu.index] = GpuWorker(
                gpu.index, ThreadPoolExecutor(1, thread_name_prefix=f"gpu{gpu.index}")
            )
        if self.mps is not None:
            try:
                report = await asyncio.get_running_loop().run_in_executor(None, self.mps.start)
                for uuid in getattr(report, "adopted", ()):
                    self.notes.append(f"adopted the MPS daemon of {uuid}")
                for uuid in getattr(report, "lost", ()):
                    self.notes.append(f"the MPS daemon of {uuid} had died while migd was down")
                self._mps_adopted_at_start = tuple(report.adopted)
                self._mps_lost_at_start = tuple(report.lost)
            except MigdError as exc:
                log.error("mps.start_failed", error=exc.message, hint=exc.hint)
        await self.reconcile()
        await self._reattach_mps()
        await self.bind()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        for index in self.workers:
            self._tasks.append(asyncio.create_task(self._gpu_loop(index), name=f"gpu{index}"))
        self._tasks += [
            asyncio.create_task(self._reaper_loop(), name="reaper"),
            asyncio.create_task(self._timer_loop(), name="timers"),
            asyncio.create_task(self._watchdog_loop(), name="watchdog"),
            asyncio.create_task(self._sampler_loop(), name="sampler"),
        ]
        summary = ", ".join(f"{g.index}:{g.model}/{g.mode.value}" for g in managed) or "no GPUs"
        log.info(
            "daemon.ready",
            version=__version__,
            socket=str(cfg.api.socket),
            backend=cfg.backend.kind,
            gpus=summary,
            leases=len(self.sched.active_leases()),
        )
        # The precomputed state spaces are large and live for the whole run; moving them out
        # of the collector's view keeps full collections from pausing requests for ~15 ms.
        gc.collect()
        gc.freeze()
        self.notifier.ready(f"serving {len(managed)} GPU(s): {summary}")

    def _manage(self, info: GpuInfo) -> ManagedGpu:
        if not info.mig_mode_known:
            # Unknown is not "no MIG": a MIG GPU managed whole would be handed out wrongly.
            return ManagedGpu(
                index=info.index,
                uuid=info.uuid,
                model=info.model or info.name,
                name=info.name,
                memory_total_mib=info.memory_total_mib,
                mode=GpuMode.OFF,
                health=f"{info.mig_mode_error}; no work on this GPU: restart migd once "
                f"`nvidia-smi -q -i {info.index}` shows its MIG mode",
            )
        override = self.config.override_for(info.index, info.uuid)
        wanted = override.mode if override else "auto"
        mps_in_mig = bool(override and override.mps_in_mig)
        health = "ok"
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
        elif wanted == "mig":
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
                geometry = self.backend.geometry(info.index)
                profiles = (override.profiles if override and override.profiles else None) or (
                    self.config.policy.profiles
                )
                space = state_space(geometry, profiles)
            except MigdError as exc:
                health = f"no MIG geometry: {exc.message}"
        elif mode is GpuMode.MIG:
            with contextlib.suppress(MigdError):
                space = state_space(self.backend.geometry(info.index), self.config.policy.profiles)
        name = info.model or info.name
        gpu = ManagedGpu(
            index=info.index,
            uuid=info.uuid,
            model=name,
            name=info.name,
            memory_total_mib=info.memory_total_mib,
            mode=mode,
            space=space,
            health=health,
        )
        self._manage_mps(gpu, info, mps_in_mig, override.mps_profile if override else None)
        return gpu

    def _apply_demand_prior(self) -> None:
        # Per model: a name (or ID) means a different profile on each model it exists on.
        prior: dict[tuple[str, int], float] = {}
        spaces = [g.space for g in self.sched.gpus.values() if g.space is not None]
        for name, weight in self.config.policy.demand_prior.items():
            known = False
            for space in spaces:
                try:
                    prior[(space.geometry.model, space.member(name).profile_id)] = weight
                    known = True
                except MigdError:
                    continue
            if not known:
                raise ConfigError(f"no GPU has profile {name!r}", where="policy.demand_prior")
        self.sched.demand.prior = prior
        saved = self.db.get_meta("demand")
        if saved:
            self.sched.demand.load(saved.get("counts", {}), saved.get("last_s"))

    async def reconcile(self) -> None:
        """Adopt what the GPUs have, reload leases, reclaim those whose holder is gone."""
        now, mono = self.now()
        for gpu in self.sched.gpus.values():
            if gpu.mode is GpuMode.MIG and gpu.space is not None:
                notes = await self._resync_gpu(gpu.index)
                for note in notes:
                    self.notes.append(f"GPU {gpu.index}: {note}")
                    log.info("reconcile.instance", gpu=gpu.index, note=note)
        for lease in self.db.live_leases():
            self._restore_lease(lease, now, mono)
        await self._reap(now, mono)
        work = self.sched.schedule(now, mono)
        self.dispatch(work)

    def _restore_lease(self, lease: Lease, now: float, mono: float) -> None:
        sched = self.sched
        if lease.state in (LeaseState.QUEUED, LeaseState.PREPARING):
            # Its client's connection died with the old daemon; the wrapper asks again.
            lease.state = LeaseState.QUEUED
            sched.leases[lease.lease_id] = lease
            sched.release(lease.lease_id, now, mono, reason="daemon restarted while waiting")
            self.save(lease)
            self.record("cancelled", lease, reason=lease.reason)
            return
        gpu = sched.gpus.get(lease.gpu if lease.gpu is not None else -1)
        if gpu is None or gpu.uuid != lease.gpu_uuid:
            lease.state = LeaseState.ACTIVE
            sched.leases[lease.lease_id] = lease
            sched.release(lease.lease_id, now, mono, reclaim=True, reason="its GPU is gone")
            self.save(lease)
            self.record("reclaimed", lease, reason=lease.reason)
            return
        sched.leases[lease.lease_id] = lease
        if lease.mode == "mig":
            inst = gpu.instance_at(lease.start) if lease.start is not None else None
            if inst is None or (lease.mig_uuid and inst.uuid != lease.mig_uuid):
                sched.release(
                    lease.lease_id, now, mono, reclaim=True, reason="its MIG instance is gone"
                )
                self.save(lease)
                self.record("reclaimed", lease, reason=lease.reason)
                return
            inst.lease_id, inst.idle_since_s = lease.lease_id, None
            if inst.origin is Origin.UNEXPLAINED:
                inst.origin, inst.note = Origin.MIGD, ""
        elif lease.mode == "mps" and not sched.restore_mps_share(gpu, lease):
            sched.release(
                lease.lease_id, now, mono, reclaim=True, reason="its MIG instance is gone"
            )
            self.save(lease)
            self.record("reclaimed", lease, reason=lease.reason)
            return
        elif lease.mode == "exclusive":
            gpu.exclusive_lease = lease.lease_id
        self._logged[lease.lease_id] = lease.state
        log.info(
            "lease.restored",
            lease_id=lease.lease_id,
            job_id=lease.request.job_id,
            gpu=lease.gpu,
            mode=lease.mode,
            holder_pid=lease.owner_pid,
        )

    async def _reattach_mps(self) -> None:
        """Register restored MPS leases with their (adopted or restarted) control daemons.

        A lease whose daemon died while migd was down lost its CUDA clients with it: it is
        flagged (and the loss recorded) before a new daemon is started for it.
        """
        if self.mps is None:
            return
        lost = set(self._mps_lost_at_start)
        for uuid in sorted(lost):
            self._mps_clients_lost(uuid, "its MPS control daemon died while migd was down")
        adopted = set(self._mps_adopted_at_start)
        for lease in self.sched.active_leases():
            device = lease.mps_device_uuid
            if device is not None and device not in adopted and device not in lost:
                # No daemon was found at all (not even a dead one's record): flag it too.
                lease.warn(
                    "MPS clients may be lost: no MPS control daemon was running for it when "
                    "migd started",
                    self.clock.now(),
                )
                self.save(lease)
                self.record("mps.clients_lost", lease, device=device, reason=lease.warning)
            if device is not None and lease.state is LeaseState.ACTIVE:
                try:
                    await self._ensure_mps(lease)
                except MigdError as exc:
                    log.warning("mps.reattach_failed", lease_id=lease.lease_id, error=exc.message)

    async def _resync_gpu(self, index: int) -> list[str]:
        """Adopt what the GPU has; leave alone what migd cannot explain.

        An instance with processes on any of its compute instances (and no lease), one
        made by hand with several compute instances, or one of a profile outside
        ``policy.profiles`` is UNEXPLAINED: listed by ``migctl status``, never destroyed.
        For the last, the GPU's state machine is widened by that profile so its slices
        stay on the books, and the GPU takes no new work while it is there (so migd
        never places a profile the policy leaves out); its health says why.
        """
        gpu = self.sched.gpus[index]
        assert gpu.space is not None
        configured = self._configured_space.setdefault(index, gpu.space)
        try:
            instances = await self.on_gpu(index, self.backend.list_instances, index)
            in_use = await self.on_gpu(index, self._instances_in_use, index, instances)
        except (MigdError, TimeoutError) as exc:
            gpu.health = f"cannot read instances: {exc}"
            self._resync_health[index] = gpu.health
            return [gpu.health]
        # Nothing below waits: the books and the health change in one step.
        if gpu.health == self._resync_health.pop(index, None):
            gpu.health = "ok"  # an earlier resync's verdict; judged afresh below
        health_before = gpu.health
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
        gpu.space = (
            state_space(configured.geometry, [p.name for p in (*configured.profiles, *foreign)])
            if foreign
            else configured
        )
        now, _ = self.now()
        own = self.db.own_instances(gpu.uuid)
        notes += self.sched.resync(index, observed, busy, now)
        for managed in gpu.instances:
            why = untouchable.get(managed.start)
            if why and managed.lease_id is None and managed.status is InstanceStatus.READY:
                if managed.origin is not Origin.UNEXPLAINED or managed.note != why:
                    notes.append(f"{managed}: unexplained ({why})")
                managed.origin, managed.note = Origin.UNEXPLAINED, why
        if foreign:
            gpu.health = (
                "instances of profiles outside policy.profiles ("
                + ", ".join(sorted({p.name for p in foreign}))
                + "): no new work on this GPU until they are gone or policy.profiles lists them"
            )
        if unknown:
            gpu.health = (
                f"{', '.join(unknown)} of a profile migd's geometry does not have: no new work "
                "on this GPU until it is gone"
            )
        if gpu.health != health_before:
            self._resync_health[index] = gpu.health
        present = {m.start for m in gpu.instances}
        for managed in gpu.instances:
            if managed.start in own and managed.origin is Origin.ADOPTED:
                managed.origin = Origin.MIGD
        for start in set(own) - present:
            self.db.forget_instance(gpu.uuid, start)  # work that never reached the GPU
        teardown = self.sched.discard_incomplete(index, own)
        for work in teardown:
            notes.append(f"destroying {', '.join(str(op) for op in work.ops)} (incomplete)")
        self.dispatch(teardown)
        return notes

    def _instances_in_use(self, index: int, instances: list[MigInstance]) -> set[int]:
        """GPU instance ids with processes on any of their compute instances (GPU thread)."""
        in_use: set[int] = set()
        for inst in instances:
            uuids = [ci.uuid for ci in inst.compute_instances]
            if any(self.backend.processes(index, uuid) for uuid in uuids):
                in_use.add(inst.gi_id)
        return in_use

    # -- the socket -------------------------------------------------------------------------

    async def bind(self) -> None:
        path = self.config.api.socket
        check_socket_path(path)
        access = socket_access(self.config.api)  # before binding: an unknown group fails
        self._server = await asyncio.start_unix_server(
            self._serve_client, path=str(path), limit=self.config.api.max_message_bytes
        )
        self._apply_socket_access(access)

    def _apply_socket_access(self, access: tuple[int, int]) -> None:
        """Socket file mode and group (at start and on every reload)."""
        mode, gid = access
        path = self.config.api.socket
        os.chown(path, -1, gid)
        path.chmod(mode)
        api = self.config.api
        if mode == 0o660 and api.socket_group is None:
            others = [u for u in api.lease_users if u not in ("root", "0")] + api.lease_groups
            if others:
                log.warning(
                    "api.socket_private",
                    socket=str(path),
                    lease_users=others,
                    reason="status_public = false makes the socket 0660 with migd's own group, "
                    "so these lease users cannot connect",
                    hint="set api.socket_group to the group they share",
                )

    def _admit(self, peer: Peer, reader_only: bool) -> None:
        """Connection limits: nobody holds more than api.max_clients_per_uid connections,
        and users who may not lease never take the last quarter of api.max_clients, so
        lease users keep being served. Root is never refused."""
        api = self.config.api
        if peer.uid == 0:
            return
        held = self._per_uid.get(peer.uid, 0)
        if held > api.max_clients_per_uid:
            raise DaemonUnavailable(
                f"uid {peer.uid} holds {held - 1} connections to migd already "
                f"(api.max_clients_per_uid = {api.max_clients_per_uid})",
                hint="close idle connections and retry; `ss -xp | grep migd.sock` shows them",
            )
        if self._clients > api.max_clients or (
            reader_only and self._readers > api.max_clients - api.max_clients // 4
        ):
            raise DaemonUnavailable(
                f"migd has too many connections open ({self._clients - 1}, "
                f"api.max_clients = {api.max_clients})",
                hint="retry in a few seconds; `ss -xp | grep migd.sock` shows who holds them",
            )

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sock = writer.get_extra_info("socket")
        try:
            peer = Peer.from_socket(sock)
        except OSError:
            writer.close()
            return
        reader_only = peer.uid != 0 and not self.auth.may_lease(peer)
        self._clients += 1
        self._per_uid[peer.uid] = self._per_uid.get(peer.uid, 0) + 1
        self._readers += int(reader_only)
        try:
            await self._serve_peer(peer, reader_only, reader, writer)
        finally:
            self._clients -= 1
            self._readers -= int(reader_only)
            left = self._per_uid[peer.uid] - 1
            if left:
                self._per_uid[peer.uid] = left
            else:
                del self._per_uid[peer.uid]

    async def _serve_peer(
        self,
        peer: Peer,
        reader_only: bool,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        api = self.config.api
        try:
            self._admit(peer, reader_only)
            line = await asyncio.wait_for(reader.readline(), api.request_timeout_s)
        except (ValueError, asyncio.LimitOverrunError):
            error = ProtocolError(f"message longer than {api.max_message_bytes} bytes")
            await self._send(writer, error_reply(None, error))
            return
        except TimeoutError:
            error = ProtocolError(
                f"no complete request line within {api.request_timeout_s:g} s; closing",
                hint="send the request and its newline right after connecting",
            )
            await self._send(writer, error_reply(None, error))
            return
        except MigdError as exc:
            await self._send(writer, error_reply(None, exc))
            return
        except OSError:
            writer.close()
            return
        request_id: int | str | None = None
        try:
            if not line:
                return
            request = decode_request(line)
            request_id = request.id
            if self.stopping.is_set():
                raise DaemonUnavailable("migd is stopping", hint="retry in a few seconds")
            began = time.perf_counter()
            result = await self.handle(request, peer, reader)
            await self._send(writer, ok_reply(request_id, result))
            self.latency_s[_latency_class(request.op, result)].append(time.perf_counter() - began)
        except MigdError as exc:
            if not isinstance(exc, (ProtocolError, NotAuthorized, LeaseNotFound)):
                log.info("request.refused", error=exc.code, message=exc.message, peer_uid=peer.uid)
            await self._send(writer, error_reply(request_id, exc))
        except Exception as exc:  # never let one request take the daemon down
            log.exception("request.crashed", error=str(exc))
            await self._send(writer, error_reply(request_id, MigdError(f"internal error: {exc}")))

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
        with contextlib.suppress(OSError):
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()
            await writer.wait_closed()

    # -- request handlers -------------------------------------------------------------------

    async def handle(self, req: Request, peer: Peer, reader: asyncio.StreamReader) -> Any:
        if isinstance(req, PingRequest):
            return {"version": __version__, "pid": os.getpid(), "backend": self.config.backend.kind}
        if isinstance(req, LeaseRequestMsg):
            return await self.handle_lease(req, peer, reader)
        if isinstance(req, LeaseRef):
            return await self.handle_lease_ref(req, peer)
        if isinstance(req, ReportRequest) and req.event == "mps_client_error":
            return await self._report_mps_client_error(req, peer)
        if isinstance(req, ReleaseJobRequest):
            return self.handle_release_job(req, peer)
        if isinstance(req, ReportRequest):
            lease = self._lease_for(req.lease_id)
            self.auth.require_owner(peer, lease.owner_uid, "report on")
            self.record(f"wrapper.{req.event}", lease, **req.data)
            # Nested, so a client's keys can neither clash with nor forge the log's own
            # fields (level, timestamp, event, lease_id).
            log.info(
                f"wrapper.{req.event}",
                lease_id=lease.lease_id,
                job_id=lease.request.job_id,
                data=req.data,
            )
            return {"recorded": True}
        if isinstance(req, StatusRequest):
            if req.op == "reload":
                self.auth.require_admin(peer, "reload the configuration")
                return await self.reload()
            self.auth.require_read(peer)
            if req.op == "status":
                return build_status(self)
            leases = self.sched.active_leases() if not req.all else self.db.recent_leases(500)
            return {"leases": [self._lease_view(lease, peer) for lease in leases]}
        if isinstance(req, ExplainRequest):
            self.auth.require_read(peer)
            job_id = self._job_id(req.job_id)
            return explain_job(self, job_id, lambda lease: self._lease_view(lease, peer))
        if isinstance(req, HistoryRequest):
            self.auth.require_read(peer)
            job = self._job_id(req.job_id) if req.job_id else None
            return {"history": [r.to_dict() for r in self.db.history(limit=req.limit, job_id=job)]}
        if isinstance(req, GpuRequest):
            return await self.handle_gpu_op(req, peer)
        if isinstance(req, SimRequest):
            return self.handle_sim(req, peer)
        raise ProtocolError(f"unhandled op {req.op!r}")  # pragma: no cover

    def _lease_view(self, lease: Lease, peer: Peer) -> dict[str, Any]:
        view = lease.to_dict()
        if peer.uid != lease.owner_uid and not self.auth.is_admin(peer):
            view.pop("env", None)  # another user's environment is not theirs to read
        return view

    def _job_id(self, given: str) -> str:
        """A job as admins name it: its GlobalJobId as the wrapper sends it, or the
        ``ClusterId.ProcId`` that ``condor_q`` shows when one schedd's job matches."""
        if "#" in given or not _CLUSTER_PROC.fullmatch(given):
            return given
        if self.db.leases_for_job(given):  # leased by a client that sent the short form
            return given
        found = self.db.job_ids_ending(given)
        if len(found) > 1:
            raise InvalidRequest(
                f"job {given} names {len(found)} jobs from different access points: "
                + ", ".join(found[:5]),
                hint="give the GlobalJobId (condor_q -af GlobalJobId)",
            )
        return found[0] if found else given

    def _lease_for(self, lease_id: str) -> Lease:
        lease = self.sched.leases.get(lease_id) or self.db.get_lease(lease_id)
        if lease is None:
            raise LeaseNotFound(f"no lease {lease_id}")
        return lease

    async def handle_lease(
        self, req: LeaseRequestMsg, peer: Peer, reader: asyncio.StreamReader
    ) -> dict[str, Any]:
        self.auth.require_lease(peer)
        # The holder is the caller as the kernel names it (SO_PEERCRED, translated into
        # migd's PID namespace). A client may name another process of its own; a PID
        # that is not one (e.g. the caller's getpid() inside a PID namespace, as older
        # wrappers sent) is ignored rather than refused.
        holder = peer.pid
        if req.holder_pid is not None and req.holder_pid != peer.pid:
            if self.procs.uid(req.holder_pid) == peer.uid:
                holder = req.holder_pid
            else:
                log.warning(
                    "lease.holder_pid_ignored",
                    holder_pid=req.holder_pid,
                    uid=peer.uid,
                    using_pid=peer.pid,
                    reason="not a process of the caller's uid in migd's PID namespace",
                )
        policy = self.config.policy
        wait_s = policy.default_wait_s if req.wait_s is None else req.wait_s
        wait_s = min(wait_s, policy.max_wait_s)
        request = LeaseRequest(
            job_id=req.job_id,
            memory_mib=req.gpu_memory_mib,
            slot=req.slot,
            min_compute=req.min_compute,
            profile=req.profile,
            mode=req.mode,
            gpu_uuids=tuple(req.gpus) if req.gpus else None,
            wait_s=wait_s,
            mps_clients=req.mps_clients,
            mps_thread_percentage=req.mps_thread_percentage,
        )
        now, mono = self.now()
        lease = Lease(
            lease_id=f"{int(now)}-{secrets.token_hex(4)}",
            request=request,
            owner_uid=peer.uid,
            owner_pid=holder,
            owner_start_s=self.procs.start_time(holder),
            created_s=now,
        )
        try:
            outcome = self.sched.submit(lease, now, mono)
        except NoCapacity as refusal:
            # Refused, but the same pass may have placed requests queued before it.
            self._after_change(list(refusal.started_work))
            raise
        self.record(
            "submitted",
            lease,
            memory_mib=request.memory_mib,
            mode=request.mode,
            uid=peer.uid,
            state=lease.state.value,
            queued_position=outcome.queued_position,
        )
        self.save(lease)
        self._after_change(outcome.work)
        # Queued: no capacity now, the grant waits for other leases to end. Preparing: the
        # partition is being made for this request (NVML time, not queueing).
        first_state = lease.state
        if lease.state is not LeaseState.ACTIVE:
            lease = await self._wait_active(lease, reader, wait_s)
        await self._ensure_mps(lease)
        view = self._lease_view(lease, peer)
        view["queued"] = first_state is LeaseState.QUEUED
        view["prepared"] = first_state is LeaseState.PREPARING
        return view

    async def _wait_active(
        self, lease: Lease, reader: asyncio.StreamReader, wait_s: float
    ) -> Lease:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Lease] = loop.create_future()
        self.waiters[lease.lease_id] = Waiter(future, lease.lease_id)
        hangup: asyncio.Future[Any] = asyncio.ensure_future(reader.read(1))  # EOF: client gone
        try:
            done, _ = await asyncio.wait(
                [future, hangup],
                timeout=wait_s + self.config.daemon.work_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if future in done:
                return future.result()
            now, mono = self.now()
            reason = "client disconnected while waiting" if hangup in done else "wait timed out"
            if not lease.state.terminal:
                self._after_change(self.sched.release(lease.lease_id, now, mono, reason=reason))
                self.save(lease)
                self.record("cancelled", lease, reason=reason)
            raise LeaseTimeout(f"lease {lease.lease_id} not granted: {reason}")
        finally:
            hangup.cancel()
            self.waiters.pop(lease.lease_id, None)

    def _resolve_waiters(self) -> None:
        for lease_id, waiter in list(self.waiters.items()):
            lease = self.sched.leases.get(lease_id)
            if waiter.future.done() or lease is None:
                continue
            if lease.state is LeaseState.ACTIVE:
                waiter.future.set_result(lease)
            elif lease.state.terminal:
                error: MigdError = LeaseTimeout(
                    f"lease {lease_id} ended while waiting: {lease.state.value} ({lease.reason})"
                )
                if lease.state is LeaseState.FAILED:
                    error = GpuError(f"could not prepare a partition: {lease.reason}")
                waiter.future.set_exception(error)

    async def handle_lease_ref(self, req: LeaseRef, peer: Peer) -> dict[str, Any]:
        lease = self._lease_for(req.lease_id)
        now = self.clock.now()
        if req.op == "get_lease":
            self.auth.require_owner(peer, lease.owner_uid, "read")
            return self._lease_view(lease, peer)
        if req.op == "heartbeat":
            self.auth.require_owner(peer, lease.owner_uid, "heartbeat")
            if lease.state is not LeaseState.ACTIVE:
                raise LeaseNotFound(f"lease {lease.lease_id} is {lease.state.value}, not active")
            self.sched.heartbeat(lease.lease_id, now)
            self.save(lease)
            return {"state": lease.state.value}
        if req.op == "usage":
            self.auth.require_owner(peer, lease.owner_uid, "read")
            return await self._usage(lease)
        # release
        self.auth.require_owner(peer, lease.owner_uid, "release")
        return self._release(lease, req.reason or f"released by uid {peer.uid}")

    def _release(self, lease: Lease, reason: str, *, reclaim: bool = False) -> dict[str, Any]:
        if lease.lease_id not in self.sched.leases or lease.state.terminal:
            return {"state": lease.state.value, "already": True}
        now, mono = self.now()
        mps_device = lease.mps_device_uuid if lease.state.holds_resources else None
        work = self.sched.release(lease.lease_id, now, mono, reclaim=reclaim, reason=reason)
        if mps_device and self.mps is not None and lease.gpu is not None:
            # Lowers the daemon's pinned limits; the daemon stops after mps.idle_stop_s.
            self.workers[lease.gpu].executor.submit(
                self.mps.release_share, mps_device, lease.lease_id
            )
        self.save(lease)
        peak = self.lease_peaks.pop(lease.lease_id, None)
        # (the state change itself is logged by save(): every lease transition is)
        self.record(
            "reclaimed" if reclaim else "released", lease, reason=reason, peak_used_mib=peak
        )
        self._after_change(work)
        return {"state": lease.state.value, "peak_used_mib": peak}

    def handle_release_job(self, req: ReleaseJobRequest, peer: Peer) -> dict[str, Any]:
        """The JOB_EXIT hook's release: admins and ``api.hook_users`` release every lease of
        the job, anyone else only their own (a job id alone proves nothing: any user can
        name any job)."""
        # Job ids are GlobalJobIds (unique across access points); a caller that knows the
        # slot narrows it further, so a bare ClusterId.ProcId cannot hit another schedd's job.
        leases = [
            lease
            for lease in self.sched.active_leases()
            if lease.request.job_id == req.job_id
            and not (req.slot and lease.request.slot and lease.request.slot != req.slot)
        ]
        if not self.auth.may_release_any(peer):
            mine = [lease for lease in leases if lease.owner_uid == peer.uid]
            if leases and not mine:
                raise NotAuthorized(
                    f"user {peer.user} (uid {peer.uid}) may not release job {req.job_id}'s "
                    f"leases: they belong to uid {leases[0].owner_uid}",
                    hint="the lease's owner, an admin or a user in api.hook_users may",
                    uid=peer.uid,
                )
            leases = mine
        released = []
        for lease in leases:
            self._release(lease, req.reason or f"released by the JOB_EXIT hook (uid {peer.uid})")
            released.append(lease.lease_id)
        return {"released": released}

    async def _usage(self, lease: Lease) -> dict[str, Any]:
        if lease.gpu is None or lease.state is not LeaseState.ACTIVE:
            return {"state": lease.state.value}
        gpu = lease.gpu
        # MIG: the instance; MPS: its device (a MIG instance or the whole GPU).
        device = lease.mig_uuid if lease.mode in ("mig", "mps") else None
        try:
            memory = await self.on_gpu(gpu, self.backend.memory, gpu, device, timeout_s=10.0)
            procs = await self.on_gpu(gpu, self.backend.processes, gpu, device, timeout_s=10.0)
            if lease.mode == "mps":  # the device is shared: only this job's processes
                procs = await self.on_gpu(gpu, self._mps_usage, lease, procs, timeout_s=10.0)
        except (MigdError, TimeoutError) as exc:
            return {"state": lease.state.value, "error": str(exc)}
        self._note_peak(
            lease.lease_id, _known_sum(procs) if lease.mode == "mps" else memory.used_mib
        )
        return {
            "state": lease.state.value,
            "limit_mib": lease.memory_limit_mib,
            "peak_used_mib": self.lease_peaks.get(lease.lease_id),
            "device_used_mib": memory.used_mib,
            "device_total_mib": memory.total_mib,
            "processes": [{"pid": p.pid, "used_mib": p.used_mib} for p in procs],
            "scope": "job" if lease.mode == "mps" else "device",
        }

    async def handle_gpu_op(self, req: GpuRequest, peer: Peer) -> dict[str, Any]:
        self.auth.require_admin(peer, f"{req.op} a GPU")
        gpu = self._gpu_ref(req.gpu)
        now, mono = self.now()
        if req.op in ("drain", "resume"):
            self.sched.set_draining(gpu.index, req.op == "drain")
            draining = sorted(g.uuid for g in self.sched.gpus.values() if g.draining)
            self.db.set_meta("draining", draining)
            self.record(req.op, None, gpu=gpu.index, uid=peer.uid)
            log.info(f"gpu.{req.op}", gpu=gpu.index, uid=peer.uid)
            if req.op == "resume":
                self._after_change(self.sched.schedule(now, mono))
            return {"gpu": gpu.index, "draining": gpu.draining}
        if gpu.mode is not GpuMode.MIG:
            raise InvalidRequest(f"GPU {gpu.index} is not in MIG mode; nothing to reset")
        busy = [str(i) for i in gpu.instances if i.busy]
        work = self.sched.reset(gpu.index)
        self.record("reset", None, gpu=gpu.index, uid=peer.uid, kept=busy)
        self._after_change(work)
        return {
            "gpu": gpu.index,
            "destroying": [str(op) for w in work for op in w.ops],
            "kept_busy": busy,
        }

    def _gpu_ref(self, ref: str) -> ManagedGpu:
        for gpu in self.sched.gpus.values():
            if ref == str(gpu.index) or (len(ref) >= 8 and gpu.uuid.startswith(ref)):
                return gpu
        raise InvalidRequest(
            f"no GPU {ref!r} on this node", hint="use an index or UUID from `migctl status`"
        )

    def handle_sim(self, req: SimRequest, peer: Peer) -> dict[str, Any]:
        if self.sim_node is None:
            raise InvalidRequest(
                f"{req.op} exists only with the simulated backend",
                hint="start migd with --simulate for fake CUDA jobs",
            )
        self.auth.require_lease(peer)
        node = self.sim_node
        try:
            if req.op == "sim_attach":
                node.attach(req.pid, req.device_uuid, mps_pinned_limit_mib=req.mps_limit_mib)
            elif req.op == "sim_alloc":
                node.alloc(req.pid, req.mib)
            elif req.op == "sim_free":
                node.free(req.pid, req.mib)
            else:
                node.detach(req.pid)
        except RuntimeError as exc:
            # What a CUDA program would get back (SimCudaError / SimOutOfMemory): a result
            # for the fake job to print and exit on, not a daemon error.
            return {
                "pid": req.pid,
                "cuda_error": str(exc),
                "oom": type(exc).__name__ == "SimOutOfMemory",
                "limit_mib": getattr(exc, "limit_mib", None),
                "used_mib": getattr(exc, "used_mib", None),
            }
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        proc = node.process(req.pid)
        return {"pid": req.pid, "used_mib": getattr(proc, "used_mib", 0) if proc else 0}

    # -- work execution ---------------------------------------------------------------------

    def dispatch(self, work: list[Work]) -> None:
        for item in work:
            if item.ops:
                self.workers[item.gpu].queue.put_nowait(item)

    def _after_change(self, work: list[Work]) -> None:
        """Persist leases that changed, run new work, answer waiting clients."""
        ended = []
        for lease in list(self.sched.leases.values()):
            if self._saved.get(lease.lease_id) != lease.version:
                self.save(lease)
            if lease.state.terminal:
                ended.append(lease.lease_id)
        self.dispatch(work)
        self._resolve_waiters()
        # Ended leases live on in the state db; keeping them in memory would make every
        # change cost O(all leases ever), so they go once persisted and answered.
        for lease_id in ended:
            if lease_id not in self.waiters:
                self.sched.forget(lease_id)
                self._saved.pop(lease_id, None)
                self._logged.pop(lease_id, None)

    async def _gpu_loop(self, index: int) -> None:
        worker = self.workers[index]
        while True:
            work = await worker.queue.get()
            worker.busy_since_mono = self.clock.monotonic()
            try:
                await self._run_work(work)
            except Exception as exc:  # keep the loop alive whatever happens
                log.exception("work.crashed", gpu=index, error=str(exc))
            finally:
                worker.busy_since_mono = None

    async def _run_work(self, work: Work) -> None:
        if not self.sched.work_is_current(work):
            log.info(
                "work.skipped",
                gpu=work.gpu,
                ops=[str(op) for op in work.ops],
                reason="an earlier operation on this GPU failed",
            )
            self.sched.work_failed(work, GpuError("obsolete"), self.clock.now())
            return
        gpu = self.sched.gpus[work.gpu]
        targets: dict[int, tuple[int | None, str | None]] = {}
        for op in work.ops:
            if isinstance(op, DestroyOp):
                inst = gpu.instance_at(op.start, InstanceStatus.DESTROYING)
                targets[op.start] = (inst.gi_id, inst.uuid) if inst else (None, None)
        lease = self.sched.leases.get(work.lease_id or "")
        for op in work.ops:
            if isinstance(op, CreateOp):
                # Written before the NVML call: after a crash mid-create, a GPU instance
                # without a compute instance at this start is known to be migd's own.
                self.db.remember_instance(gpu.uuid, op.start, op.profile.profile_id, None)
        started = time.monotonic()
        try:
            created = await self.on_gpu(work.gpu, self._execute, work, targets)
        except (MigdError, TimeoutError) as exc:
            error = exc if isinstance(exc, MigdError) else GpuError("NVML call timed out")
            now, mono = self.now()
            self.sched.work_failed(work, error, now)
            log.warning(
                "work.failed",
                gpu=work.gpu,
                ops=[str(op) for op in work.ops],
                error=str(error),
                lease_id=work.lease_id,
            )
            self.record(
                "work.failed",
                lease,
                gpu=work.gpu,
                ops=[str(o) for o in work.ops],
                error=error.to_dict(),
            )
            if isinstance(exc, TimeoutError):
                gpu.health = "an NVML call hung; the watchdog will restart migd"
                self._watchdog_tripped = gpu.health
                return
            for note in await self._resync_gpu(work.gpu):
                log.info("resync", gpu=work.gpu, note=note)
            self._after_change(self.sched.schedule(now, mono))
            return
        now, mono = self.now()
        self.sched.work_done(work, created, now)
        for op in work.ops:
            if isinstance(op, DestroyOp):
                self.db.forget_instance(gpu.uuid, op.start)
            else:
                self.db.remember_instance(
                    gpu.uuid, op.start, op.profile.profile_id, created[op.start][1]
                )
        elapsed = time.monotonic() - started
        log.info(
            "work.done",
            gpu=work.gpu,
            kind=work.kind,
            ops=[str(op) for op in work.ops],
            seconds=round(elapsed, 3),
            lease_id=work.lease_id,
        )
        if lease is not None and lease.state is LeaseState.ACTIVE:
            self._work_seconds[lease.lease_id] = round(elapsed, 3)  # for the grant's record
        elif work.kind == "teardown":
            self.record("teardown", None, gpu=work.gpu, ops=[str(o) for o in work.ops])
        self._after_change(self.sched.schedule(now, mono))

    def _execute(
        self, work: Work, targets: dict[int, tuple[int | None, str | None]]
    ) -> dict[int, tuple[int | None, str | None, int]]:
        """Run a work item's NVML operations in order (in the GPU's thread)."""
        created: dict[int, tuple[int | None, str | None, int]] = {}
        for op in work.ops:
            if isinstance(op, DestroyOp):
                gi_id, uuid = targets[op.start]
                if gi_id is None:
                    raise GpuError(f"cannot destroy {op.profile.name}@{op.start}: unknown GI id")
                self._stop_mps_before_destroy(work.gpu, uuid)  # its server is a process too
                if uuid and self.backend.processes(work.gpu, uuid):
                    # Never destroy an instance a process uses, whatever our books say.
                    raise GpuBusy(f"{op.profile.name}@{op.start} has processes; not destroying it")
                self.backend.destroy_instance(work.gpu, gi_id)
            elif isinstance(op, CreateOp):
                inst = self.backend.create_instance(work.gpu, op.profile.profile_id, op.start)
                created[op.start] = (inst.gi_id, inst.uuid, inst.memory_total_mib)
        return created

    # -- MPS --------------------------------------------------------------------------------

    def _manage_mps(
        self, gpu: ManagedGpu, info: GpuInfo, mps_in_mig: bool, mps_profile: str | None
    ) -> None:
        """MPS settings of a GPU: MPS inside MIG instances, and its compute slices."""
        if gpu.space is not None:
            gpu.compute_slices = gpu.space.geometry.compute_slices
        elif gpu.mode is GpuMode.MPS:
            with contextlib.suppress(MigdError):  # a MIG-capable model used whole
                gpu.compute_slices = self.backend.geometry(info.index).compute_slices
        if not mps_in_mig or gpu.mode is not GpuMode.MIG:
            return
        gpu.mps_in_mig = True
        if mps_profile and gpu.space is not None:
            try:
                gpu.mps_profile = gpu.space.member(mps_profile).name
            except MigdError as exc:
                gpu.health = f"mps_profile {mps_profile!r}: {exc.message}"

    def _mps_env(self, gpu: ManagedGpu, lease: Lease) -> dict[str, str]:
        if self.mps is None:
            return default_mps_env(gpu, lease)
        return dict(self.mps.client_env(lease.mig_uuid or gpu.uuid, lease))

    async def _ensure_mps(self, lease: Lease) -> None:
        device = lease.mps_device_uuid
        if device is None or self.mps is None or lease.gpu is None:
            return
        try:
            share = self.mps.share_for(lease)
            await self.on_gpu(lease.gpu, self.mps.ensure_share, device, share)
        except MigdError:
            self._release(lease, "MPS daemon could not start")
            raise

    def _mps_leases(self, device_uuid: str) -> list[Lease]:
        return [
            lease
            for lease in self.sched.active_leases()
            if lease.state is LeaseState.ACTIVE and lease.mps_device_uuid == device_uuid
        ]

    def _mps_clients_lost(self, device_uuid: str, why: str) -> None:
        """Flag the leases of an MPS device whose clients died; record it in the history."""
        now = self.clock.now()
        for lease in self._mps_leases(device_uuid):
            lease.warn(f"MPS clients lost: {why}", now)
            self.save(lease)
            self.record("mps.clients_lost", lease, device=device_uuid, reason=why)
            log.warning(
                "mps.clients_lost",
                lease_id=lease.lease_id,
                job_id=lease.request.job_id,
                device=device_uuid,
                reason=why,
            )

    def _gpu_of_mps_device(self, device_uuid: str) -> ManagedGpu | None:
        for gpu in self.sched.gpus.values():
            if gpu.uuid == device_uuid or any(i.uuid == device_uuid for i in gpu.instances):
                return gpu
        return None

    def _kick_mps_housekeeping(self) -> None:
        """Start a housekeeping round unless one runs (a hung daemon must not stall reaping)."""
        if self._mps_task is None or self._mps_task.done():
            self._mps_task = asyncio.create_task(self._mps_housekeeping(), name="mps")

    async def _mps_housekeeping(self) -> None:
        """Restart dead MPS daemons/servers (their clients are lost), stop idle ones, and
        refresh the MPS status `migctl status` shows; all off the event loop."""
        loop = asyncio.get_running_loop()
        try:
            report = await loop.run_in_executor(None, self.mps.check_health)
            for event in getattr(report, "events", ()):
                # (not event=: structlog's own first argument has that name)
                log.warning("mps.health", device=event.device_uuid, **event.to_dict())
            for uuid in report.affected_devices:
                detail = next(e.detail for e in report.events if e.device_uuid == uuid)
                self._mps_clients_lost(uuid, f"the MPS server or daemon was restarted ({detail})")
            sick = {u: g for u in report.failed_devices if (g := self._gpu_of_mps_device(u))}
            for uuid, gpu in sick.items():
                gpu.health = f"{MPS_UNHEALTHY}: {uuid}"
            sick_gpus = {gpu.index for gpu in sick.values()}
            # A later check that finds the device serving again (or gone) clears the mark.
            for gpu in self.sched.gpus.values():
                if gpu.health.startswith(MPS_UNHEALTHY) and gpu.index not in sick_gpus:
                    gpu.health = "ok"
                    log.info("mps.recovered", gpu=gpu.index)
            await loop.run_in_executor(None, self.mps.stop_idle)
            await loop.run_in_executor(None, self.mps.refresh_status)
        except Exception as exc:
            log.exception("mps.housekeeping_crashed", error=str(exc))
        now, mono = self.now()
        self._after_change(self.sched.schedule(now, mono))

    def _stop_mps_before_destroy(self, gpu: int, mig_uuid: str | None) -> None:
        """In the GPU's thread, before a MIG instance is destroyed: stop its MPS daemon.

        Raises:
            GpuBusy: the instance's MPS server has clients (or cannot say): never destroy it.
        """
        if self.mps is None or not mig_uuid or not self.mps.manages(mig_uuid):
            return
        try:
            clients = self.mps.client_count(mig_uuid)
        except MigdError as exc:
            raise GpuBusy(
                f"the MPS daemon on {mig_uuid} does not say whether it has clients ({exc}); "
                "not destroying the instance"
            ) from exc
        if clients:
            raise GpuBusy(f"the MPS server on {mig_uuid} has {clients} client(s); not destroying")
        self.mps.stop_device(mig_uuid)
        log.info("mps.stopped_for_destroy", gpu=gpu, device=mig_uuid)

    def _mps_usage(self, lease: Lease, procs: list[GpuProcess]) -> list[GpuProcess]:
        """The GPU processes of an MPS lease: those in its holder's process tree.

        Every client of an MPS device shows on it, so the device's list has other jobs'
        processes too; the wrapper needs its own job's.
        """
        mine = []
        for proc in procs:
            pid, depth = proc.pid, 0
            while pid > 1 and depth < 64:
                if pid == lease.owner_pid:
                    mine.append(proc)
                    break
                parent = self.procs.parent(pid)
                if parent is None:
                    break
                pid, depth = parent, depth + 1
        return mine

    async def _report_mps_client_error(self, req: ReportRequest, peer: Peer) -> dict[str, Any]:
        """A wrapper saw an MPS failure in its job's stderr: pass it to the device's
        manager (the next health check restarts a device that refuses clients)."""
        lease = self._lease_for(req.lease_id)
        self.auth.require_owner(peer, lease.owner_uid, "report on")
        message = str(req.data.get("message", "")).strip()[:4096]
        if not message:
            raise InvalidRequest(
                "an mps_client_error report needs data.message",
                hint='send {"message": "<the stderr line>"}',
            )
        device = lease.mps_device_uuid
        self.record("wrapper.mps_client_error", lease, device=device, message=message)
        if device is None:
            # Not an MPS lease (a GPU in exclusive compute mode, say): history and log only.
            log.warning("client_error", lease_id=lease.lease_id, message=message)
            return {"recorded": True, "device": None}
        log.warning("mps.client_error", lease_id=lease.lease_id, device=device, message=message)
        if self.mps is not None:
            await asyncio.get_running_loop().run_in_executor(
                None, self.mps.report_client_error, device, message
            )
            self._kick_mps_housekeeping()
        return {"recorded": True, "device": device}

    # -- background loops -------------------------------------------------------------------

    async def _reaper_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.reaper.interval_s)
            now, mono = self.now()
            try:
                await self._reap(now, mono)
                if self.mps is not None:
                    self._kick_mps_housekeeping()
                # Instances that had processes without a lease are adopted once they empty;
                # a GPU an earlier resync found wanting is judged again.
                for gpu in list(self.sched.gpus.values()):
                    if gpu.index in self._resync_health or any(
                        i.origin is Origin.UNEXPLAINED for i in gpu.instances
                    ):
                        for note in await self._resync_gpu(gpu.index):
                            log.info("resync", gpu=gpu.index, note=note)
                        self._after_change(self.sched.schedule(now, mono))
            except Exception as exc:
                log.exception("reaper.crashed", error=str(exc))

    async def _reap(self, now: float, mono: float) -> None:
        """Reclaim leases whose holder is gone; never free an instance processes still use."""
        timeout = self.config.reaper.heartbeat_timeout_s
        for lease in list(self.sched.active_leases()):
            if lease.state is not LeaseState.ACTIVE:
                continue
            alive = self.procs.alive(lease.owner_pid, lease.owner_start_s)
            stale = timeout > 0 and (now - (lease.heartbeat_s or lease.updated_s)) > timeout
            if alive and not stale:
                continue
            reason = "holder process exited" if not alive else "no heartbeat"
            still_used = False
            if lease.mode == "mig" and lease.mig_uuid and lease.gpu is not None:
                try:
                    still_used = bool(
                        await self.on_gpu(
                            lease.gpu,
                            self.backend.processes,
                            lease.gpu,
                            lease.mig_uuid,
                            timeout_s=10.0,
                        )
                    )
                except (MigdError, TimeoutError):
                    still_used = True  # cannot tell: keep it untouchable
            if still_used and lease.gpu is not None:
                # Mark it before the release: the release schedules queued requests, and
                # none of them may be given an instance a dead holder's process still uses.
                inst = self.sched.gpus[lease.gpu].instance_of(lease.lease_id)
                if inst is not None:
                    inst.origin = Origin.UNEXPLAINED
                    inst.note = f"holder of {lease.lease_id} died but processes remain"
                    log.warning("reaper.instance_in_use", gpu=lease.gpu, instance=str(inst))
            self._release(lease, reason, reclaim=True)

    async def _timer_loop(self) -> None:
        """Queue deadlines, idle teardown, re-checks of unexplained instances, pruning."""
        tick = 0
        while True:
            await asyncio.sleep(1.0)
            tick += 1
            now, mono = self.now()
            try:
                expired = self.sched.expire(now, mono)
                for lease in expired:
                    self.save(lease)
                    self.record("expired", lease, reason=lease.reason)
                # What an expired request blocked (FIFO, a reservation) may go now.
                self._after_change(self.sched.schedule(now, mono) if expired else [])
                if tick % 10 == 0:
                    self._after_change(self.sched.idle_teardown(now))
                    self.db.set_meta(
                        "demand",
                        {"counts": self.sched.demand.snapshot(), "last_s": now},
                    )
                    self.sched.forget_terminal()
                    for book in (self._saved, self._logged, self._work_seconds):
                        for lease_id in [k for k in book if k not in self.sched.leases]:
                            del book[lease_id]
                if tick % 3600 == 0:
                    self.db.prune(self.config.daemon.history_keep)
            except Exception as exc:
                log.exception("timers.crashed", error=str(exc))

    async def _sampler_loop(self) -> None:
        """GPU memory once a second: per GPU and instance for ``migctl status``, and the
        peak of every active lease as OOM evidence for the wrapper, whose own sampling
        misses short jobs. Reads may degrade to unknown; the first round runs at once,
        so status shows memory from the start."""
        while True:
            for lease_id in [k for k in self.lease_peaks if k not in self.sched.leases]:
                del self.lease_peaks[lease_id]  # ended some other way than _release
            for gpu in list(self.sched.gpus.values()):
                if gpu.mode is GpuMode.OFF or gpu.index not in self.workers:
                    continue
                try:
                    await self._sample_gpu(gpu)
                except (MigdError, TimeoutError):
                    gpu.used_mib = None
                except Exception as exc:  # sampling must outlive any surprise
                    log.exception("sampler.crashed", gpu=gpu.index, error=str(exc))
            await asyncio.sleep(1.0)

    async def _sample_gpu(self, gpu: ManagedGpu) -> None:
        """One GPU's memory, its instances', and its leases' peaks: an instance's lease
        uses the instance, an exclusive lease the GPU, an MPS share the memory of its
        holder's processes on the share's device."""
        index = gpu.index
        memory = await self.on_gpu(index, self.backend.memory, index, timeout_s=10.0)
        gpu.used_mib = memory.used_mib
        if gpu.exclusive_lease is not None:
            self._note_peak(gpu.exclusive_lease, memory.used_mib)
        for inst in gpu.instances:
            if inst.uuid and inst.status is InstanceStatus.READY:
                mem = await self.on_gpu(
                    index, self.backend.memory, index, inst.uuid, timeout_s=10.0
                )
                inst.used_mib = mem.used_mib
                if inst.lease_id is not None and inst.mps_pool is None:
                    self._note_peak(inst.lease_id, mem.used_mib)
        shares: dict[str | None, list[Lease]] = {}
        for lease in self.sched.active_leases():
            if lease.gpu == index and lease.mode == "mps":
                shares.setdefault(lease.mig_uuid, []).append(lease)
        for device, leases in shares.items():
            procs = await self.on_gpu(index, self.backend.processes, index, device, timeout_s=10.0)
            for lease in leases:
                mine = await self.on_gpu(index, self._mps_usage, lease, procs, timeout_s=10.0)
                self._note_peak(lease.lease_id, _known_sum(mine))

    def _note_peak(self, lease_id: str, used_mib: int | None) -> None:
        lease = self.sched.leases.get(lease_id)
        if used_mib is None or lease is None or lease.state is not LeaseState.ACTIVE:
            return
        if used_mib > self.lease_peaks.get(lease_id, -1):
            self.lease_peaks[lease_id] = used_mib

    async def _watchdog_loop(self) -> None:
        """Feed systemd's watchdog only while every GPU thread is sound.

        Every GPU thread must answer a heartbeat within half the watchdog interval,
        except while NVML work (a create or destroy) younger than
        ``daemon.work_timeout_s`` runs on some GPU: a heartbeat queued behind a slow but
        legitimate creation, in that GPU's thread or behind the driver's lock that
        serialises MIG changes across GPUs, must not get migd killed. A call that hangs
        stops the pings either way: a short call (memory sampling, the reaper) at once,
        a create or destroy when ``work_timeout_s`` ends it (migd then records the
        failure and marks the GPU, see ``_run_work``). systemd restarts migd one
        ``WatchdogSec`` after the last ping; leases survive in the state db.
        """
        interval = self.notifier.watchdog_s or 20.0
        tick, stale_after = interval / 4, interval / 2
        if self.notifier.watchdog_s:
            log.info(
                "watchdog.enabled",
                watchdog_s=interval,
                ping_every_s=tick,
                heartbeat_stale_after_s=stale_after,
                work_timeout_s=self.config.daemon.work_timeout_s,
            )
        loop = asyncio.get_running_loop()
        while True:
            for index, worker in self.workers.items():
                if worker.heartbeat_pending:
                    continue
                worker.heartbeat_pending = True

                def beat(i: int = index) -> None:
                    self.backend.heartbeat(i)

                def done(fut: Any, w: GpuWorker = worker) -> None:
                    w.heartbeat_pending = False
                    if not fut.cancelled() and not fut.exception():
                        w.last_ok_mono = self.clock.monotonic()

                loop.run_in_executor(worker.executor, beat).add_done_callback(done)
            await asyncio.sleep(tick)
            stale = self.starved_gpus(stale_after)
            if stale or self._watchdog_tripped:
                log.error(
                    "watchdog.starved",
                    gpus=stale,
                    reason=self._watchdog_tripped or "GPU thread did not answer",
                    hint="an NVML call hangs; systemd restarts migd when WatchdogSec passes",
                )
                continue
            self.notifier.watchdog()

    def starved_gpus(self, stale_after: float) -> list[int]:
        """GPUs whose thread has not answered a heartbeat for ``stale_after`` seconds,
        unless NVML work younger than ``daemon.work_timeout_s`` runs (see above)."""
        now = self.clock.monotonic()
        limit = self.config.daemon.work_timeout_s
        if any(
            w.busy_since_mono is not None and now - w.busy_since_mono < limit
            for w in self.workers.values()
        ):
            return []
        return [
            i
            for i, w in self.workers.items()
            if now - w.last_ok_mono > stale_after and self.sched.gpus[i].mode is not GpuMode.OFF
        ]

    # -- reload and shutdown ----------------------------------------------------------------

    async def reload(self) -> dict[str, Any]:
        if self.reload_config is None:
            return {"reloaded": False, "reason": "no config source"}
        self.notifier.reloading()
        try:
            new = self.reload_config()
            access = socket_access(new.api)  # an unknown socket group fails the reload
        except ConfigError as exc:
            log.error("config.reload_failed", error=exc.message, hint="kept the old configuration")
            self.notifier.ready("reload failed; old configuration kept")
            return {"reloaded": False, "error": exc.to_dict()}
        needs_restart = changed_restart_keys(self.config, new)
        self.config = new.model_copy(
            update={
                "daemon": new.daemon.model_copy(
                    update={
                        "state_dir": self.config.daemon.state_dir,
                        "runtime_dir": self.config.daemon.runtime_dir,
                    }
                ),
                "backend": self.config.backend,
                "api": new.api.model_copy(update={"socket": self.config.api.socket}),
                "gpu": self.config.gpu,
                "policy": new.policy.model_copy(update={"profiles": self.config.policy.profiles}),
            }
        )
        self.auth = Authorizer(self.config.api)
        if self._server is not None:
            try:
                self._apply_socket_access(access)
            except OSError as exc:
                log.error(
                    "api.socket_access_failed", socket=str(self.config.api.socket), error=str(exc)
                )
        self.sched.set_policy(scheduler_policy(self.config))
        try:
            self._apply_demand_prior()
        except ConfigError as exc:
            log.error("config.reload_partial", error=exc.message)
        from migd.daemon.logs import configure_logging

        configure_logging(self.config.daemon.log_format, self.config.daemon.log_level)
        log.info("config.reloaded", needs_restart=needs_restart)
        self.record("reload", None, needs_restart=needs_restart)
        now, mono = self.now()
        self._after_change(self.sched.schedule(now, mono))
        self.notifier.ready("configuration reloaded")
        return {"reloaded": True, "needs_restart": needs_restart}

    async def run(self) -> int:
        try:
            await self.start()
        except MigdError as exc:
            log.error("daemon.start_failed", error=exc.code, message=exc.message, hint=exc.hint)
            await self.close()
            return 1
        await self.stopping.wait()
        await self.shutdown()
        return 0

    async def shutdown(self) -> None:
        """SIGTERM: stop taking requests, finish NVML work, keep every active lease."""
        self.notifier.stopping()
        log.info("daemon.stopping", active_leases=len(self.sched.active_leases()))
        if self._server is not None:
            self._server.close()
        now, mono = self.now()
        for lease_id, waiter in list(self.waiters.items()):
            lease = self.sched.leases.get(lease_id)
            if lease is not None and not lease.state.terminal:
                self.sched.release(lease_id, now, mono, reason="migd stopped while waiting")
                self.save(lease)
                self.record("cancelled", lease, reason=lease.reason)
            if not waiter.future.done():
                waiter.future.set_exception(
                    DaemonUnavailable("migd is stopping", hint="the wrapper retries after restart")
                )
        deadline = time.monotonic() + self.config.daemon.shutdown_grace_s
        while time.monotonic() < deadline and any(
            w.busy_since_mono is not None or not w.queue.empty() for w in self.workers.values()
        ):
            await asyncio.sleep(0.05)
        if self.mps is not None:
            with contextlib.suppress(Exception):
                self.mps.shutdown(
                    keep={
                        x.mps_device_uuid for x in self.sched.active_leases() if x.mps_device_uuid
                    }
                )
        for lease in self.sched.active_leases():
            self.save(lease)
        self.db.set_meta("demand", {"counts": self.sched.demand.snapshot(), "last_s": now})
        await self.close()
        log.info("daemon.stopped")

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                self.config.api.socket.unlink()
        for worker in self.workers.values():
            worker.executor.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):
            self.backend.close()
        if self.store is not None:
            self.store.close()


def _known_sum(procs: list[GpuProcess]) -> int | None:
    """Memory of these processes, or None when NVML could not say for any of them."""
    known = [p.used_mib for p in procs if p.used_mib is not None]
    return sum(known) if known else None


def _latency_class(op: str, result: Any) -> str:
    """The latency series a reply counts in: leases that waited for capacity or for NVML
    to make their partition are kept apart from those granted at once."""
    if op == "lease" and isinstance(result, dict):
        if result.get("queued"):
            return "lease.queued"
        if result.get("prepared"):
            return "lease.prepared"
    return op


def socket_access(api: ApiSection) -> tuple[int, int]:
    """The socket file's mode and group for an ``[api]`` section.

    ``0666`` when status is public or any user may lease (SO_PEERCRED decides who may
    do what); else ``0660``, group ``api.socket_group`` (migd's own group if unset).

    Raises:
        ConfigError: ``api.socket_group`` names no group on this host.
    """
    gid = os.getegid()
    if api.socket_group is not None:
        name = api.socket_group
        try:
            gid = int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
        except KeyError:
            raise ConfigError(
                f"no group {name!r} on this host",
                where="api.socket_group",
                hint="name an existing group (getent group) or a numeric gid",
            ) from None
    public = api.status_public or "*" in api.lease_users or "*" in api.lease_groups
    return (0o666 if public else 0o660), gid


def check_socket_path(path: Path) -> None:
    """Refuse a socket location another user could hijack.

    Every directory from ``/`` down to the socket's must be a real directory (no
    symlinked component: give the real path, e.g. ``/run``, not ``/var/run``) owned by
    root or by migd's user. The socket's own directory must not be writable by group
    or others at all; a directory above it may be, only if it is root's and sticky
    (``/tmp``: nobody can rename or replace what others put there). An existing socket
    must be stale (no daemon answers).

    Raises:
        ConfigError: the path is unsafe or another migd is running there.
    """
    where = "api.socket"
    path = Path(os.path.normpath(path.absolute()))  # not resolve(): symlinks must be seen
    parent = path.parent
    if not parent.exists():
        parent.mkdir(mode=0o755, parents=True)
    ours = (0, os.geteuid())
    for directory in (parent, *parent.parents):
        st = directory.lstat()
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError(
                f"{directory} is a symlink; refusing to put the socket under it",
                where=where,
                hint=f"give the real path ({directory} -> {os.path.realpath(directory)})",
            )
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{directory} is not a directory", where=where)
        if st.st_uid not in ours:
            raise ConfigError(
                f"{directory} belongs to uid {st.st_uid}, who could replace the socket",
                where=where,
                hint="use a directory owned by root, such as /run/migd",
            )
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        sticky_root = st.st_mode & stat.S_ISVTX and st.st_uid == 0
        if writable and (directory == parent or not sticky_root):
            who = "world" if st.st_mode & stat.S_IWOTH else "group"
            raise ConfigError(
                f"{directory} is {who}-writable; another user could replace the socket",
                where=where,
                hint="use a private directory such as /run/migd (the systemd unit creates it)",
            )
    if path.is_symlink():
        raise ConfigError(f"{path} is a symlink; refusing to use it", where=where)
    if path.exists():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(f"{path} exists and is not a socket", where=where)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale socket of a dead daemon
        else:
            raise ConfigError(
                f"another migd is already serving {path}",
                where=where,
                hint="stop it first (systemctl stop migd)",
            )
        finally:
            probe.close()
