"""A wall-clock step (NTP, an admin's ``date``) moves no timer (issue 23, section 7):
the idle timeout of a MIG instance runs on the monotonic clock, while the wall clock
jumps forwards and backwards. (The reaper and queue deadlines: test_daemon_steps.py.)"""

from __future__ import annotations

import itertools

import pytest

from migd.core import catalog
from migd.core.gpus import ManagedGpu, MigState, Work
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.planner import CreateOp, DestroyOp
from migd.core.policy import SchedulerPolicy
from migd.core.scheduler import NodeScheduler
from migd.core.states import state_space

IDLE_TIMEOUT_S = 300.0
_gi = itertools.count(1)


class Times:
    """Wall and monotonic time, moved together or (a step) the wall clock alone."""

    def __init__(self) -> None:
        self.wall, self.mono = 1_700_000_000.0, 5_000.0

    def advance(self, seconds: float) -> tuple[float, float]:
        self.wall += seconds
        self.mono += seconds
        return self.wall, self.mono


def _run(node: NodeScheduler, work: list[Work], wall: float, mono: float) -> None:
    for w in work:
        created = {
            op.start: (next(_gi), f"MIG-{op.start}-{w.work_id}", op.profile.memory_mib)
            for op in w.ops
            if isinstance(op, CreateOp)
        }
        node.work_done(w, created, wall, mono)


def _destroys(work: list[Work]) -> list[int]:
    return [op.start for w in work for op in w.ops if isinstance(op, DestroyOp)]


@pytest.mark.parametrize("step_s", [86400.0, -86400.0, 3600.0, -3600.0, 301.0, -301.0])
def test_a_wall_clock_step_neither_hastens_nor_delays_an_idle_teardown(step_s: float) -> None:
    geo = catalog.geometry("A100-40GB")
    gpu = ManagedGpu(0, "GPU-0000", "A100-40GB", "A100", geo.memory_mib, MigState(state_space(geo)))
    node = NodeScheduler(
        [gpu],
        SchedulerPolicy(idle_policy="timeout", idle_timeout_s=IDLE_TIMEOUT_S),  # type: ignore[arg-type]
    )
    t = Times()
    lease = Lease("A", LeaseRequest("1.0", 4000), 1000, 1, t.wall)
    _run(node, node.submit(lease, t.wall, t.mono).work, t.wall, t.mono)
    assert lease.state is LeaseState.ACTIVE
    wall, mono = t.advance(10.0)
    _run(node, node.release("A", wall, mono).work, wall, mono)  # idle from here
    inst = gpu.instances[0]
    assert inst.lease_id is None and inst.idle_since_s == wall
    t.advance(100.0)
    t.wall += step_s  # the wall clock is set; monotonic time goes on
    wall, mono = t.advance(IDLE_TIMEOUT_S - 100.0 - 0.5)
    assert _destroys(node.idle_teardown(wall, mono).work) == []  # 299.5 s idle: not yet
    wall, mono = t.advance(1.0)
    assert _destroys(node.idle_teardown(wall, mono).work) == [inst.start]  # 300.5 s: due
