"""A deterministic stepper for the daemon's concurrent parts (see test_interleavings.py).

The real daemon classes (``Daemon`` with its ``GpuExecutor``, ``LeaseService``,
``Reconciler``, ``Reaper``, ``Timers``, ``GpuHealthMonitor``, ``Ops``) run on the
simulated node with a manual clock and one asyncio loop; only two things are replaced:

* each GPU's worker thread is a :class:`SteppedExecutor`: a call waits in its GPU's FIFO
  until the test runs it, so what runs "in the GPU thread" and what the event loop does
  in between is chosen by the test, one step at a time;
* the loop is run until nothing is ready (:meth:`World.settle`) after every step, so
  every coroutine is parked on an executor call, a queue, or done: the state the
  invariants see is one the daemon can be in.

A :class:`World` picks its next step from a seeded ``random.Random``: run the next NVML
call of a GPU, a job asks for a lease, starts on its instance, exits and releases it,
leaves an orphan behind or dies with its wrapper, a reaper round, a timer round (idle
teardown), a sampler round (which also checks idle instances whose lease ended for
processes), an XID on an instance, an admin reset, or a kill -9 and restart of migd
(rebuilt from the state db and the simulated GPU). A granted lease is handed to its job
as the daemon's submitter does it: after the hand-out check
(:meth:`~migd.daemon.leases.leftovers.LeftoverChecks.check_handout`), whose NVML call
waits in the GPU's FIFO like any other. :meth:`World.check` asserts the invariants after
every step and raises :class:`Violation` with the step log.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import structlog

from migd.backends.accounts import SystemAccounts
from migd.backends.simulated import simulated_backend
from migd.backends.simulated.node import SimNode
from migd.core.gpus import GpuMode, InstanceStatus
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.daemon.api.ops import Ops
from migd.daemon.config import validate_config
from migd.daemon.service import Daemon
from migd.daemon.systemd import Notifier
from migd.errors import MigdError
from migd.ports import GpuEvent, ManualClock


class Violation(AssertionError):
    """An invariant broke; the message names it, the seed and the steps that led there."""


class SteppedExecutor(concurrent.futures.Executor):
    """A GPU 'thread' that runs one queued call when the test says so, in FIFO order
    (the real one is a single-thread pool: calls of one GPU never overlap)."""

    def __init__(self) -> None:
        self.pending: deque[
            tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future[Any]]
        ] = deque()

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        name = getattr(fn, "__name__", type(fn).__name__)
        self.pending.append((lambda: fn(*args, **kwargs), (name,), fut))
        return fut

    def call(self, fn: Callable[..., Any], /, *args: Any) -> asyncio.Future[Any]:
        return asyncio.wrap_future(self.submit(fn, *args))

    def run_next(self) -> str:
        call, (name,), fut = self.pending.popleft()
        if not fut.set_running_or_notify_cancel():
            return f"{name} (cancelled)"
        try:
            fut.set_result(call())
        except BaseException as exc:  # the GPU thread hands every error to its caller
            fut.set_exception(exc)
        return name

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        while self.pending:
            _, _, fut = self.pending.popleft()
            fut.cancel()


class HostProcs:
    """The host's process table: a holder (wrapper) lives until the test kills it."""

    def __init__(self) -> None:
        self.dead: set[int] = set()

    def alive(self, pid: int, start_time: float | None = None) -> bool:
        return pid not in self.dead

    def start_time(self, pid: int) -> float | None:
        return 1.0

    def uid(self, pid: int) -> int | None:
        return 1000

    def parent(self, pid: int) -> int | None:
        return None


@dataclass
class Job:
    """One job: its wrapper (lease holder) and, once started, its CUDA process."""

    lease_id: str
    holder: int
    pid: int
    mig_uuid: str | None = None  # where its process runs (set when it starts)
    # waiting (for its grant), handing (the hand-out check runs), handed, running,
    # exiting, leaving (released while a child keeps its process), orphaned, done
    state: str = "waiting"


class DisappearedWatch:
    """Lease observer: a lease reclaimed because its instance "disappeared" while that
    instance is still on the GPU was judged from a stale read (the issue's race)."""

    def __init__(self, world: World) -> None:
        self.world = world

    def on_transition(
        self, lease: Lease, old: LeaseState | None, new: LeaseState, now: float
    ) -> None:
        if new is not LeaseState.RECLAIMED or "disappeared" not in lease.reason:
            return
        if lease.gpu is None or lease.mig_uuid is None:
            return
        if lease.mig_uuid in self.world.gpu_uuids(lease.gpu):
            self.world.broken.append(
                f"lease {lease.lease_id} reclaimed ({lease.reason}) but its instance "
                f"{lease.mig_uuid} is on the GPU"
            )


#: Step kinds and their weights (GPU calls are weighted per GPU with pending calls).
WEIGHTS = {
    "gpu": 30,
    "submit": 8,
    "start_job": 10,
    "job_exit": 5,
    "orphan": 2,
    "orphan_exit": 3,
    "holder_crash": 2,
    "reaper": 10,
    "timers": 3,
    "xid": 1,
    "xid_clear": 3,
    "reset": 1,
    "restart": 1,
    "submit_group": 6,
    "sample": 4,
    "leave": 2,
}

#: Job states in which the job knows its lease: a process of another job on the lease's
#: instance then breaks the hand-out invariant. Before the hand-out check has passed,
#: the grant is the daemon's alone (the check may still release it and place the
#: request again).
HANDED = ("handed", "running", "exiting", "leaving", "orphaned")


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """Thousands of interleavings log millions of lines: keep only errors meanwhile."""
    old = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    try:
        yield
    finally:
        structlog.configure(**old)


@dataclass
class World:
    """One seeded run over one simulated node (see the module docstring)."""

    seed: int
    tmp: Path
    description: str = "1xA100-40GB"
    rng: random.Random = field(init=False)
    clock: ManualClock = field(default_factory=ManualClock)
    procs: HostProcs = field(default_factory=HostProcs)
    node: SimNode = field(init=False)
    daemon: Daemon = field(init=False)
    loop: asyncio.AbstractEventLoop = field(init=False)
    jobs: dict[str, Job] = field(default_factory=dict)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    executors: dict[int, SteppedExecutor] = field(default_factory=dict)
    # Jobs on several GPUs (lease groups): off unless a test asks (the seeds of the
    # one-GPU runs keep their sequences); each group's member lease ids.
    group_size: int = 0
    groups: list[list[str]] = field(default_factory=list)
    _n: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        _, self.node = simulated_backend(self.description, host_processes=self.procs)
        self.loop = asyncio.new_event_loop()
        self._start_daemon()

    # -- the daemon -------------------------------------------------------------------------

    def _config(self) -> Any:
        return validate_config(
            {
                "daemon": {
                    "state_dir": str(self.tmp / "state"),
                    "runtime_dir": str(self.tmp / "run"),
                    "work_timeout_s": 3600,
                },
                "backend": {"kind": "simulated"},
                "api": {"socket": str(self.tmp / "migd.sock")},
                "policy": {"idle_policy": "timeout", "idle_timeout_s": 5},
                "reaper": {"heartbeat_timeout_s": 0},
            }
        )

    def _start_daemon(self) -> None:
        backend, _ = simulated_backend(self.node)
        notifier = Notifier(environ={})
        daemon = Daemon(
            self._config(),
            backend,
            self.procs,
            accounts=SystemAccounts(),
            clock=self.clock,
            notifier=notifier,
        )
        daemon.open()
        for index, worker in daemon.executor.workers.items():
            worker.executor.shutdown(wait=False)
            stepped = SteppedExecutor()
            worker.executor = stepped
            self.executors[index] = stepped
        daemon.leases.add_observer(DisappearedWatch(self))
        self.daemon = daemon
        self.ops = Ops(
            daemon.ctx,
            daemon.leases,
            daemon.executor,
            daemon.mps,
            daemon.submitter,
            daemon.leftovers,
            daemon.reload,
        )
        # Start-up runs alone (the socket is bound after it): reconcile, FIFO per GPU.
        self._run_alone(self._startup())
        for index in daemon.executor.workers:
            self.tasks.append(self.loop.create_task(daemon.work.gpu_loop(index)))

    async def _startup(self) -> None:
        d = self.daemon
        await d.mps.start()
        await d.reconciler.reconcile()
        await d.mps.reattach()

    def _run_alone(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self.settle()
        while not task.done():
            ran = False
            for stepped in self.executors.values():
                if stepped.pending:
                    stepped.run_next()
                    ran = True
                    break
            assert ran, "start-up waits for nothing the test can run"
            self.settle()
        task.result()

    def kill_and_restart(self) -> None:
        """kill -9: the loops and queued NVML calls vanish; the GPU and the db stay."""
        for task in self.tasks:
            task.cancel()
        for stepped in self.executors.values():
            stepped.shutdown(cancel_futures=True)
        self.settle()
        self.tasks = []
        self.executors = {}
        assert self.daemon.ctx.store is not None
        self.daemon.ctx.store.close()
        # the kernel drops a dead process's flock on the state and runtime directories
        if self.daemon.lock is not None:
            self.daemon.lock.release()
        self._start_daemon()
        self.settle_all()
        self.check_restart()
        for job in self.jobs.values():
            if job.state in ("waiting", "handing"):  # its request died with the daemon
                job.state = "done"
                self.procs.dead.add(job.holder)
            elif job.state in ("exiting", "leaving"):  # the wrapper asks again after it
                self.tasks.append(self.loop.create_task(self._release(job)))

    def close(self) -> None:
        try:
            for task in self.tasks:
                task.cancel()
            for stepped in self.executors.values():
                stepped.shutdown(cancel_futures=True)
            self.settle()
        finally:  # a failed run still closes its loop, database and lock
            self.loop.close()
            if self.daemon.ctx.store is not None:
                self.daemon.ctx.store.close()
            if self.daemon.lock is not None:
                self.daemon.lock.release()

    # -- running the loop -------------------------------------------------------------------

    def settle(self) -> None:
        """Run the event loop until nothing is ready: every coroutine waits on a GPU
        call, a queue, or is done."""

        async def idle() -> None:
            for _ in range(10_000):
                await asyncio.sleep(0)
                if not self.loop._ready:  # type: ignore[attr-defined]
                    return
            raise AssertionError("the event loop never went idle")

        self.loop.run_until_complete(idle())
        self.tasks = [t for t in self.tasks if not t.done() or self._raise(t)]

    @staticmethod
    def _raise(task: asyncio.Task[Any]) -> bool:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        return False

    def settle_all(self) -> None:
        """Run every queued GPU call, FIFO, until nothing is pending anywhere."""
        for _ in range(10_000):
            self.settle()
            busy = [s for s in self.executors.values() if s.pending]
            if not busy:
                return
            busy[0].run_next()
        raise AssertionError("GPU work never ran out")

    # -- what the world looks like ----------------------------------------------------------

    def gpu_uuids(self, index: int) -> set[str]:
        return {u for view in self.node.instances(index) for u in view.uuids}

    def _lease(self, job: Job) -> Lease | None:
        return self.daemon.ctx.sched.leases.get(job.lease_id)

    # -- steps ------------------------------------------------------------------------------

    def enabled(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for index, stepped in self.executors.items():
            if stepped.pending:
                out.append(("gpu", index))
        out.append(("submit", None))
        if self.group_size:
            out.append(("submit_group", None))
        out.append(("reaper", None))
        out.append(("timers", None))
        out.extend(("sample", index) for index in self.daemon.ctx.sched.gpus)
        out.append(("restart", None))
        out.append(("reset", None))
        if "xid" in self.daemon.ctx.sched.gpus[0].health.conditions:
            out.append(("xid_clear", None))
        for job in self.jobs.values():
            lease = self._lease(job)
            if job.state == "handed" and lease is not None and lease.state is LeaseState.ACTIVE:
                out.append(("start_job", job))
            if job.state == "running":
                out.extend([("job_exit", job), ("orphan", job), ("holder_crash", job)])
                out.append(("leave", job))
                out.append(("xid", job))
            if job.state == "orphaned":
                out.append(("orphan_exit", job))
        return out

    def step(self) -> None:
        choices = self.enabled()
        weights = [WEIGHTS[kind] for kind, _ in choices]
        kind, arg = self.rng.choices(choices, weights)[0]
        label = getattr(self, f"_do_{kind}")(arg)
        self.steps.append(f"{kind} {label}".strip())
        self.settle()
        self._hand_out()
        self.check()

    def _hand_out(self) -> None:
        """Every newly granted job's hand-out check starts, as in the submitter: right
        after its wait for the grant ends."""
        started = False
        for job in self.jobs.values():
            lease = self._lease(job)
            if job.state == "waiting" and lease is not None and lease.state is LeaseState.ACTIVE:
                job.state = "handing"
                self.tasks.append(self.loop.create_task(self._check_handout(job, lease)))
                started = True
        if started:
            self.settle()

    async def _check_handout(self, job: Job, lease: Lease) -> None:
        handed = await self.daemon.leftovers.check_handout(lease)
        if job.state == "handing":
            # Refused: its instance had processes; the lease is released and the job
            # (which would ask again) is done here.
            job.state = "handed" if handed else "done"
            if not handed:
                self.steps.append(f"  hand-out of {lease.lease_id} refused")

    def _do_sample(self, index: int) -> str:
        gpu = self.daemon.ctx.sched.gpus[index]
        self.tasks.append(self.loop.create_task(self.daemon.periodic.sample_round(gpu)))
        return f"GPU {index}"

    def _do_gpu(self, index: int) -> str:
        return f"{index}: {self.executors[index].run_next()}"

    def _do_submit(self, _: Any) -> str:
        self._n += 1
        n = self._n
        memory = self.rng.choice([1000, 4000, 9000, 15000, 19000])
        request = LeaseRequest(f"{n}.0", memory, wait_s=3600)
        holder = 10_000 + n
        lease = Lease(f"L{n}", request, 1000, holder, self.clock.now(), owner_start_s=1.0)
        d = self.daemon
        outcome = d.ctx.sched.submit(lease, self.clock.now(), self.clock.monotonic())
        d.leases.apply(outcome)
        if outcome.refusal is None:
            self.jobs[lease.lease_id] = Job(lease.lease_id, holder, 20_000 + n)
        return f"L{n} {memory} MiB"

    def _do_submit_group(self, _: Any) -> str:
        """A job on ``group_size`` GPUs: one lease per GPU, submitted as a group."""
        self._n += 1
        n = self._n
        memory = self.rng.choice([1000, 4000, 9000, 19000])
        holder = 10_000 + n
        members = [
            Lease(
                f"L{n}g{i}",
                LeaseRequest(f"{n}.0", memory, wait_s=3600),
                1000,
                holder,
                self.clock.now(),
                owner_start_s=1.0,
            )
            for i in range(self.group_size)
        ]
        d = self.daemon
        outcome = d.ctx.sched.submit_group(members, self.clock.now(), self.clock.monotonic())
        d.leases.apply(outcome)
        if outcome.refusal is None:
            self.groups.append([m.lease_id for m in members])
            for i, m in enumerate(members):
                self.jobs[m.lease_id] = Job(m.lease_id, holder, 30_000 + 10 * n + i)
        return f"L{n}g* {self.group_size} x {memory} MiB"

    def _do_start_job(self, job: Job) -> str:
        lease = self._lease(job)
        assert lease is not None and lease.mig_uuid is not None
        self.node.attach(job.pid, lease.mig_uuid)
        self.node.alloc(job.pid, 500)
        job.mig_uuid, job.state = lease.mig_uuid, "running"
        return f"{job.lease_id} on {lease.mig_uuid}"

    async def _release(self, job: Job) -> None:
        """What the API's release op does (leftover check, then the release)."""
        lease = self._lease(job) or self.daemon.ctx.db.get_lease(job.lease_id)
        if lease is not None and lease.lease_id in self.daemon.ctx.sched.leases:
            call = SimpleNamespace(
                request=SimpleNamespace(reason="released"),
                owned=lease,
                peer=SimpleNamespace(uid=1000, pid=lease.owner_pid),  # the holder itself
            )
            await self.ops.release(call)  # type: ignore[arg-type]
        if job.state == "exiting":
            job.state = "done"
            self.procs.dead.add(job.holder)
        elif job.state == "leaving":  # the wrapper is gone; the child's process stays
            job.state = "orphaned"
            self.procs.dead.add(job.holder)

    def _do_job_exit(self, job: Job) -> str:
        self.node.detach(job.pid)
        job.state = "exiting"
        self.tasks.append(self.loop.create_task(self._release(job)))
        return job.lease_id

    def _do_leave(self, job: Job) -> str:
        """The job ends and its wrapper releases the lease, but a child it started with
        ``setsid`` keeps its CUDA process on the instance (a leftover, found by the next
        hand-out or sampler round)."""
        job.state = "leaving"
        self.tasks.append(self.loop.create_task(self._release(job)))
        return job.lease_id

    def _do_orphan(self, job: Job) -> str:
        job.state = "orphaned"  # its process stays on the instance; the wrapper is gone
        self.procs.dead.add(job.holder)
        return job.lease_id

    def _do_orphan_exit(self, job: Job) -> str:
        self.node.detach(job.pid)
        job.state = "done"
        return job.lease_id

    def _do_holder_crash(self, job: Job) -> str:
        self.node.detach(job.pid)
        job.state = "done"
        self.procs.dead.add(job.holder)
        return job.lease_id

    def _do_reaper(self, _: Any) -> str:
        self.clock.advance(0.2)
        self.tasks.append(self.loop.create_task(self.daemon.periodic.reaper_round()))
        return ""

    def _do_timers(self, _: Any) -> str:
        self.clock.advance(self.rng.choice([1.0, 11.0]))
        self.daemon.periodic.timers.step(*self.daemon.ctx.now())
        return ""

    def _do_xid(self, job: Job) -> str:
        lease = self._lease(job)
        gpu = 0 if lease is None or lease.gpu is None else lease.gpu
        books = self.daemon.ctx.sched.gpus[gpu]
        inst = next((i for i in books.instances if i.uuid == job.mig_uuid), None)
        gi_id = inst.gi_id if inst is not None else None
        critical = self.rng.random() < 0.5  # XID 43 (one instance's work lost) or a warning
        event = GpuEvent(
            gpu,
            "xid",
            xid=43,
            gi_id=gi_id,
            critical=critical,
            instance_lost=critical,
            reason="XID 43",
        )
        self.daemon.health.apply(event)
        return f"GPU {gpu} gi {gi_id} critical={critical}"

    def _do_xid_clear(self, _: Any) -> str:
        self.daemon.health.clear(0)  # migctl resume: the GPU takes leases again
        return "GPU 0"

    def _do_reset(self, _: Any) -> str:
        call = SimpleNamespace(
            request=SimpleNamespace(gpu="0", op="reset"), peer=SimpleNamespace(uid=0)
        )
        try:
            self.loop.run_until_complete(self.ops.gpu_op(call))  # type: ignore[arg-type]
        except MigdError as exc:
            return f"refused: {exc.message}"
        return "GPU 0"

    def _do_restart(self, _: Any) -> str:
        self.kill_and_restart()
        return ""

    # -- invariants -------------------------------------------------------------------------

    def fail(self, what: str) -> None:
        tail = "\n  ".join(self.steps[-40:])
        raise Violation(f"seed {self.seed}, step {len(self.steps)}: {what}\nlast steps:\n  {tail}")

    def check(self) -> None:
        if self.broken:
            self.fail(self.broken[0])
        sched = self.daemon.ctx.sched
        held: dict[tuple[int, int], str] = {}
        for lease in sched.active_leases():
            if not lease.state.holds_resources or lease.mode is not GpuMode.MIG:
                continue
            if lease.gpu is None or lease.start is None:
                continue
            key = (lease.gpu, lease.start)
            if key in held:
                self.fail(f"instance {key} held by {held[key]} and {lease.lease_id}")
            held[key] = lease.lease_id
            if lease.state is not LeaseState.ACTIVE:
                continue
            on_gpu = self.gpu_uuids(lease.gpu)
            if lease.mig_uuid not in on_gpu:
                self.fail(
                    f"granted lease {lease.lease_id}'s instance {lease.mig_uuid} is not on the GPU"
                )
            job = self.jobs.get(lease.lease_id)
            if job is None or job.state not in HANDED:
                continue
            mine = job.pid
            for proc in self.node.procs.by_pid.values():
                if proc.device_uuid == lease.mig_uuid and proc.pid != mine:
                    owner = next((j.lease_id for j in self.jobs.values() if j.pid == proc.pid), "?")
                    self.fail(
                        f"{lease.mig_uuid} is granted to {lease.lease_id} while a process of "
                        f"{owner} (pid {proc.pid}) runs on it"
                    )
        for group in self.groups:
            # All or none: no member holds a partition while another still waits.
            states = [(sched.leases.get(i) or self.daemon.ctx.db.get_lease(i)) for i in group]
            waiting = any(m is not None and m.state is LeaseState.QUEUED for m in states)
            holding = [m.lease_id for m in states if m is not None and m.state.holds_resources]
            if waiting and holding:
                self.fail(f"group {group}: {holding} hold partitions while another waits")
            gpus = [m.gpu for m in states if m is not None and m.state.holds_resources]
            if len(set(gpus)) != len(gpus):
                self.fail(f"group {group}: two members on one GPU ({gpus})")
        for index in sched.gpus:
            present = self.gpu_uuids(index)
            for proc in self.node.procs.by_pid.values():
                if proc.gpu == index and proc.device_uuid not in present:
                    self.fail(f"instance {proc.device_uuid} was destroyed under pid {proc.pid}")

    def check_restart(self) -> None:
        """After a restart has settled: the db, the books and the GPU agree."""
        ctx = self.daemon.ctx
        sched = ctx.sched
        live_books = {lease.lease_id: lease.state for lease in sched.active_leases()}
        live_db = {lease.lease_id: lease.state for lease in ctx.db.live_leases()}
        if live_books != live_db:
            self.fail(f"after restart the db has {live_db}, the books {live_books}")
        for index, gpu in sched.gpus.items():
            on_gpu = {
                (v.start, v.profile_id, v.uuids[0] if v.uuids else None)
                for v in self.node.instances(index)
            }
            books = {
                (i.start, i.profile.profile_id, i.uuid)
                for i in gpu.instances
                if i.status is InstanceStatus.READY
            }
            if on_gpu != books:
                self.fail(
                    f"after restart GPU {index} has {sorted(on_gpu)}, the books {sorted(books)}"
                )


def run_seed(
    seed: int, tmp: Path, steps: int, description: str = "1xA100-40GB", group_size: int = 0
) -> World:
    """Run one seeded interleaving of ``steps`` steps, checking after each; raises
    :class:`Violation`."""
    world = World(seed, tmp, description, group_size=group_size)
    try:
        world.check()
        for _ in range(steps):
            world.step()
        world.settle_all()
        world.check()
    finally:
        world.close()
    return world
