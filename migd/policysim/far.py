"""FAR: batch scheduling of moldable jobs by repartitioning ([Villarrubia]), pure.

Given a batch of tasks with a runtime for each instance size, FAR plans which
instance every task runs on and when, including the MIG reconfigurations, to
minimise the makespan. Three phases, as in the paper:

1. **Allocation family** (§3.1): the first allocation gives every task the size
   of least area ``s * t(s)``; each next one grows the currently longest task to
   its least-area larger size, until the longest task cannot grow.
2. **Repartitioning list scheduling** (§3.2, Algorithm 1): for each allocation,
   tasks of each size in LPT order are put on the instance of the repartition
   tree (:class:`RepartitionTree`, Figure 4) that frees up first; an instance with
   no tasks of its size left is destroyed and its children take over. On
   A100/H100 the first-4-slice instance first serves 3-slice tasks (its 3g child
   at the same start) before it splits into 2+2. The best allocation wins.
3. **Refinement** (§3.3, Algorithm 2): starting from the leaves whose slices reach
   the makespan, a task of an instance is moved to (or swapped with a shorter task
   of) the same-size instance whose slices free up first; where neither is possible
   the instance's parent is tried, and reaching the root stops
   (:func:`_refine_paper`). migd's variant (:func:`_refine`) instead times every
   candidate exactly and also moves tasks across sizes.

Reconfigurations are serialised per GPU (the driver does it, [Villarrubia] §2.1) and
take [Villarrubia] Table 1 times (:class:`CostModel`); they are included in every
makespan. Timing is computed by one exact event simulation of the tree
(:func:`timeline`), so phase 3's moves are judged on real times.

:meth:`FarSchedule.steps` turns the result into timed create/destroy/run steps;
replayed in time order they are a valid sequence of states of
:mod:`migd.core.states` (``tests/policysim/test_far.py`` checks that).
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from migd.core.costs import CostModel
from migd.core.geometry import Geometry, Profile
from migd.core.states import StateSpace, state_space
from migd.errors import InvalidRequest

# -- the repartition tree ---------------------------------------------------------------------


@dataclass(frozen=True)
class TreeNode:
    """One instance of the repartition tree: a profile at a start on one GPU."""

    index: int
    gpu: int
    profile: Profile
    start: int
    parent: int | None
    children: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.profile.compute_slices

    @property
    def units(self) -> int:
        return self.profile.units_mask(self.start)

    def __str__(self) -> str:
        return f"{self.profile.name}@{self.start}"


@dataclass(frozen=True)
class RepartitionTree:
    """[Villarrubia] Figure 4's tree for a model, one copy per GPU.

    Nodes are the atoms of the ``classic`` profile set; a node's parent is the
    containing atom with the fewest compute slices more than its own. On A100/H100
    that is ``7 -> 4@0 + 3@4``, ``4@0 -> 3@0 -> 2@0 + 2@2``, ``3@4 -> 2@4 + 1@6``,
    ``2@x -> 1@x + 1@x+1``; on A30 ``4 -> 2 + 2 -> 1 + 1``.
    """

    geometry: Geometry
    space: StateSpace
    nodes: tuple[TreeNode, ...]
    roots: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def build(cls, geo: Geometry, gpus: int = 1) -> RepartitionTree:
        """The tree of ``geo`` for ``gpus`` GPUs.

        Raises:
            InvalidRequest: the model's classic profiles do not form a single tree.
        """
        space = state_space(geo, "classic")
        atoms = sorted(space.atoms, key=lambda a: (-a.profile.compute_slices, a.start))
        parents: list[int | None] = []
        for i, atom in enumerate(atoms):
            containing = [
                j
                for j in range(i)
                if atoms[j].units & atom.units == atom.units
                and atoms[j].profile.compute_slices > atom.profile.compute_slices
            ]
            parent = min(
                containing,
                key=lambda j: (atoms[j].profile.compute_slices, atoms[j].units.bit_count()),
                default=None,
            )
            parents.append(parent)
        if sum(p is None for p in parents) != 1:
            raise InvalidRequest(
                f"{geo.model}: the classic profiles do not form one repartition tree",
                hint="FAR supports models whose instances nest (A30, A100, H100, H200, B200)",
            )
        per_gpu = len(atoms)
        nodes: list[TreeNode] = []
        for g in range(gpus):
            for i, atom in enumerate(atoms):
                parent = parents[i]
                kids = tuple(g * per_gpu + k for k, p in enumerate(parents) if p == i)
                nodes.append(
                    TreeNode(
                        g * per_gpu + i,
                        g,
                        atom.profile,
                        atom.start,
                        None if parent is None else g * per_gpu + parent,
                        kids,
                    )
                )
        roots = tuple(n.index for n in nodes if n.parent is None)
        sizes = tuple(sorted({p.compute_slices for p in space.profiles}))
        return cls(geo, space, tuple(nodes), roots, sizes)

    def ancestors(self, index: int) -> list[int]:
        out = []
        parent = self.nodes[index].parent
        while parent is not None:
            out.append(parent)
            parent = self.nodes[parent].parent
        return out

    def subtree(self, index: int) -> list[int]:
        out = [index]
        for child in self.nodes[index].children:
            out.extend(self.subtree(child))
        return out


# -- schedules --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One timed action of an executable schedule.

    ``kind`` is ``create``/``destroy`` (an NVML operation on ``gpu``, from
    ``time_s`` for ``duration_s``) or ``run`` (``task`` on the instance).
    """

    time_s: float
    duration_s: float
    kind: Literal["create", "destroy", "run"]
    gpu: int
    profile: str
    start: int
    task: str = ""

    @property
    def end_s(self) -> float:
        return self.time_s + self.duration_s


@dataclass
class NodeTimes:
    """When one tree node exists and what runs on it."""

    create: tuple[float, float] | None = None
    destroy: tuple[float, float] | None = None
    runs: list[tuple[int, float, float]] = field(default_factory=list)  # task, start, end

    @property
    def end_s(self) -> float:
        return self.runs[-1][2] if self.runs else 0.0


@dataclass(frozen=True)
class FarSchedule:
    """A planned batch: which task runs where and when, with the reconfigurations."""

    tree: RepartitionTree
    tasks: tuple[str, ...]
    times: tuple[Mapping[int, float], ...]
    allocation: tuple[int, ...]  # size per task
    assignment: tuple[tuple[int, ...], ...]  # per tree node: task indices in run order
    makespan_s: float
    node_times: tuple[NodeTimes, ...]
    allocations_tried: int
    refinement_moves: int
    refinement_swaps: int
    phase2_makespan_s: float

    def steps(self) -> list[Step]:
        """Timed create/destroy/run steps, ordered by time (destroys before creates on ties)."""
        out: list[Step] = []
        for node, nt in zip(self.tree.nodes, self.node_times, strict=True):
            # (kind, begin, end, task) of each timed action on this node's instance.
            spans: list[tuple[Literal["create", "destroy", "run"], float, float, str]] = []
            if nt.create is not None:
                spans.append(("create", *nt.create, ""))
            spans += [("run", begin, end, self.tasks[task]) for task, begin, end in nt.runs]
            if nt.destroy is not None:
                spans.append(("destroy", *nt.destroy, ""))
            out += [
                Step(begin, end - begin, kind, node.gpu, node.profile.name, node.start, task)
                for kind, begin, end, task in spans
            ]
        order = {"destroy": 0, "create": 1, "run": 2}
        return sorted(out, key=lambda s: (s.time_s, order[s.kind], s.gpu, s.start))

    @property
    def reconfigurations(self) -> int:
        return sum((nt.create is not None) + (nt.destroy is not None) for nt in self.node_times)


def lower_bound(times: Sequence[Mapping[int, float]], slices: int) -> float:
    """[Villarrubia] §6.4's bound: least total area spread evenly over the GPU's slices."""
    return sum(min(s * t for s, t in tt.items()) for tt in times) / slices


# -- exact timing of a tree assignment ---------------------------------------------------------


def timeline(
    tree: RepartitionTree,
    assignment: Sequence[Sequence[int]],
    times: Sequence[Mapping[int, float]],
    costs: CostModel,
) -> tuple[float, list[NodeTimes]]:
    """Exact times of an assignment: ``(makespan, per-node times)``.

    A node with tasks is created once every ancestor with tasks has been destroyed,
    runs its tasks back to back, and is destroyed after its last one if any
    descendant has tasks. NVML operations of one GPU run one at a time, in the
    order they are requested (ties: tree order).
    """
    nodes = tree.nodes
    n = len(nodes)
    has = [bool(assignment[i]) for i in range(n)]
    below = has[:]  # node or a descendant has tasks
    for i in reversed(range(n)):  # children have larger indices than parents
        parent = nodes[i].parent
        if parent is not None and below[i]:
            below[parent] = True
    out = [NodeTimes() for _ in range(n)]
    create = {s: costs.create_s(s) for s in tree.sizes}
    destroy = {s: costs.destroy_s(s) for s in tree.sizes}
    driver = dict.fromkeys({node.gpu for node in nodes}, 0.0)
    heap: list[tuple[float, int, int, int]] = []  # (request time, seq, op 0=create 1=destroy, node)
    seq = itertools.count()
    makespan = 0.0

    def available(i: int, at: float) -> None:
        if not below[i]:
            return
        if has[i]:
            heapq.heappush(heap, (at, next(seq), 0, i))
        else:
            for child in nodes[i].children:
                available(child, at)

    for root in tree.roots:
        available(root, 0.0)
    while heap:
        at, _, op, i = heapq.heappop(heap)
        node = nodes[i]
        begin = max(at, driver[node.gpu])
        if op == 0:
            end = begin + create[node.size]
            driver[node.gpu] = end
            out[i].create = (begin, end)
            t = end
            for task in assignment[i]:
                run = times[task][node.size]
                out[i].runs.append((task, t, t + run))
                t += run
            makespan = max(makespan, t)
            if any(below[c] for c in node.children):
                heapq.heappush(heap, (t, next(seq), 1, i))
        else:
            end = begin + destroy[node.size]
            driver[node.gpu] = end
            out[i].destroy = (begin, end)
            for child in node.children:
                available(child, end)
    return makespan, out


# -- phase 2 ------------------------------------------------------------------------------------


def _longest_first(tasks: list[int], size: int, times: Sequence[Mapping[int, float]]) -> None:
    """Sort ``tasks`` in place, the longest on an instance of ``size`` first (stable)."""
    tasks.sort(key=lambda t: -times[t][size])


def _phase2(
    tree: RepartitionTree,
    allocation: Sequence[int],
    times: Sequence[Mapping[int, float]],
    costs: CostModel,
) -> tuple[float, list[list[int]]]:
    """Algorithm 1: LPT + list scheduling over the repartition tree."""
    groups: dict[int, list[int]] = {s: [] for s in tree.sizes}
    for task, size in enumerate(allocation):
        groups[size].append(task)
    for size, tasks in groups.items():
        _longest_first(tasks, size, times)
        tasks.reverse()  # pop() takes the longest
    remaining = len(allocation)
    nodes = tree.nodes
    assignment: list[list[int]] = [[] for _ in nodes]
    reconfig_end = dict.fromkeys({node.gpu for node in nodes}, 0.0)
    heap = [(0.0, r) for r in tree.roots]
    heapq.heapify(heap)
    makespan = 0.0
    while heap and remaining:
        end, i = heapq.heappop(heap)
        node = nodes[i]
        size = node.size
        pending = groups[size]
        if pending:
            if not assignment[i]:
                begin = max(reconfig_end[node.gpu], end) + costs.create_s(size)
                reconfig_end[node.gpu] = begin
                end = begin
            task = pending.pop()
            assignment[i].append(task)
            remaining -= 1
            end += times[task][size]
            makespan = max(makespan, end)
            heapq.heappush(heap, (end, i))
        else:
            if assignment[i]:
                reconfig_end[node.gpu] = max(reconfig_end[node.gpu], end) + costs.destroy_s(size)
            for child in node.children:
                heapq.heappush(heap, (end, child))
    if remaining:
        raise AssertionError("repartition tree could not place every task")  # pragma: no cover
    return makespan, assignment


def _phase2_paths(
    tree: RepartitionTree,
    allocation: Sequence[int],
    times: Sequence[Mapping[int, float]],
    costs: CostModel,
    order_by: Literal["time", "size"] = "time",
) -> list[list[int]]:
    """migd's extension of phase 2: LPT over *all* sizes, minimising the longest tree path.

    In a tree schedule a node's tasks run after its ancestors' and before its
    descendants', so (reconfigurations aside) the makespan is the largest sum of
    node loads along a root-to-leaf path. Tasks, longest first whatever their size,
    go to the instance of their size whose heaviest path through it grows least.
    Unlike Algorithm 1 this lets a long 1-slice task claim a leaf early instead of
    waiting for every larger size to finish. ``order_by="size"`` places the largest
    sizes first (LPT within a size), which anticipates the load above the leaves.
    """
    nodes = tree.nodes
    n = len(nodes)
    ancestors = [tree.ancestors(i) for i in range(n)]
    by_size: dict[int, list[int]] = {}
    for node in nodes:
        by_size.setdefault(node.size, []).append(node.index)
    load = [0.0] * n  # tasks + create (+ destroy when not a leaf), once used
    below = [0.0] * n  # heaviest path strictly below a node
    assignment: list[list[int]] = [[] for _ in nodes]
    if order_by == "time":
        order = sorted(range(len(allocation)), key=lambda t: -times[t][allocation[t]])
    else:  # largest instances first (they have the fewest places), LPT within a size
        order = sorted(
            range(len(allocation)), key=lambda t: (-allocation[t], -times[t][allocation[t]])
        )
    for task in order:
        size = allocation[task]
        t = times[task][size]
        best: tuple[float, float, int] | None = None
        for v in by_size[size]:
            extra = t
            if not assignment[v]:
                extra += costs.create_s(size) + (costs.destroy_s(size) if nodes[v].children else 0)
            above = sum(load[a] for a in ancestors[v])
            through = above + load[v] + extra + below[v]
            key = (through, above + load[v] + extra, v)
            if best is None or key < best:
                best = key
        assert best is not None
        v = best[2]
        if not assignment[v]:
            load[v] += costs.create_s(size) + (costs.destroy_s(size) if nodes[v].children else 0)
        load[v] += t
        assignment[v].append(task)
        for a in ancestors[v]:  # nearest first
            below[a] = max(load[c] + below[c] for c in nodes[a].children)
    for node, tasks in zip(nodes, assignment, strict=True):
        _longest_first(tasks, node.size, times)
    return assignment


# -- phase 3 ------------------------------------------------------------------------------------


def _closest_below(values: Sequence[tuple[float, int]], limit: float) -> int | None:
    """Index of the value ``< limit`` closest to ``limit / 2`` (``values`` sorted)."""
    hi = bisect.bisect_left(values, (limit, -1))  # values[:hi] are < limit
    if hi == 0:
        return None
    target = limit / 2
    j = bisect.bisect_left(values, (target, -1), 0, hi)
    options = [k for k in (j - 1, j) if 0 <= k < hi]
    return min(options, key=lambda k: (abs(values[k][0] - target), k))


def _refine_paper(
    tree: RepartitionTree,
    assignment: list[list[int]],
    times: Sequence[Mapping[int, float]],
    costs: CostModel,
    max_iterations: int,
) -> tuple[float, list[NodeTimes], int, int]:
    """Algorithm 2 of [Villarrubia] as published.

    Per iteration: the tree's leaves whose slices reach the makespan ``w`` go into a
    FIFO queue. For each instance ``I`` popped, the other instance ``I^a`` of the same
    size whose slices end first is the alternative; a task of ``I`` shorter than
    ``w - end(I^a)`` and closest to half of it moves there (line 12); failing that, a
    pair ``T_k`` of ``I``, ``T_j`` of ``I^a`` with ``0 < t_k - t_j < w - end(I^a)``,
    difference closest to half of it, is swapped (line 20); failing that too, the
    parent of ``I`` is queued unless it was already (lines 23-24). Popping the root
    stops the algorithm. Slice end times are updated by the moved time only (the
    paper: "for each iteration the algorithm only recomputes the new makespan"); the
    exact times, reconfigurations included, are computed once at the end (line 26), and
    that is the makespan returned, whether or not the moves shortened it.
    """
    nodes = tree.nodes
    makespan, nt = timeline(tree, assignment, times, costs)
    unit_count = max(n.units.bit_length() for n in nodes)
    units = [[u for u in range(unit_count) if n.units >> u & 1] for n in nodes]
    # slice (gpu, unit) -> when its last task ends
    slice_end: dict[tuple[int, int], float] = {}
    for node, x in zip(nodes, nt, strict=True):
        for u in units[node.index]:
            key = (node.gpu, u)
            slice_end[key] = max(slice_end.get(key, 0.0), x.end_s)
    same_size: dict[int, list[int]] = {}
    for node in nodes:
        same_size.setdefault(node.size, []).append(node.index)
    leaves = [n.index for n in nodes if not n.children]

    def end(i: int) -> float:
        return max(slice_end[(nodes[i].gpu, u)] for u in units[i])

    def shift(i: int, dt: float) -> None:
        for u in units[i]:
            slice_end[(nodes[i].gpu, u)] += dt

    def sorted_tasks(i: int) -> list[tuple[float, int]]:
        size = nodes[i].size
        return sorted((times[t][size], t) for t in assignment[i])

    w = max(slice_end.values(), default=0.0)
    moves = swaps = 0
    stop = False
    for _ in range(max_iterations):
        if stop:
            break
        queue = collections.deque(i for i in leaves if end(i) >= w - 1e-9)
        queued = set(queue)
        while queue:
            i = queue.popleft()
            node = nodes[i]
            if node.parent is None:
                stop = True
                break
            size = node.size
            alternatives = [a for a in same_size[size] if a != i]
            done = False
            if alternatives and assignment[i]:
                a = min(alternatives, key=lambda k: (end(k), k))
                margin = w - end(a)
                mine = sorted_tasks(i)
                pick = _closest_below(mine, margin)
                if pick is not None:
                    t_time, task = mine[pick]
                    assignment[i].remove(task)
                    assignment[a].append(task)
                    shift(i, -t_time)
                    shift(a, t_time)
                    moves += 1
                    done = True
                else:
                    target = margin / 2
                    best: tuple[float, int, int, float] | None = None
                    theirs = sorted_tasks(a)
                    for tk_time, tk in mine:
                        for tj_time, tj in theirs:
                            diff = tk_time - tj_time
                            if 0 < diff < margin:
                                cand = (abs(diff - target), tk, tj, diff)
                                if best is None or cand < best:
                                    best = cand
                    if best is not None:
                        _, tk, tj, diff = best
                        assignment[i].remove(tk)
                        assignment[a].remove(tj)
                        assignment[i].append(tj)
                        assignment[a].append(tk)
                        shift(i, -diff)
                        shift(a, diff)
                        swaps += 1
                        done = True
            if not done and node.parent not in queued:
                queue.append(node.parent)
                queued.add(node.parent)
        w = max(slice_end.values(), default=0.0)
    for node, tasks in zip(nodes, assignment, strict=True):
        _longest_first(tasks, node.size, times)
    makespan, nt = timeline(tree, assignment, times, costs)
    return makespan, nt, moves, swaps


def _refine(
    tree: RepartitionTree,
    assignment: list[list[int]],
    times: Sequence[Mapping[int, float]],
    costs: CostModel,
    max_iterations: int,
    max_candidates: int = 24,
) -> tuple[float, list[NodeTimes], int, int]:
    """migd's refinement: moves and swaps judged on exact times, kept only if they help.

    Like Algorithm 2 it moves or swaps a task of an instance that ends last onto the
    same-size instance with room; it also moves a critical task to an instance of
    another size (it is moldable, its time there is known) and moves tasks off the
    critical instance's ancestors (which delay its creation; Algorithm 2 reaches them
    by queueing parents). Each candidate is timed exactly (:func:`timeline`) and the
    first that shortens the makespan is kept.
    """
    nodes = tree.nodes
    overlapping = [
        [j.index for j in nodes if j.gpu == node.gpu and j.units & node.units] for node in nodes
    ]
    ancestors = [tree.ancestors(n.index) for n in nodes]
    related = [set(ancestors[n.index]) | set(tree.subtree(n.index)) for n in nodes]
    makespan, nt = timeline(tree, assignment, times, costs)
    moves = swaps = 0
    for _ in range(max_iterations):
        last_end = [x.end_s for x in nt]
        slice_end = [max(last_end[j] for j in overlapping[a]) for a in range(len(nodes))]
        critical = [
            i for i in range(len(nodes)) if assignment[i] and last_end[i] >= makespan - 1e-9
        ]
        # (estimated finish, kind, task, from, to, other task): the paper's moves and swaps
        # between same-size instances, plus moves of a critical task to an instance of
        # another size (it is moldable: its time there is known).
        candidates: list[tuple[float, str, int, int, int, int]] = []
        for i in critical:
            size = nodes[i].size
            for a in range(len(nodes)):
                if a in related[i]:
                    continue
                other = nodes[a].size
                margin = makespan - slice_end[a]
                if margin <= 1e-9:
                    continue
                for task in assignment[i]:
                    t = times[task][other]
                    if t < margin:
                        score = abs(t - margin / 2) if other == size else t - margin
                        candidates.append((score, "move", task, i, a, -1))
                # tasks of an ancestor delay the critical instance's creation
                for anc in ancestors[i]:
                    if a in related[anc]:
                        continue
                    for task in assignment[anc]:
                        t = times[task][other]
                        if t < margin:
                            candidates.append((t - margin, "move", task, anc, a, -1))
                if other == size:
                    for tk in assignment[i]:
                        for tj in assignment[a]:
                            diff = times[tk][size] - times[tj][size]
                            if 0 < diff < margin:
                                candidates.append((abs(diff - margin / 2), "swap", tk, i, a, tj))
        improved = False
        for _score, kind, tk, i, a, tj in sorted(candidates)[:max_candidates]:
            trial = [list(x) for x in assignment]
            trial[i].remove(tk)
            if kind == "swap":
                trial[a].remove(tj)
                trial[i].append(tj)
                _longest_first(trial[i], nodes[i].size, times)
            trial[a].append(tk)
            _longest_first(trial[a], nodes[a].size, times)
            new_makespan, new_nt = timeline(tree, trial, times, costs)
            if new_makespan < makespan - 1e-9:
                assignment[:] = trial
                makespan, nt = new_makespan, new_nt
                moves += kind == "move"
                swaps += kind == "swap"
                improved = True
                break
        if not improved:
            break
    return makespan, nt, moves, swaps


# -- the planner ----------------------------------------------------------------------------------


def _least_area(tt: Mapping[int, float], sizes: Sequence[int]) -> int:
    return min(sizes, key=lambda s: (s * tt[s], s))


def plan_batch(
    tasks: Sequence[tuple[str, Mapping[int, float]]],
    geo: Geometry,
    *,
    gpus: int = 1,
    costs: CostModel | None = None,
    refine: bool = True,
    refine_candidates: int | None = None,
    max_refine_iterations: int = 50,
    variant: Literal["paper", "migd"] = "migd",
) -> FarSchedule:
    """Plan a batch with FAR.

    Args:
        tasks: ``(name, {size: seconds})`` for every task; every size of the model's
            classic profile set (A100: 1, 2, 3, 4, 7 compute slices) must be given.
        geo: the GPU model.
        gpus: GPUs of that model (one tree each, [Villarrubia] §3.2).
        costs: reconfiguration times; default [Villarrubia] Table 1 for the model.
        refine: run phase 3.
        refine_candidates: how many of the best phase-2 allocations phase 3 refines
            (default: 1 for the paper variant, as FAR does; 8 for migd's, 1 above 40 tasks).
        max_refine_iterations: stop refining after this many improvements.
        variant: ``paper``: FAR as published, Algorithm 1 then Algorithm 2
            (:func:`_refine_paper`) on the best allocation; ``migd`` (default) adds
            :func:`_phase2_paths` as a second phase-2 candidate per allocation and
            refines the best few with :func:`_refine` (exactly timed moves and swaps,
            across sizes and off the critical instance's ancestors); the paper
            variant's schedule is kept when it happens to be shorter.

    Raises:
        InvalidRequest: no tasks, or a task lacks a time for some size.
    """
    if not tasks:
        raise InvalidRequest("FAR needs at least one task")
    tree = RepartitionTree.build(geo, gpus)
    costs = costs or CostModel.for_model(geo.model)
    sizes = tree.sizes
    names = tuple(name for name, _ in tasks)
    times = tuple({s: float(tt[s]) for s in sizes} for _, tt in tasks if set(sizes) <= set(tt))
    if len(times) != len(tasks):
        missing = next(name for name, tt in tasks if not set(sizes) <= set(tt))
        raise InvalidRequest(
            f"task {missing} has no time for every instance size",
            hint=f"give seconds for sizes {', '.join(map(str, sizes))}",
        )
    slices = geo.compute_slices * gpus
    if refine_candidates is None:
        refine_candidates = 1 if variant == "paper" else (8 if len(tasks) <= 40 else 1)
    # large batches pack well anyway (rho ~1.01 at 100 tasks); keep their planning cheap
    move_candidates = 24 if len(tasks) <= 40 else 6

    # phase 1: the allocation family, with phase 2 on each (pruned by a lower bound)
    allocation = [_least_area(tt, sizes) for tt in times]
    area = sum(tt[s] * s for tt, s in zip(times, allocation, strict=True))
    results: list[tuple[float, int, tuple[int, ...], list[list[int]]]] = []
    best = float("inf")
    tried = 0
    for k in itertools.count():
        lengths = [tt[s] for tt, s in zip(times, allocation, strict=True)]
        h_max = max(lengths)
        if area / slices >= best:
            break  # areas only grow along the family
        if max(area / slices, h_max) < best or len(results) < refine_candidates:
            makespan, assignment = _phase2(tree, allocation, times, costs)
            tried += 1
            results.append((makespan, k, tuple(allocation), assignment))
            best = min(best, makespan)
            if variant == "migd":
                for order_by in ("time", "size"):
                    greedy = _phase2_paths(tree, allocation, times, costs, order_by)
                    makespan, _ = timeline(tree, greedy, times, costs)
                    results.append((makespan, k, tuple(allocation), greedy))
                    best = min(best, makespan)
        longest = lengths.index(h_max)
        larger = [s for s in sizes if s > allocation[longest]]
        if not larger:
            break
        new = min(larger, key=lambda s: (s * times[longest][s], s))
        area += (
            new * times[longest][new] - allocation[longest] * times[longest][allocation[longest]]
        )
        allocation[longest] = new
    results.sort(key=lambda r: (r[0], r[1]))
    phase2_best = results[0][0]

    # phase 3: refine the best few
    chosen: tuple[float, tuple[int, ...], list[list[int]], list[NodeTimes], int, int] | None = None
    for makespan2, _, alloc, assignment in results[: max(1, refine_candidates if refine else 1)]:
        work = [list(x) for x in assignment]
        if refine and variant == "paper":
            makespan, nt, moves, swaps = _refine_paper(
                tree, work, times, costs, max_refine_iterations
            )
        elif refine:
            makespan, nt, moves, swaps = _refine(
                tree, work, times, costs, max_refine_iterations, move_candidates
            )
        else:
            makespan, nt = timeline(tree, work, times, costs)
            moves = swaps = 0
        del makespan2
        if chosen is None or makespan < chosen[0] - 1e-9:
            chosen = (makespan, alloc, work, nt, moves, swaps)
    assert chosen is not None
    makespan, alloc, work, nt, moves, swaps = chosen
    if variant == "migd" and refine:
        # the extensions search more, not everywhere: keep the paper's answer when it wins
        paper = plan_batch(
            tasks,
            geo,
            gpus=gpus,
            costs=costs,
            max_refine_iterations=max_refine_iterations,
            variant="paper",
        )
        if paper.makespan_s < makespan - 1e-9:
            return paper
    return FarSchedule(
        tree=tree,
        tasks=names,
        times=times,
        allocation=alloc,
        assignment=tuple(tuple(x) for x in work),
        makespan_s=makespan,
        node_times=tuple(nt),
        allocations_tried=tried,
        refinement_moves=moves,
        refinement_swaps=swaps,
        phase2_makespan_s=phase2_best,
    )


def validate_steps(schedule: FarSchedule) -> None:
    """Replay the steps on the state machine; raise if any state is invalid.

    Checks that every create/destroy is a legal transition of
    :class:`migd.core.states.StateSpace` (instances exist from the start of their
    creation to the end of their destruction), NVML operations of a GPU never
    overlap, every run happens on a created instance that is not being destroyed,
    and runs on one instance do not overlap.

    Raises:
        AssertionError: with what is wrong.
        IllegalTransition: an operation the state machine refuses.
    """
    space = schedule.tree.space
    steps = schedule.steps()
    keys: dict[int, int] = {}
    driver_free: dict[int, float] = {}
    ready: dict[tuple[int, int], float] = {}  # (gpu, start) -> created at
    busy_until: dict[tuple[int, int], float] = {}
    # destroys release at their end: process events in time order
    events: list[tuple[float, int, Step]] = []
    for s in steps:
        if s.kind == "destroy":
            events.append((s.end_s, 0, s))
        elif s.kind == "create":
            events.append((s.time_s, 1, s))
        else:
            events.append((s.time_s, 2, s))
    eps = 1e-9
    for s in steps:
        if s.kind != "run":
            free = driver_free.get(s.gpu, 0.0)
            assert s.time_s >= free - eps, f"GPU {s.gpu}: {s.kind} {s.profile}@{s.start} overlaps"
            driver_free[s.gpu] = s.end_s
    for _, _, s in sorted(events, key=lambda e: (e[0], e[1])):
        key = keys.get(s.gpu, 0)
        place = (s.gpu, s.start)
        if s.kind == "create":
            keys[s.gpu] = space.allocate(key, s.profile, s.start)
            ready[place] = s.end_s
        elif s.kind == "destroy":
            assert busy_until.get(place, 0.0) <= s.time_s + eps, f"{s.profile}@{s.start} busy"
            keys[s.gpu] = space.release(key, s.profile, s.start)
            ready.pop(place, None)
        else:
            assert place in ready and space.atom(s.profile, s.start).index in {
                a.index for a in space.placements(key)
            }, f"{s.task} runs on {s.profile}@{s.start} which does not exist"
            assert s.time_s >= ready[place] - eps, f"{s.task} starts before its instance exists"
            assert s.time_s >= busy_until.get(place, 0.0) - eps, f"{s.task} overlaps another task"
            busy_until[place] = s.end_s
