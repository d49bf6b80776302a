"""The GPUs' use over time: busy, allocated, held and wasted compute slices per GPU.

Each GPU's timeline is a step function of rows ``(from_s, busy, allocated, held,
wasted)``, sampled after every change to the GPU (a run starting, ending or changing
speed, NVML work queued or done); :mod:`migd.policysim.metrics` integrates it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from migd.policysim.nodes import PoolNode
from migd.policysim.runs import Run

Row = tuple[float, float, float, float, float]


class Usage:
    """Every GPU's timeline (``timelines[(node, gpu)]``)."""

    def __init__(self, nodes: Sequence[PoolNode], compute: int) -> None:
        self.nodes = nodes
        self.compute = compute
        self.timelines: dict[tuple[int, int], list[Row]] = {}
        # what a GPU's mode driver says its layout holds and wastes, by its layout_key: a
        # pool has a few hundred layouts and is sampled after every event
        self._slices: dict[Hashable, tuple[int, int]] = {}
        # and per GPU, the last answer with its books' version (NodeScheduler
        # .books_version): most samples follow a change of runs, not of the layout
        self._last: dict[tuple[int, int], tuple[int, int, int]] = {}
        for node in nodes:
            for g in node.scheduler.gpus:
                self.timelines[(node.index, g)] = [(0.0, 0.0, 0.0, 0.0, 0.0)]

    def sample(self, node_index: int, gpu_index: int, runs: Iterable[Run], now_s: float) -> None:
        """Record the GPU's busy, allocated, held and wasted slices from ``now_s`` on."""
        runs = list(runs)
        busy = sum(r.busy for r in runs) * self.compute
        alloc = min(float(self.compute), sum(r.alloc_slices for r in runs))
        sched = self.nodes[node_index].scheduler
        version = sched.books_version(gpu_index)
        last = self._last.get((node_index, gpu_index))
        if last is not None and last[0] == version:
            _, held, wasted = last
        else:
            gpu = sched.gpus[gpu_index]
            ops = sched.mode_ops(gpu)
            key = ops.layout_key(gpu)
            if key is None:
                held, wasted = ops.slice_usage(gpu)
            else:
                found = self._slices.get(key)
                if found is None:
                    found = self._slices[key] = ops.slice_usage(gpu)
                held, wasted = found
            self._last[(node_index, gpu_index)] = (version, held, wasted)
        row = (now_s, busy, alloc, float(held), float(wasted))
        line = self.timelines[(node_index, gpu_index)]
        if line[-1][1:] == row[1:]:
            return
        if line[-1][0] == now_s:
            line[-1] = row
        else:
            line.append(row)
