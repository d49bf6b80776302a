"""The scheduler's work in flight, and undoing what failed work intended (pure).

Work (:class:`migd.core.gpus.Work`) is NVML operations the caller executes on one GPU
in order and reports back. Until then it is *pending*: its intended state is already
in the books (instances ``CREATING`` or ``DESTROYING``). When work fails, its
intentions are taken back, and later work that planned on slices it did not free
becomes *stale*: the caller must not execute it (:meth:`WorkBook.is_current`), and its
report is ignored.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Literal

from migd.core.gpus import InstanceStatus, ManagedGpu, ManagedInstance, Work
from migd.core.planner import CreateOp, DestroyOp, Op

#: Called with an instance the undo took out of the books, and the instance that could
#: not be destroyed to make room for it (None: its own create failed).
Lost = Callable[[ManagedInstance, ManagedInstance | None], None]


class WorkBook:
    """Work ids, the pending work and the work a failure made stale."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.pending: dict[int, Work] = {}
        self._stale: set[int] = set()

    def new(
        self,
        gpu: int,
        ops: tuple[Op, ...],
        lease_id: str | None,
        kind: Literal["grant", "teardown"] = "grant",
    ) -> Work:
        """New work; pending until reported when it has operations."""
        work = Work(gpu, ops, lease_id, kind, next(self._ids))
        if ops:
            self.pending[work.work_id] = work
        return work

    def is_current(self, work: Work) -> bool:
        return work.work_id not in self._stale

    def settle(self, work: Work) -> bool:
        """Take reported work off the books; False for stale work (nothing to do)."""
        if work.work_id in self._stale:
            self._stale.discard(work.work_id)
            return False
        self.pending.pop(work.work_id, None)
        return True

    def destroys(self, gpu_index: int, start: int) -> bool:
        """Whether pending work destroys the instance at ``start`` of a GPU."""
        return any(
            work.gpu == gpu_index
            and any(isinstance(op, DestroyOp) and op.start == start for op in work.ops)
            for work in self.pending.values()
        )

    def undo(
        self,
        gpu: ManagedGpu,
        work: Work,
        lost: Lost,
        own: Callable[[], None],
        stale: Callable[[Work], None],
    ) -> None:
        """Take back the intentions of failed (settled) ``work`` on ``gpu``'s books.

        Instances it was destroying come back; the one it was creating goes (``lost``),
        then ``own`` (its own lease's turn). Instances other pending work was creating on
        slices that came back go too (``lost``), and that work becomes stale (``stale``),
        its own destroys taken back. Only this work's intentions are undone: other work
        on the GPU may be in flight.
        """
        # Only MIG GPUs get work with NVML operations; other grants have none to undo.
        instances = gpu.mig.instances if gpu.mig is not None else []
        restored: list[ManagedInstance] = []
        for op in work.ops:
            if isinstance(op, DestroyOp):
                inst = gpu.instance_at(op.start, InstanceStatus.DESTROYING)
                if inst is not None and inst.profile == op.profile:
                    inst.status = InstanceStatus.READY
                    restored.append(inst)
            else:
                inst = gpu.instance_at(op.start, InstanceStatus.CREATING)
                if inst is not None and inst.profile == op.profile:
                    instances.remove(inst)
                    lost(inst, None)
        own()
        for inst in restored:
            units = inst.profile.units_mask(inst.start)
            for other in [
                o
                for o in instances
                if o.status is InstanceStatus.CREATING and o.profile.units_mask(o.start) & units
            ]:
                instances.remove(other)
                for pending in list(self.pending.values()):
                    if pending.gpu == gpu.index and any(
                        isinstance(op, CreateOp) and op.start == other.start for op in pending.ops
                    ):
                        del self.pending[pending.work_id]
                        self._stale.add(pending.work_id)
                        stale(pending)
                        for op in pending.ops:  # its own destroys did not happen either
                            victim = gpu.instance_at(op.start, InstanceStatus.DESTROYING)
                            if isinstance(op, DestroyOp) and victim is not None:
                                victim.status = InstanceStatus.READY
                lost(other, inst)


__all__ = ["Lost", "WorkBook"]
