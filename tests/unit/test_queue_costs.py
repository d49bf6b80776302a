"""What a scheduling pass asks, counted (issue 26 §4): a long queue costs one placement
attempt per blocked request shape, not one per queued request, and a request's MIG size
is worked out once per (GPU model, request size), not on every pass for every GPU."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from migd.core import catalog, mig_mode
from migd.core.gpus import GpuMode, ManagedGpu, mode_state
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.planner import CreateOp
from migd.core.policy import SchedulerPolicy
from migd.core.queueing import QueuePolicy
from migd.core.scheduler import NodeScheduler
from migd.core.states import state_space

SIZES = [4000, 9000, 19000, 39000]  # four profiles of an A100-40GB
_ids = itertools.count()


def full_node(scheme: QueuePolicy) -> NodeScheduler:
    """Four A100-40GB, each held whole: every request queues."""
    geo = catalog.geometry("A100-40GB")
    gpus = [
        ManagedGpu(
            i,
            f"GPU-{i}",
            geo.model,
            geo.model,
            geo.memory_mib,
            mode_state(GpuMode.MIG, state_space(geo)),
        )
        for i in range(4)
    ]
    node = NodeScheduler(gpus, SchedulerPolicy(queue=scheme))
    for _ in gpus:
        out = node.submit(request(40000, wait_s=0), 0.0, 0.0)
        for work in out.work:
            made = {
                op.start: (op.start, f"MIG-{op.start}", 40000)
                for op in work.ops
                if isinstance(op, CreateOp)
            }
            node.work_done(work, made, 0.0, 0.0)
    return node


def request(memory_mib: int, wait_s: float | None = 3600.0, uid: int = 1000) -> Lease:
    n = next(_ids)
    return Lease(f"L{n}", LeaseRequest(f"{n}.0", memory_mib, wait_s=wait_s), uid, 1, 0.0)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    calls = {"size_request": 0, "place": 0, "shape": 0}
    size_request = mig_mode.size_request
    place = NodeScheduler._place
    shape = NodeScheduler._placement_shape

    def counting_shape(self: NodeScheduler, *args: object) -> object:
        calls["shape"] += 1
        return shape(self, *args)  # type: ignore[arg-type]

    def counting_size(*args: object) -> object:
        calls["size_request"] += 1
        return size_request(*args)  # type: ignore[arg-type]

    def counting_place(self: NodeScheduler, *args: object) -> object:
        calls["place"] += 1
        return place(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(mig_mode, "size_request", counting_size)
    monkeypatch.setattr(NodeScheduler, "_place", counting_place)
    monkeypatch.setattr(NodeScheduler, "_placement_shape", counting_shape)
    yield calls


@pytest.mark.parametrize("scheme", list(QueuePolicy))
def test_a_pass_over_a_long_queue_tries_each_blocked_shape_once(
    scheme: QueuePolicy, counted: dict[str, int]
) -> None:
    node = full_node(scheme)
    for n in range(400):
        node.submit(request(SIZES[n % 4], uid=1000 + n % 3), 1.0 + n, 1.0 + n)
    assert len(node.queue) == 400
    counted["place"] = counted["size_request"] = counted["shape"] = 0
    out = node.submit(request(4000), 500.0, 500.0)
    assert out.lease is not None and out.lease.state is LeaseState.QUEUED
    # fifo stops at its head; size tries each of the four shapes once (backfill)
    assert counted["place"] == (1 if scheme is QueuePolicy.FIFO else len(SIZES))
    # at most one look at each queue bucket (size x user), not one per queued request
    assert counted["shape"] <= len(SIZES) * 3
    # the sizes were worked out when they were first submitted: none again
    assert counted["size_request"] == 0
    assert out.queued_position == (401 if scheme is QueuePolicy.FIFO else 101)


@pytest.mark.parametrize("scheme", list(QueuePolicy))
def test_a_request_shape_is_worked_out_once_across_passes_until_a_gpu_changes_mode(
    scheme: QueuePolicy, counted: dict[str, int]
) -> None:
    """Issue 26 §4: each pass asked every GPU's mode driver for each bucket's shape."""
    node = full_node(scheme)
    for n in range(40):
        node.submit(request(SIZES[n % 4], uid=1000 + n % 3), 1.0 + n, 1.0 + n)
    counted["shape"] = 0
    for k in range(5):
        node.schedule(100.0 + k, 100.0 + k)
        node.submit(request(SIZES[k % 4], uid=1000 + k % 3), 100.0 + k, 100.0 + k)
    assert counted["shape"] == 0  # every request seen before: its shape is known
    # a GPU's mode setting changes what a shape is: the next pass works them out again
    mig = node.gpus[0].mig
    assert mig is not None
    mig.mps_in_mig = True
    node.schedule(200.0, 200.0)
    assert counted["shape"] >= 1
    asked = counted["shape"]
    node.schedule(201.0, 201.0)
    assert counted["shape"] == asked
