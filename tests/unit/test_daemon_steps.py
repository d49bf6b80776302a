"""The daemon's periodic steps, driven by a manual clock (no loops, no sockets, no sleeps).

Each test builds the daemon's parts on simulated GPUs (``Daemon.open()``) and calls the
synchronous step the asyncio loop would call, at the times it chooses.
"""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog.testing

from migd.backends.accounts import SystemAccounts
from migd.backends.mps import HealthEvent, HealthReport
from migd.backends.simulated import simulated_backend
from migd.core.health import Condition, GpuHealth
from migd.core.lease_end import LeaseEndReason, StopPlan
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.daemon.config import RESTART_KEYS, changed_restart_keys, validate_config
from migd.daemon.service import Daemon, keep_restart_keys
from migd.daemon.supervision.mps import MPS_UNHEALTHY
from migd.daemon.supervision.periodic import Timers, Watchdog
from migd.daemon.systemd import Notifier
from migd.errors import StateDiskError
from migd.ports import ManualClock


class FakeProcs:
    """Every process lives, and belongs to uid 1000, until the test says it died."""

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


class Pings(Notifier):
    def __init__(self) -> None:
        super().__init__(environ={})
        self.watchdog_s = 2.0
        self.sent: list[str] = []

    def notify(self, *fields: str) -> bool:
        self.sent.extend(fields)
        return True


@dataclass
class Parts:
    daemon: Daemon
    clock: ManualClock
    procs: FakeProcs
    notifier: Pings

    def lease(self, memory_mib: int, pid: int = 500, wait_s: float | None = 60.0) -> Lease:
        """Enter a lease as the API's lease op does (the lease service's own step), without
        waiting for its grant: the test moves the clock."""
        d = self.daemon
        n = len(d.ctx.sched.leases) + len(d.ctx.db.recent_leases(500))
        return d.leases.enter(LeaseRequest(f"{n}.0", memory_mib, wait_s=wait_s), 1000, pid)

    def history(self) -> list[tuple[str, str | None]]:
        return [(r.event, r.lease_id) for r in reversed(self.daemon.ctx.db.history(limit=100))]


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[Parts]:
    """One V100 (MPS: grants need no NVML work), FIFO without backfill."""
    config = validate_config(
        {
            "daemon": {"state_dir": str(tmp_path / "state"), "runtime_dir": str(tmp_path)},
            "backend": {"kind": "simulated"},
            "api": {"socket": str(tmp_path / "migd.sock")},
            "policy": {"queue": "fifo", "backfill": False},
            "reaper": {"heartbeat_timeout_s": 60},
        }
    )
    backend, _ = simulated_backend("1xV100-32GB")
    clock, procs, notifier = ManualClock(), FakeProcs(), Pings()
    daemon = Daemon(
        config, backend, procs, accounts=SystemAccounts(), clock=clock, notifier=notifier
    )
    daemon.open()
    try:
        yield Parts(daemon, clock, procs, notifier)
    finally:
        daemon.executor.close()
        assert daemon.ctx.store is not None
        daemon.ctx.store.close()


def test_a_timer_step_expires_a_request_at_its_deadline_and_places_what_it_blocked(
    parts: Parts,
) -> None:
    big = parts.lease(28000)
    blocker = parts.lease(20000, wait_s=5.0)  # does not fit next to it, waits 5 s
    behind = parts.lease(1000, wait_s=None)  # would fit, but FIFO: behind the blocker
    assert big.state is LeaseState.ACTIVE
    assert blocker.state is behind.state is LeaseState.QUEUED
    timers = Timers(parts.daemon.ctx, parts.daemon.leases)
    parts.clock.advance(4.9)
    timers.step(parts.clock.now(), parts.clock.monotonic())
    assert blocker.state is behind.state is LeaseState.QUEUED
    parts.clock.advance(0.2)
    timers.step(parts.clock.now(), parts.clock.monotonic())
    assert blocker.state is LeaseState.EXPIRED
    assert behind.state is LeaseState.ACTIVE  # in the same step, not on a later pass
    assert ("expired", blocker.lease_id) in parts.history()
    assert ("granted", behind.lease_id) in parts.history()
    stored = parts.daemon.ctx.db.get_lease(blocker.lease_id)
    assert stored is not None and stored.state is LeaseState.EXPIRED


def test_timer_housekeeping_runs_every_ten_seconds(parts: Parts) -> None:
    db, timers = parts.daemon.ctx.db, Timers(parts.daemon.ctx, parts.daemon.leases)
    parts.lease(1000)  # one request for the demand model
    timers.step(parts.clock.now(), parts.clock.monotonic())  # starts the schedule
    parts.clock.advance(9.9)
    timers.step(parts.clock.now(), parts.clock.monotonic())
    assert db.get_meta("demand") is None
    parts.clock.advance(0.1)
    timers.step(parts.clock.now(), parts.clock.monotonic())
    saved = db.get_meta("demand")
    assert saved is not None and saved["last_s"] == parts.clock.now()


def test_history_past_its_budget_is_pruned_at_a_housekeeping_round_not_the_hour(
    parts: Parts,
) -> None:
    ctx = parts.daemon.ctx
    ctx.config = ctx.config.model_copy(
        update={"daemon": ctx.config.daemon.model_copy(update={"history_keep": 100})}
    )
    timers = Timers(ctx, parts.daemon.leases)
    timers.step(parts.clock.now(), parts.clock.monotonic())  # starts the schedule
    while len(ctx.db.history(limit=1000)) < 150:
        ctx.db.record("wrapper.note", {}, lease_id="L1", job_id="1.0")
    parts.clock.advance(10.0)
    timers.step(parts.clock.now(), parts.clock.monotonic())
    # The first housekeeping round after the start prunes (and learns the history's
    # bytes, so that the byte budget can call an early prune from then on).
    assert len(ctx.db.history(limit=1000)) == 100
    while len(ctx.db.history(limit=1000)) < 150:  # half again the budget: left to the hour
        ctx.db.record("wrapper.note", {}, lease_id="L1", job_id="1.0")
    parts.clock.advance(10.0)
    timers.step(parts.clock.now(), parts.clock.monotonic())
    assert len(ctx.db.history(limit=1000)) == 150
    ctx.db.record("wrapper.note", {}, lease_id="L1", job_id="1.0")
    parts.clock.advance(9.9)
    timers.step(parts.clock.now(), parts.clock.monotonic())
    assert len(ctx.db.history(limit=1000)) == 151  # not a housekeeping round yet
    parts.clock.advance(0.1)
    timers.step(parts.clock.now(), parts.clock.monotonic())
    assert len(ctx.db.history(limit=1000)) == 100


def swept_ones(db: Any) -> list[str]:
    return [r[0] for r in db._db.execute("SELECT lease_id FROM leases WHERE lease_id LIKE 'S%'")]


def served_between(periodic: Any, turns: list[int]) -> None:
    """The rest of a prune from the timer loop, another task counting its turns."""

    async def run() -> None:
        async def other() -> None:
            while True:
                turns[0] += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await periodic.finish_prune()
        task.cancel()

    asyncio.run(run())


def test_a_prune_larger_than_a_step_goes_in_steps_with_the_loop_served_between(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first prune after a start counts the history's bytes in steps of
    COUNT_STEP_ROWS rows; an early prune drops at most PRUNE_STEP_ROWS rows a step and
    leaves the leases table to the hourly prune, which sweeps it SWEEP_STEP_ROWS leases a
    step. The steps after the first run from the timer loop, other tasks running between
    two."""
    ctx, periodic = parts.daemon.ctx, parts.daemon.periodic
    ctx.config = ctx.config.model_copy(
        update={"daemon": ctx.config.daemon.model_copy(update={"history_keep": 100})}
    )
    monkeypatch.setattr(Timers, "PRUNE_STEP_ROWS", 20)
    monkeypatch.setattr(Timers, "COUNT_STEP_ROWS", 30)
    monkeypatch.setattr(Timers, "SWEEP_STEP_ROWS", 4)
    monkeypatch.setattr(Timers, "PRUNE_STEP_GAP_S", 0.0)  # (a turn of the loop, no wait)
    db, timers = ctx.db, periodic.timers
    while len(db.history(limit=1000)) < 95:
        db.record("wrapper.note", {}, lease_id="L1", job_id="1.0")
    steps: list[tuple[str, Any, int]] = []  # (kind, its answer, other task's turns)
    turns = [0]
    for name in ("count_history_step", "prune", "sweep_ended_leases_step"):
        real = getattr(db, name)

        def traced(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            answer = _real(*args, **kw)
            steps.append((_name, answer, turns[0]))
            return answer

        monkeypatch.setattr(db, name, traced)
    timers.step(parts.clock.now(), parts.clock.monotonic())  # starts the schedule
    parts.clock.advance(10.0)
    timers.step(parts.clock.now(), parts.clock.monotonic())  # the first prune: counts
    assert timers.pruning and db._history_bytes is None
    served_between(periodic, turns)
    counts = [answer for kind, answer, _ in steps][:4]
    assert counts == [False, False, False, True]  # 95 rows, 30 a step
    assert db._history_bytes == sum(len(d) for (d,) in db._db.execute("SELECT data FROM history"))
    assert all(b[2] > a[2] for a, b in itertools.pairwise(steps[:4]))
    assert not timers.pruning
    # Ten ended leases no history row will name, older than every row (the sweep's).
    with db.transaction():
        for n in range(10):
            db._write(
                "INSERT INTO leases VALUES(?,?,?,?,?,?)",
                (f"S{n}", f"{n}.0", "released", 0.0, 0.0, "{}"),
            )
    while len(db.history(limit=1000)) <= 170:
        db.record("wrapper.note", {}, lease_id="L1", job_id="1.0")
    steps.clear()
    parts.clock.advance(10.0)
    timers.step(parts.clock.now(), parts.clock.monotonic())  # overdue: the first step
    assert timers.pruning and len(db.history(limit=1000)) == 151
    served_between(periodic, turns)
    assert [(k, a) for k, a, _ in steps if k != "count_history_step"] == [
        ("prune", 20),
        ("prune", 20),
        ("prune", 20),
        ("prune", 11),
    ]
    assert all(b[2] > a[2] for a, b in itertools.pairwise(steps[::2]))
    assert not timers.pruning and len(db.history(limit=1000)) == 100
    assert len(swept_ones(db)) == 10  # no early prune sweeps
    steps.clear()
    parts.clock.advance(Timers.HISTORY_EVERY_S)  # the hourly prune sweeps, in steps
    rowids = [r[0] for r in db._db.execute("SELECT rowid FROM leases ORDER BY rowid")]
    assert len(rowids) >= 10
    timers.step(parts.clock.now(), parts.clock.monotonic())
    served_between(periodic, turns)
    kinds = [(k, a) for k, a, _ in steps if k != "count_history_step"]
    # The leases table as it was (live ones aside, the ten), four leases a step.
    assert kinds[0] == ("prune", 0) and kinds[-1] == ("sweep_ended_leases_step", None)
    assert [a for _, a in kinds[1:-1]] == rowids[3::4] + rowids[-1:] * (len(rowids) % 4 > 0)
    assert all(k == "sweep_ended_leases_step" for k, _ in kinds[1:]) and not timers.pruning
    assert swept_ones(db) == []


def test_a_history_prune_the_disk_refuses_is_said_once_and_not_tried_every_round(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = parts.daemon.ctx
    ctx.config = ctx.config.model_copy(
        update={"daemon": ctx.config.daemon.model_copy(update={"history_keep": 100})}
    )
    timers = Timers(ctx, parts.daemon.leases)
    timers.step(parts.clock.now(), parts.clock.monotonic())
    ctx.db.prune(100, ctx.config.daemon.history_keep_bytes)
    while len(ctx.db.history(limit=1000)) <= 150:
        ctx.db.record("wrapper.note", {}, lease_id="L1", job_id="1.0")
    tries = []

    def refused(keep: int, keep_bytes: int, **bounds: object) -> int:
        tries.append(parts.clock.monotonic())
        raise StateDiskError("the state disk is full", hint="free space on it")

    monkeypatch.setattr(ctx.db, "prune", refused)
    with structlog.testing.capture_logs() as events:
        for _ in range(60):  # ten minutes of housekeeping rounds
            parts.clock.advance(10.0)
            timers.step(parts.clock.now(), parts.clock.monotonic())
    assert len(tries) == 1
    failed = [e for e in events if e["event"] == "history.prune_failed"]
    assert len(failed) == 1 and failed[0]["error"] == "the state disk is full"
    monkeypatch.undo()
    parts.clock.advance(10.0)  # the disk takes writes again, and the retry is due
    timers.step(parts.clock.now(), parts.clock.monotonic())
    assert len(ctx.db.history(limit=1000)) == 100


def test_the_reaper_picks_dead_holders_and_silent_ones(parts: Parts) -> None:
    reaper = parts.daemon.reaper
    alive, dead = parts.lease(1000, pid=501), parts.lease(1000, pid=502)
    assert reaper.holders_gone(parts.clock.monotonic()) == []
    parts.procs.dead.add(502)
    assert reaper.holders_gone(parts.clock.monotonic()) == [(dead, "holder process exited")]
    parts.clock.advance(61.0)  # reaper.heartbeat_timeout_s = 60, and nobody beat
    gone = {lease.lease_id: why for lease, why in reaper.holders_gone(parts.clock.monotonic())}
    assert gone == {alive.lease_id: "no heartbeat", dead.lease_id: "holder process exited"}
    parts.daemon.ctx.sched.heartbeat(alive.lease_id, parts.clock.now(), parts.clock.monotonic())
    assert [lease for lease, _ in reaper.holders_gone(parts.clock.monotonic())] == [dead]


# A wall-clock step (NTP, an admin's `date`) forwards and backwards: a day, an hour, and
# a step just past the heartbeat timeout.
WALL_STEPS = [86400.0, -86400.0, 3600.0, -3600.0, 61.0, -61.0]


@pytest.mark.parametrize("step_s", WALL_STEPS)
def test_a_wall_clock_step_neither_reclaims_a_beating_lease_nor_delays_a_silent_one(
    parts: Parts, step_s: float
) -> None:
    reaper, clock, sched = parts.daemon.reaper, parts.clock, parts.daemon.ctx.sched
    beating, silent = parts.lease(1000, pid=501), parts.lease(1000, pid=502)  # granted at 0
    for n in range(1, 4):  # monotonic 20, 40, 60 s; the wall clock is set at 20 s
        clock.advance(20.0)
        if n == 1:
            clock.step_wall(step_s)
        asyncio.run(reaper.reap(clock.now(), clock.monotonic()))  # before this round's beat
        assert beating.state is LeaseState.ACTIVE, (n, step_s)
        assert silent.state is LeaseState.ACTIVE, (n, step_s)  # 60 s is not more than 60
        sched.heartbeat(beating.lease_id, clock.now(), clock.monotonic())
    clock.advance(0.5)  # the silent one's 60 s timeout has passed: now, not a day later
    asyncio.run(reaper.reap(clock.now(), clock.monotonic()))
    assert silent.state is LeaseState.RECLAIMED and silent.reason == "no heartbeat"
    assert beating.state is LeaseState.ACTIVE


@pytest.mark.parametrize("step_s", WALL_STEPS)
def test_a_wall_clock_step_moves_no_queue_deadline(parts: Parts, step_s: float) -> None:
    timers, clock = Timers(parts.daemon.ctx, parts.daemon.leases), parts.clock
    parts.lease(28000)
    waiting = parts.lease(20000, wait_s=30.0)  # does not fit: waits 30 s (monotonic)
    clock.advance(10.0)
    clock.step_wall(step_s)
    clock.advance(19.9)
    timers.step(clock.now(), clock.monotonic())
    assert waiting.state is LeaseState.QUEUED
    clock.advance(0.2)
    timers.step(clock.now(), clock.monotonic())
    assert waiting.state is LeaseState.EXPIRED


def test_the_watchdog_step_pings_only_while_every_gpu_thread_answers(parts: Parts) -> None:
    executor, clock = parts.daemon.executor, parts.clock
    watchdog = Watchdog(parts.daemon.ctx, executor)  # WatchdogSec 2 s: stale after 1 s
    worker = executor.workers[0]
    assert watchdog.step(clock.monotonic()) and parts.notifier.sent == ["WATCHDOG=1"]
    worker.heartbeat_sent, worker.heartbeat_sent_mono = 1, clock.monotonic()  # not answered
    clock.advance(1.5)  # the thread did not answer its heartbeat
    assert not watchdog.step(clock.monotonic())
    worker.busy_since_mono = clock.monotonic()  # ... because a create runs: that is fine
    assert watchdog.step(clock.monotonic())
    clock.advance(parts.daemon.config.daemon.work_timeout_s)  # until the create overruns
    assert not watchdog.step(clock.monotonic())
    worker.busy_since_mono, worker.heartbeat_answered = None, 1  # it answers
    assert watchdog.step(clock.monotonic())
    executor.tripped = "an NVML call hung"  # a timed-out call: never fed again
    assert not watchdog.step(clock.monotonic())
    assert parts.notifier.sent.count("WATCHDOG=1") == 3


def test_the_watchdog_blames_a_busy_loop_on_the_loop_and_a_silent_thread_on_nvml(
    parts: Parts,
) -> None:
    """The loop ran the step late, but every heartbeat it sent was answered (in the GPU
    thread, even if the loop has not yet run the answer's callback): that is loop lag,
    logged as such, and systemd is fed. A heartbeat owed longer than half WatchdogSec is
    the GPU thread's: starved, no ping."""
    executor, clock = parts.daemon.executor, parts.clock
    watchdog = Watchdog(parts.daemon.ctx, executor)  # WatchdogSec 2 s: tick 0.5 s
    watchdog.started(clock.monotonic())
    for worker in executor.workers.values():  # sent, and answered in the thread at once
        worker.heartbeat_pending, worker.heartbeat_sent_mono = True, clock.monotonic()
        worker.heartbeat_sent = worker.heartbeat_answered = 1
    clock.advance(162.0)  # the loop was busy for 162 s (issue 23)
    with structlog.testing.capture_logs() as events:
        assert watchdog.step(clock.monotonic())
    [lag] = [e for e in events if str(e["event"]).startswith("watchdog.")]
    assert lag["event"] == "watchdog.loop_lag" and lag["cause"] == "event_loop"
    assert lag["lag_s"] == pytest.approx(161.5)
    worker = executor.workers[0]  # now one thread owes an answer
    worker.heartbeat_sent, worker.heartbeat_sent_mono = 2, clock.monotonic()
    clock.advance(1.5)  # the step is 1 s late, too, but the thread is to blame
    with structlog.testing.capture_logs() as events:
        assert not watchdog.step(clock.monotonic())
    [starved] = [e for e in events if str(e["event"]).startswith("watchdog.")]
    assert starved["event"] == "watchdog.starved" and starved["cause"] == "gpu_thread"
    assert starved["gpus"] == [0]
    assert parts.notifier.sent.count("WATCHDOG=1") == 1


def test_an_mps_health_report_flags_leases_and_marks_the_gpu_until_it_serves(
    parts: Parts,
) -> None:
    lease = parts.lease(1000)
    gpu = parts.daemon.ctx.sched.gpus[0]
    assert lease.mps_device_uuid == gpu.uuid
    lost = HealthEvent(gpu.uuid, "daemon_gone", "pid 77 gone", "restart_failed", ok=False)
    parts.daemon.mps.apply_health(HealthReport((lost,)))
    [condition] = gpu.health.conditions.values()
    assert (condition.source, condition.since) == ("mps", parts.clock.now())
    assert condition.reason == f"{MPS_UNHEALTHY}: {gpu.uuid}" and not gpu.available
    assert "MPS clients lost" in lease.warning and "pid 77 gone" in lease.warning
    assert ("mps.clients_lost", lease.lease_id) in parts.history()
    parts.daemon.mps.apply_health(HealthReport())  # the next check finds it serving
    assert str(gpu.health) == "ok" and gpu.available and not gpu.health.conditions


def test_each_health_source_clears_only_its_own_condition() -> None:
    health = GpuHealth()
    assert health.available and str(health) == "ok"
    assert health.raise_("mps", "MPS daemon cannot be restarted", 10.0)
    assert health.raise_("watchdog", "an NVML call hung", 11.0)
    assert not health.raise_("mps", "MPS daemon cannot be restarted", 12.0)  # same: kept
    assert health.conditions["mps"] == Condition("mps", "MPS daemon cannot be restarted", 10.0)
    assert str(health) == "MPS daemon cannot be restarted; an NVML call hung"
    assert health.clear("mps") and not health.clear("mps")
    assert not health.available and list(health.conditions) == ["watchdog"]
    assert health.clear("watchdog") and health.available


def test_a_reload_keeps_every_restart_key_and_takes_every_other(tmp_path: Path) -> None:
    old = validate_config({"daemon": {"state_dir": str(tmp_path / "a")}})
    new = validate_config(
        {
            "daemon": {"state_dir": str(tmp_path / "b"), "runtime_dir": str(tmp_path / "r")},
            "backend": {"kind": "simulated"},
            "api": {"socket": str(tmp_path / "b.sock"), "request_timeout_s": 3.0},
            "gpu": [{"match": "0", "mode": "off"}],
            "policy": {"profiles": "classic", "queue": "size"},
            "metrics": {"listen": "127.0.0.1:0"},
            "health": {"xid_events": False},
            "htcondor": {"offline_gpus": False},
            "mps": {"require_exclusive_process": True},
        }
    )
    assert changed_restart_keys(old, new) == list(RESTART_KEYS)  # each one differs
    merged = keep_restart_keys(old, new)
    assert changed_restart_keys(old, merged) == []
    for dotted in RESTART_KEYS:
        kept, was = merged, old
        for part in dotted.split("."):
            kept, was = getattr(kept, part), getattr(was, part)
        assert kept == was, dotted
    assert merged.api.request_timeout_s == 3.0 and merged.policy.queue == "size"


def test_sighup_forgets_cached_group_memberships() -> None:
    accounts = SystemAccounts()
    accounts.group_ids(0, 0)  # uid 0 is root on every host, named or not
    accounts.user_name(0)
    assert accounts.cached() == 2
    accounts.forget()
    assert accounts.cached() == 0


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, LeaseState | None, LeaseState, float]] = []

    def on_transition(
        self, lease: Lease, old: LeaseState | None, new: LeaseState, now: float
    ) -> None:
        self.seen.append((lease.lease_id, old, new, now))


class Broken:
    def on_transition(
        self, lease: Lease, old: LeaseState | None, new: LeaseState, now: float
    ) -> None:
        raise RuntimeError("a bug in a metrics exporter")


def test_lease_observers_see_each_net_transition_and_a_broken_one_stops_nothing(
    parts: Parts,
) -> None:
    recorder = Recorder()
    parts.daemon.leases.add_observer(Broken())
    parts.daemon.leases.add_observer(recorder)
    first = parts.lease(28000)  # granted at once (MPS): new -> active, one transition
    waiting = parts.lease(20000, wait_s=None)
    t = parts.clock.now()
    assert recorder.seen == [
        (first.lease_id, None, LeaseState.ACTIVE, t),
        (waiting.lease_id, None, LeaseState.QUEUED, t),
    ]
    parts.clock.advance(5.0)
    parts.daemon.leases.release(first, "done")  # frees room: the waiting one is granted
    assert recorder.seen[2:] == [
        (first.lease_id, LeaseState.ACTIVE, LeaseState.RELEASED, t + 5.0),
        (waiting.lease_id, LeaseState.QUEUED, LeaseState.ACTIVE, t + 5.0),
    ]
    stored = parts.daemon.ctx.db.get_lease(waiting.lease_id)
    assert stored is not None and stored.state is LeaseState.ACTIVE  # the store still saw it


def test_a_reload_that_fails_late_applies_nothing_of_the_new_configuration(parts: Parts) -> None:
    daemon = parts.daemon
    old = daemon.ctx.config
    data = old.model_dump(mode="json")
    data["policy"] |= {"queue": "size", "demand_prior": {"9g.99gb": 1.0}}  # no GPU has it
    daemon.reload_config = lambda: validate_config(data)
    reply = asyncio.run(daemon.reload())
    assert reply["reloaded"] is False
    assert "policy.demand_prior" in reply["error"]["message"]
    assert daemon.ctx.config is old  # not policy.queue = "size" with the prior refused
    assert daemon.ctx.sched.policy.queue.value == "fifo"


class _NoScan(dict):  # type: ignore[type-arg]
    """A lease or waiter table that fails the test when something walks all of it."""

    def _scan(self, *args: object) -> object:
        raise AssertionError("walked every entry of a lease or waiter table")

    values = items = keys = __iter__ = _scan  # type: ignore[assignment]


def test_applying_an_outcome_visits_only_the_leases_it_touched(parts: Parts) -> None:
    """Issue 26 §4: every outcome saved, answered and pruned by scanning every lease and
    waiter. A release is saved, recorded and forgotten without walking either table."""
    kept = [parts.lease(1000, pid=500 + n) for n in range(3)]
    d, clock = parts.daemon, parts.clock
    sched = d.ctx.sched
    sched.leases = _NoScan(sched.leases)
    d.leases.waiters = _NoScan(d.leases.waiters)
    ending = kept[0]
    d.leases.apply(sched.release(ending.lease_id, clock.now(), clock.monotonic()))
    assert dict.get(sched.leases, ending.lease_id) is None  # written, answered: forgotten
    assert d.ctx.db.get_lease(ending.lease_id).state is LeaseState.RELEASED  # type: ignore[union-attr]
    assert all(dict.get(sched.leases, lease.lease_id) is lease for lease in kept[1:])


def test_every_op_of_the_request_types_is_served_or_answered_as_missing(parts: Parts) -> None:
    """``migd.api.OPS`` is read from the request types; the daemon's table has each one
    (a handler, or on real GPUs the simulator's "not simulated" answer) and no other."""
    from migd.api import OPS

    api = parts.daemon.api
    assert len(OPS) == len(set(OPS)) > 15
    assert set(api.ops) | set(api.missing) == set(OPS)
    assert not set(api.ops) & set(api.missing)


def test_an_admin_release_tells_the_job_why_also_in_the_release_reply(parts: Parts) -> None:
    """A job that fails on its vanished partition ends before the wrapper's poll sees the
    lease go: the wrapper's own release reply is then all it has, and its stop message must
    still carry the admin's reason (a pool run showed it without)."""
    lease = parts.lease(4000)
    parts.daemon.leases.release(lease, "GPU needed", end=LeaseEndReason.ADMIN_RELEASE)
    reply = parts.daemon.leases.release(lease, "the job's own release")
    assert reply.get("already") is True
    plan = StopPlan()
    assert plan.observe(reply)
    assert plan.message() == "an administrator released the job's GPU partition (GPU needed)"


class _Commits:
    """The state db's connection, counting commits and failing them while ``fail`` is set
    (as SQLite does when the disk fills up at the commit)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.commits = 0
        self.fail = False

    def execute(self, sql: str, params: tuple[object, ...] = ()) -> sqlite3.Cursor:
        if sql == "COMMIT":
            self.commits += 1
            if self.fail:
                raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, params)

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)


def test_a_lease_cycle_commits_twice_and_a_lost_commit_is_written_once_the_disk_takes_it(
    parts: Parts,
) -> None:
    """Issue 26 §4: a lease→release cycle wrote five rows in five commits. Now each
    request's rows share one commit; one that fails loses them all, so the lease is
    written again (and an ended one kept in memory until it is) once the disk recovers."""
    d = parts.daemon
    store = d.ctx.db
    conn = _Commits(store._db)
    store._db = conn  # type: ignore[assignment]
    lease = parts.lease(1000)
    assert lease.state is LeaseState.ACTIVE
    d.leases.release(lease, "done")
    assert conn.commits == 2
    events = [e for e, lid in parts.history() if lid == lease.lease_id]
    assert events == ["submitted", "granted", "released"]
    assert lease.lease_id not in d.ctx.sched.leases  # written and answered: forgotten

    other = parts.lease(1000, pid=501)
    conn.fail = True
    with structlog.testing.capture_logs() as logs:
        d.leases.release(other, "done")
    conn.fail = False
    assert other.state is LeaseState.RELEASED
    saved = store.get_lease(other.lease_id)
    assert saved is not None and saved.state is LeaseState.ACTIVE  # the release was lost
    assert d.ctx.sched.leases.get(other.lease_id) is other  # kept until written
    assert store.failing is not None
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["state_disk.failing"]

    assert d.leases.flush()
    saved = store.get_lease(other.lease_id)
    assert saved is not None and saved.state is LeaseState.RELEASED
    assert other.lease_id not in d.ctx.sched.leases
    assert store.failing is None


def test_the_requests_of_one_loop_turn_share_a_commit_and_a_lost_one_is_written_again(
    parts: Parts,
) -> None:
    """In the daemon the requests served in one turn of the event loop commit together
    at its end (StateDatabase.defer_commits, issue 26 §4). A lease and its release in
    one turn are one commit; when that commit fails, both leases' writes are lost, the
    ended lease stays in memory, and the next flush writes it once the disk takes it."""
    d = parts.daemon
    store = d.ctx.db
    conn = _Commits(store._db)
    store._db = conn  # type: ignore[assignment]
    turn: list[Callable[[], None]] = []
    store.defer_commits(turn.append)

    def end_turn() -> None:
        asked = list(turn)
        turn.clear()
        for fn in asked:
            fn()

    lease = parts.lease(1000)
    d.leases.release(lease, "done")
    assert conn.commits == 0 and len(turn) == 1
    d.leases.prune()  # (a waiter's end asks again: not before the commit has landed)
    d.leases._forget_if_done(lease.lease_id)
    assert d.ctx.sched.leases.get(lease.lease_id) is lease
    end_turn()
    assert conn.commits == 1
    saved = store.get_lease(lease.lease_id)
    assert saved is not None and saved.state is LeaseState.RELEASED
    assert lease.lease_id not in d.ctx.sched.leases

    other = parts.lease(1000, pid=501)
    d.leases.release(other, "done")
    d.leases.prune()
    conn.fail = True
    with structlog.testing.capture_logs() as logs:
        end_turn()
    conn.fail = False
    assert store.get_lease(other.lease_id) is None  # neither the lease nor its release
    assert d.ctx.sched.leases.get(other.lease_id) is other
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["state_disk.failing"]
    assert d.leases.flush()
    end_turn()
    saved = store.get_lease(other.lease_id)
    assert saved is not None and saved.state is LeaseState.RELEASED
    assert other.lease_id not in d.ctx.sched.leases
    assert store.failing is None
