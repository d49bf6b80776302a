"""The migd daemon: builds its parts, starts them in order, reloads and stops them.

Start-up order (systemd ``Type=notify``): load config, open the state db, discover
GPUs, reconcile (adopt instances, reload leases, reclaim dead ones), bind the socket,
then ``READY=1``. Decisions come from :class:`migd.core.scheduler.NodeScheduler`; the
parts add the I/O (see docs/architecture.md):

* :mod:`migd.daemon.api.server` (socket, admission, op table) with the handlers of
  :mod:`migd.daemon.api.ops` (and :mod:`migd.daemon.api.sim_ops` on simulated GPUs);
* :mod:`migd.daemon.leases.service`: persistence, history, waiting clients;
* :mod:`migd.daemon.leases.executor`: one worker thread and work queue per GPU;
* :mod:`migd.daemon.leases.work`: each GPU's loop running the scheduler's work items;
* :mod:`migd.daemon.leases.reconciler`: start-up reconcile, GPU resync, lease restore;
* :mod:`migd.daemon.supervision.mps`: the MPS control daemons;
* :mod:`migd.daemon.supervision.periodic`: reaper, timers, sampler, watchdog.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Callable
from typing import Any

import structlog
from pydantic import BaseModel

from migd import __version__
from migd.core.hybrid import HybridPolicy, ShareRule
from migd.core.planner import PlacementRule, PlannerPolicy
from migd.core.policy import SchedulerPolicy
from migd.core.scheduler import NodeScheduler
from migd.daemon.api.auth import Authorizer
from migd.daemon.api.ops import Ops
from migd.daemon.api.server import SIM_ONLY_OPS, ApiServer, not_simulated, socket_access
from migd.daemon.config import RESTART_KEYS, MigdConfig, changed_restart_keys, removals
from migd.daemon.context import DaemonContext
from migd.daemon.exit_codes import exit_status
from migd.daemon.leases.executor import GpuExecutor
from migd.daemon.leases.leftovers import LeftoverChecks
from migd.daemon.leases.reconciler import Reconciler
from migd.daemon.leases.service import LeaseService
from migd.daemon.leases.submit import LeaseSubmitter
from migd.daemon.leases.work import WorkRunner
from migd.daemon.metrics.service import MetricsService
from migd.daemon.store.state import StateStore
from migd.daemon.supervision.gpu_health import GpuHealthMonitor
from migd.daemon.supervision.mps import MpsSupervisor, ShareRelease
from migd.daemon.supervision.periodic import PeriodicTasks, Reaper
from migd.daemon.supervision.startd_check import run_check
from migd.daemon.systemd import Notifier
from migd.errors import ConfigError, DaemonUnavailable, MigdError
from migd.paths import InstanceLock, ensure_dir
from migd.ports import (
    Accounts,
    CgroupMemoryLimits,
    Clock,
    GpuBackend,
    GpuEvents,
    MpsControl,
    ProcessTable,
    StartdConfig,
    StartdControl,
    SystemClock,
)

log = structlog.get_logger("migd")

#: How long a cancelled periodic loop may take to stop at shutdown (each of two tries).
TASK_STOP_S = 2.0


def scheduler_policy(config: MigdConfig) -> SchedulerPolicy:
    p = config.policy
    return SchedulerPolicy(
        planner=PlannerPolicy(
            placement=p.placement,
            gpu_choice=p.gpu_choice,
            fission_fusion=p.fission_fusion,
        ),
        queue=p.queue,
        aging_s=p.aging_s,
        starvation_s=p.starvation_s,
        backfill=p.backfill,
        idle_policy=p.idle_policy,
        idle_timeout_s=p.idle_timeout_s,
        demand_weighting=p.demand_weighting or p.placement is PlacementRule.WEIGHTED,
        demand_prior={},
        demand_half_life_s=p.demand_half_life_s,
        mps_reserve_mib=config.mps.reserve_mib,
        mps_max_clients=config.mps.max_clients,
        mps_multi_user=config.mps.multi_user,
        hybrid=_hybrid_policy(config),
    )


def _hybrid_policy(config: MigdConfig) -> HybridPolicy | None:
    """The hybrid policy when a GPU asks for it (its ``share`` rule; the first one wins)."""
    for override in config.gpu:
        if override.mode == "hybrid":
            return HybridPolicy(rule=ShareRule(override.share), reserve_mib=config.mps.reserve_mib)
    return None


def lock_instance(config: MigdConfig) -> InstanceLock:
    """Create (checked, never through a symlink: paths.py) and lock the state and the
    runtime directory: the first thing a daemon does, before it opens the state db, binds
    its socket or writes anything there.

    Raises:
        AlreadyRunning: another migd holds either directory.
        ConfigError: a directory that is unsafe or cannot be created.
    """
    state_dir, runtime_dir = config.daemon.state_dir, config.daemon.runtime_dir
    ensure_dir(state_dir.parent, state_dir.name, 0o700, where="daemon.state_dir")
    ensure_dir(runtime_dir.parent, runtime_dir.name, 0o755, where="daemon.runtime_dir")
    return InstanceLock.acquire(
        [(state_dir, "daemon.state_dir"), (runtime_dir, "daemon.runtime_dir")]
    )


def keep_restart_keys(old: MigdConfig, new: MigdConfig) -> MigdConfig:
    """``new`` with the value of every key in ``RESTART_KEYS`` taken from ``old``: what a
    reload applies (``changed_restart_keys`` reports those it could not)."""

    def keep(into: BaseModel, source: BaseModel, path: list[str]) -> BaseModel:
        head, *rest = path
        value = getattr(source, head)
        if rest:
            value = keep(getattr(into, head), value, rest)
        return into.model_copy(update={head: value})

    merged: BaseModel = new
    for dotted in RESTART_KEYS:
        merged = keep(merged, old, dotted.split("."))
    assert isinstance(merged, MigdConfig)
    return merged


class Daemon:
    """One migd process. Construct with real or simulated ports, then ``await run()``."""

    def __init__(
        self,
        config: MigdConfig,
        backend: GpuBackend,
        procs: ProcessTable,
        *,
        accounts: Accounts,
        clock: Clock | None = None,
        notifier: Notifier | None = None,
        reload_config: Callable[[], MigdConfig] | None = None,
        events: GpuEvents | None = None,
        mps: MpsControl | None = None,
        cgroup_limits: CgroupMemoryLimits | None = None,
        startd: StartdControl | None = None,
        lock: InstanceLock | None = None,
        startd_config: StartdConfig | None = None,
    ) -> None:
        clock = clock or SystemClock()
        #: Held from :meth:`open` (or given, taken earlier by ``main``) until :meth:`close`.
        self.lock = lock
        self.accounts = accounts
        self.metrics = MetricsService(config)  # docs/operations.md, Monitoring
        self.ctx = ctx = DaemonContext(
            config=config,
            backend=self.metrics.wrap_backend(backend),
            procs=procs,
            clock=clock,
            notifier=notifier or Notifier(),
            auth=Authorizer(config.api, self.accounts),
            mps=mps,
            cgroup_limits=cgroup_limits,
            started_s=clock.now(),
        )
        self.reload_config = reload_config
        #: The startd's configuration, checked at start and on reload (startd_check.py).
        self.startd_config = startd_config
        self.stopping = asyncio.Event()
        # Built one way: each part gets what it calls when it is made, nothing is patched
        # in afterwards (the executor knows no leases; the work runner comes last).
        self.executor = GpuExecutor(ctx)
        self.leases = LeaseService(ctx, self.executor.dispatch, ShareRelease(ctx, self.executor))
        self.leases.add_observer(self.metrics)
        self.leases.event_observers.append(self.metrics)
        self.mps = MpsSupervisor(ctx, self.executor, self.leases)
        self.reaper = Reaper(ctx, self.executor, self.leases)
        self.leases.add_observer(self.reaper)  # a grant starts the heartbeat clock
        self.reconciler = Reconciler(ctx, self.executor, self.leases, self.mps, self.reaper.reap)
        self.work = WorkRunner(
            ctx,
            self.executor,
            self.leases,
            resync=self.reconciler.resync_gpu,
            before_destroy=self.mps.stop_before_destroy,
        )
        # MIG instances whose lease ended, checked for processes before their next use.
        self.leftovers = LeftoverChecks(ctx, self.executor, self.leases)
        self.periodic = PeriodicTasks(
            ctx,
            self.executor,
            self.leases,
            self.reaper,
            self.reconciler,
            self.mps,
            self.leftovers,
            startd,
        )
        self.api = ApiServer(ctx, self.leases.lease_for, self.stopping)
        self.submitter = LeaseSubmitter(ctx, self.executor, self.leases, self.mps, self.leftovers)
        Ops(
            ctx,
            self.leases,
            self.executor,
            self.mps,
            self.submitter,
            self.leftovers,
            self.reload,
        ).register(self.api)
        # NVML events (XIDs) -> GPU health (docs/operations.md, GPU health).
        self.health = GpuHealthMonitor(ctx, self.leases, self.metrics, events)
        self.leases.event_observers.append(self.health)
        # Answered "not simulated" unless main() registers the simulator's ops over them.
        self.api.missing.update(dict.fromkeys(SIM_ONLY_OPS, not_simulated))
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def config(self) -> MigdConfig:
        return self.ctx.config

    # -- start-up ---------------------------------------------------------------------------

    def open(self) -> None:
        """Open the state db, discover and manage the GPUs, build the scheduler and the
        GPU threads: everything but reconciling, the socket and the loops (tests drive
        the parts from here with a manual clock)."""
        ctx = self.ctx
        cfg = ctx.config
        if self.lock is None:
            self.lock = lock_instance(cfg)
        ctx.store = store = StateStore(cfg.daemon.state_dir / "migd.db")
        store.checkpoint_in_background()
        if store.recovered_from is not None:
            log.error(
                "state_db.corrupt",
                moved_to=str(store.recovered_from),
                error=store.corruption,
                hint="started with an empty state db; instances are re-adopted from the GPUs",
            )
            ctx.notes.append(f"state db was unreadable; moved to {store.recovered_from}")
        ctx.gpus = ctx.backend.discover()
        managed = [self.reconciler.manage(info) for info in ctx.gpus]
        ctx.scheduler = NodeScheduler(managed, scheduler_policy(cfg), mps_env=self.mps.env)
        self.reconciler.apply_demand_prior()
        draining = set(store.get_meta("draining", []))
        for gpu in managed:
            if gpu.uuid in draining:
                gpu.draining = True
        self.executor.add_gpus(managed)

    async def start(self) -> None:
        ctx = self.ctx
        cfg = ctx.config
        self.open()
        # The requests served in one turn of the loop share one SQLite commit, made at
        # the turn's end (StateDatabase.defer_commits; replies wait for it).
        ctx.db.defer_commits(asyncio.get_running_loop().call_soon)
        managed = list(ctx.sched.gpus.values())
        await self.mps.start()
        await self.reconciler.reconcile()
        await self.mps.reattach()
        await self.api.bind()
        await self.metrics.start(
            ctx,
            mps_status=ctx.mps.cached_status_for if ctx.mps is not None else None,
            daemon_problem=lambda: self.executor.tripped,
        )
        await self.health.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        for index in self.executor.workers:
            self._tasks.append(asyncio.create_task(self.work.gpu_loop(index), name=f"gpu{index}"))
        self._tasks += self.periodic.start()
        self.check_startd()
        summary = ", ".join(f"{g.index}:{g.model}/{g.mode.value}" for g in managed) or "no GPUs"
        log.info(
            "daemon.ready",
            version=__version__,
            socket=str(cfg.api.socket),
            backend=cfg.backend.kind,
            gpus=summary,
            leases=len(ctx.sched.active_leases()),
        )
        # The precomputed state spaces are large and live for the whole run; moving them out
        # of the collector's view keeps full collections from pausing requests for ~15 ms.
        gc.collect()
        gc.freeze()
        ctx.notifier.ready(f"serving {len(managed)} GPU(s): {summary}")

    def check_startd(self) -> asyncio.Task[None]:
        """Check the startd's configuration in the background (HTCondor's tool may be
        slow; nothing waits for it): status shows the answer when it comes."""
        ctx = self.ctx

        async def check() -> None:
            ctx.startd_report = await run_check(
                self.startd_config, ctx.config.htcondor, ctx.clock.now()
            )

        task = asyncio.create_task(check(), name="startd-check")
        # Earlier checks that finished are dropped: a reload each minute must not grow it.
        self._tasks = [
            t for t in self._tasks if not (t.done() and t.get_name() == "startd-check")
        ] + [task]
        return task

    # -- reload and shutdown ----------------------------------------------------------------

    async def reload(self, *, allow_removals: bool = False) -> dict[str, Any]:
        """Apply the configuration source again: all of it, or none of it.

        Refused, with the old configuration kept whole: a file that does not load
        (:func:`~migd.daemon.config.read_toml`: unreadable, not UTF-8, not TOML, empty),
        an unknown group or demand-prior profile, and, unless ``allow_removals``
        (``migctl reload --allow-removals``), a change that takes rights or GPUs away
        without naming them (:func:`~migd.daemon.config.removals`).
        """
        ctx = self.ctx
        if self.reload_config is None:
            return {"reloaded": False, "reason": "no config source"}
        ctx.notifier.reloading()
        old = ctx.config
        try:
            new = self.reload_config()
            taken = [] if allow_removals else removals(old, new)
            if taken:
                raise ConfigError(
                    "refused, it would take away what it does not name: " + "; ".join(taken),
                    hint="set the keys explicitly in the file, or apply it as it is with "
                    "`migctl reload --allow-removals`",
                )
            # Users and groups may have changed with the configuration: forget the cached
            # answers before the new socket group and access rules are looked up.
            self.accounts.forget()
            access = socket_access(new.api, self.accounts)  # an unknown group fails the reload
            ctx.config = keep_restart_keys(old, new)
            self.reconciler.apply_demand_prior()  # checks every name before it changes any
        except Exception as exc:
            ctx.config = old  # nothing of the new configuration is applied
            if isinstance(exc, ConfigError):
                error = exc
                log.error(
                    "config.reload_failed", error=exc.message, hint="kept the old configuration"
                )
            else:  # a bug must not leave half a configuration, nor kill the signal's task
                error = ConfigError(f"reload failed: {exc!r}")
                log.exception("config.reload_failed", error=repr(exc), hint="kept the old one")
            ctx.notifier.ready("reload failed; old configuration kept")
            return {"reloaded": False, "error": error.to_dict()}
        needs_restart = changed_restart_keys(old, new)
        ctx.auth = Authorizer(ctx.config.api, self.accounts)
        if self.api.bound:
            try:
                self.api.apply_socket_access(access)
            except OSError as exc:
                log.error(
                    "api.socket_access_failed", socket=str(ctx.config.api.socket), error=str(exc)
                )
        ctx.sched.set_policy(scheduler_policy(ctx.config))
        from migd.daemon.logs import configure_logging

        configure_logging(ctx.config.daemon.log_format, ctx.config.daemon.log_level)
        log.info("config.reloaded", needs_restart=needs_restart)
        self.check_startd()  # a reload often follows a change to HTCondor's files too
        self.leases.record("reload", None, needs_restart=needs_restart)
        now, mono = ctx.now()
        # The policy (queue order, placement) changed: place what fits under it.
        self.leases.apply(ctx.sched.schedule(now, mono))
        ctx.notifier.ready("configuration reloaded")
        return {"reloaded": True, "needs_restart": needs_restart}

    async def run(self) -> int:
        try:
            await self.start()
        except MigdError as exc:
            log.error("daemon.start_failed", error=exc.code, message=exc.message, hint=exc.hint)
            await self.close()
            return exit_status(exc)  # systemd reads it: docs/operations.md, Exit statuses
        await self.stopping.wait()
        await self.shutdown()
        return 0

    async def shutdown(self) -> None:
        """SIGTERM: stop taking requests, finish NVML work, keep every active lease."""
        ctx = self.ctx
        ctx.notifier.stopping()
        log.info("daemon.stopping", active_leases=len(ctx.sched.active_leases()))
        self.api.stop_accepting()
        now, _ = ctx.now()
        self.leases.fail_waiters(
            DaemonUnavailable("migd is stopping", hint="the wrapper retries after restart"),
            reason="migd stopped while waiting",
        )
        deadline = ctx.clock.monotonic() + ctx.config.daemon.shutdown_grace_s
        while ctx.clock.monotonic() < deadline and self.executor.busy():
            await asyncio.sleep(0.05)
        self.mps.shutdown()
        for lease in ctx.sched.active_leases():
            self.leases.save(lease)
        ctx.db.set_meta("demand", {"counts": ctx.sched.demand.snapshot(), "last_s": now})
        await self.close()
        log.info("daemon.stopped")

    async def _stop_tasks(self) -> None:
        """Cancel the loops and wait for them, but never for ever: a loop that lost its
        cancellation (a library swallowing it) is cancelled once more, then left behind
        with a warning, and the shutdown goes on (systemd would SIGKILL a hung stop)."""
        pending = {task for task in self._tasks if not task.done()}
        for round_ in range(2):
            if not pending:
                break
            if round_:
                log.warning("daemon.task_recancelled", tasks=sorted(t.get_name() for t in pending))
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=TASK_STOP_S)
        for task in pending:
            log.warning(
                "daemon.task_stuck",
                task=task.get_name(),
                hint="a periodic loop did not stop when cancelled; report it",
            )
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.error("daemon.task_failed", task=task.get_name(), error=str(task.exception()))

    async def close(self) -> None:
        await self.metrics.close()
        self.health.stop()
        await self._stop_tasks()
        await self.api.close()
        self.executor.close()
        with contextlib.suppress(Exception):
            self.ctx.backend.close()
        if self.ctx.store is not None:
            self.ctx.store.close()
        if self.lock is not None:  # last: nothing of ours is open any more
            self.lock.release()
