"""The simulated NVML driver: the scheduler's work, timed, and the instances it leaves.

Every :class:`~migd.core.gpus.Work` runs on its GPU's driver: operations one after
another per GPU (the driver serialises them, [Villarrubia] §2.1), each taking
[Villarrubia] Table 1 time (:class:`~migd.core.costs.CostModel`). The driver counts the
reconfigurations and keeps the MIG instances' lives for the slice map
(:class:`~migd.policysim.records.Span`).
"""

from __future__ import annotations

import itertools

from migd.core.costs import CostModel
from migd.core.gpu_modes import Created
from migd.core.gpus import Work
from migd.core.planner import CreateOp, DestroyOp, Op
from migd.policysim.records import ReconfigStats, Span

#: A work's operations, each with the simulated time it finishes.
Timed = tuple[tuple[Op, float], ...]


class NvmlDriver:
    """Every simulated GPU's driver.

    Args:
        costs: seconds per create and destroy.
        spans: the slice map the instances' spans go to (shared with the job runs',
            so that the map keeps the order events happened in).
    """

    def __init__(self, costs: CostModel, spans: list[Span]) -> None:
        self.costs = costs
        self.spans = spans
        self.reconfig = ReconfigStats()
        self._free: dict[tuple[int, int], float] = {}  # (node, GPU) -> driver idle from
        self._gi = itertools.count(1)
        self._open: dict[tuple[int, int, int], tuple[str, int, float]] = {}

    def new_instance(
        self, node: int, gpu: int, start: int, profile: str, units: int, at: float
    ) -> int:
        """An instance exists from ``at`` (created, or pre-created by a static layout):
        its GPU instance id, numbered across the pool."""
        n = next(self._gi)
        self._open[(node, gpu, start)] = (profile, units, at)
        return n

    def _cost(self, op: Op) -> float:
        if isinstance(op, CreateOp):
            return self.costs.create_s(op.profile.compute_slices)
        return self.costs.destroy_s(op.profile.compute_slices)

    def execute(self, node: int, work: Work, now_s: float) -> tuple[float, Timed] | None:
        """Queue ``work`` on its GPU's driver: when it is done, and each operation's end;
        None for work without NVML operations (a plain grant)."""
        if not work.ops:
            return None
        t = max(now_s, self._free.get((node, work.gpu), 0.0))
        timed: list[tuple[Op, float]] = []
        for op in work.ops:
            cost = self._cost(op)
            t += cost
            timed.append((op, t))
            if isinstance(op, CreateOp):
                self.reconfig.creates += 1
                self.reconfig.create_s += cost
            else:
                self.reconfig.destroys += 1
                self.reconfig.destroy_s += cost
        self.reconfig.works += 1
        self._free[(node, work.gpu)] = t
        return t, tuple(timed)

    def done(self, node: int, work: Work, timed: Timed) -> Created:
        """The work is done: destroyed instances leave the slice map, created ones enter
        it; what NVML would report for each created instance (``work_done``'s)."""
        created: dict[int, tuple[int | None, str | None, int]] = {}
        for op, at in timed:
            if isinstance(op, DestroyOp):
                opened = self._open.pop((node, work.gpu, op.start), None)
                if opened is not None:
                    name, units, since = opened
                    self.spans.append(
                        Span(
                            node,
                            work.gpu,
                            name,
                            op.start,
                            units,
                            since,
                            at,
                            "instance",
                            "destroyed",
                        )
                    )
            else:
                prof = op.profile
                n = self.new_instance(node, work.gpu, op.start, prof.name, prof.memory_slices, at)
                created[op.start] = (n, f"MIG-sim-{node}-{work.gpu}-{n}", prof.memory_mib)
        return created

    def close(self, now_s: float) -> None:
        """The end of the simulation: instances still there end on the map as ``open``."""
        for (node, gpu, start), (name, units, since) in self._open.items():
            self.spans.append(Span(node, gpu, name, start, units, since, now_s, "instance", "open"))
        self._open.clear()
