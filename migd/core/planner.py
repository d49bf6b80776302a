"""Placement planner: right-size a request, pick a GPU and a start, plan fission/fusion.

Pure: the input is a snapshot of each GPU (:class:`GpuView`), the output a
:class:`Decision` that names the GPU, the instance the job gets and the ordered
NVML operations (destroy idle instances, then create) that produce it, with an
explanation for logs and ``migctl explain``.

On one GPU the planner prefers, in order ([MIG-HT], scheme B):

1. **reuse** an idle instance that satisfies the request (no NVML work): the right
   profile, or one with as much memory and compute on no more memory slices (an idle
   ``4g.20gb`` serves a ``3g.20gb`` request: see *compute upsizing* below);
2. **create** the profile in free slices, at the start whose successor state keeps
   the most futures open (highest reachability, or demand-weighted reachability);
3. **repartition** (fission/fusion): destroy the cheapest set of *idle* instances
   that frees a legal start ([Villarrubia] Table 1 costs), then create; ties go to the
   result with the highest reachability. Busy instances are never touched.

*Compute upsizing* (``PlannerPolicy.upsize_compute``): a profile with the same
memory slices and more compute replaces the chosen one when the extra compute
would be stranded anyway (``3g.20gb`` at start 0 becomes ``4g.20gb``). The job
gets the slice for free; reuse accepts the bigger instance later, so upsizing
never makes the planner destroy and recreate the same instance.

Across the GPUs of a node (mixed models allowed) the ``rules`` choice first
prefers reusing an idle instance anywhere over NVML work (``reuse_first``), then
follows [Turkkan]'s rule-based placement: the GPU with the highest joint slice
utilisation of *busy* instances after placement (so empty GPUs stay empty for
full-GPU jobs), then the least NVML work (create, repartition; cost), then the
fewest wasted slices, then the most futures kept open. ``first-fit`` (lowest
index, driver default order) is kept for comparison.

A request that names a profile (``PartitionRequest.profile``) is sized per GPU: a
GPU whose model lacks that profile is skipped with the reason in the explanation;
only a node where no GPU knows the name refuses it as unknown.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cached_property
from itertools import combinations
from typing import Any, Literal

from migd.core.costs import CostModel
from migd.core.geometry import Geometry, Profile, Variant
from migd.core.states import EMPTY, Atom, StateKey, StateSpace, describe
from migd.errors import (
    InvalidRequest,
    MigdError,
    NoCapacity,
    RequestTooLarge,
    UnknownProfile,
)


class PlacementRule(StrEnum):
    """How a start is chosen among the legal ones on one GPU."""

    REACHABILITY = "reachability"  # [MIG-HT]: most full layouts still reachable
    WEIGHTED = "weighted"  # reachability weighted by observed profile demand
    DRIVER = "driver"  # first legal start in the driver's default order (first-fit)
    MAX_CC = "max-cc"  # [Siavashi] MCC: most placements possible right after


class GpuChoice(StrEnum):
    RULES = "rules"  # [Turkkan] rule-based
    FIRST_FIT = "first-fit"


@dataclass(frozen=True)
class PlannerPolicy:
    placement: PlacementRule = PlacementRule.REACHABILITY
    gpu_choice: GpuChoice = GpuChoice.RULES
    fission_fusion: bool = True
    reuse_idle: bool = True
    allow_create: bool = True  # False: static layouts, only existing idle instances are used
    reuse_larger_idle: bool = False  # take a bigger idle instance when nothing else works
    upsize_compute: bool = True  # 3g@0 -> 4g@0 when the extra compute slice is stranded anyway
    reuse_first: bool = True  # rules: an idle instance on any GPU beats NVML work elsewhere
    # model -> profile ID -> weight, for WEIGHTED (profile IDs mean different profiles on
    # different models, so the mix is per model); a model without a mix uses reachability
    demand: Mapping[str, Mapping[int, float]] | None = None
    costs: Mapping[str, CostModel] | None = None  # model -> costs; default [Villarrubia] Table 1


@dataclass(frozen=True, slots=True)
class Instance:
    """An existing GPU instance as the planner sees it."""

    profile: Profile
    start: int
    busy: bool
    ref: str = ""  # backend identity, e.g. "gi:3", for explanations

    def __str__(self) -> str:
        return f"{self.profile.name}@{self.start}"


@dataclass(frozen=True)
class GpuView:
    """Snapshot of one MIG-enabled GPU for planning."""

    index: int
    space: StateSpace
    instances: tuple[Instance, ...] = ()
    available: bool = True  # false while drained, unhealthy or out of MIG mode
    unavailable_reason: str = ""

    @property
    def geometry(self) -> Geometry:
        return self.space.geometry

    @cached_property
    def key(self) -> StateKey:
        return self.space.key_of((i.profile, i.start) for i in self.instances)

    @cached_property
    def layout(self) -> tuple[tuple[int, int, bool], ...]:
        """What the plan memo keys on: each instance's (profile id, start, busy), in
        order (worked out once per view; a node's cached views are planned again for
        every request)."""
        return tuple((i.profile.profile_id, i.start, i.busy) for i in self.instances)

    @cached_property
    def placed(self) -> tuple[tuple[Atom, Instance], ...]:
        """Each instance with its atom in this space."""
        return tuple((self.space.atom(i.profile, i.start), i) for i in self.instances)


@dataclass(frozen=True, slots=True)
class CreateOp:
    profile: Profile
    start: int
    kind: Literal["create"] = "create"

    def __str__(self) -> str:
        return f"create {self.profile.name}@{self.start}"


@dataclass(frozen=True, slots=True)
class DestroyOp:
    profile: Profile
    start: int
    kind: Literal["destroy"] = "destroy"

    def __str__(self) -> str:
        return f"destroy {self.profile.name}@{self.start}"


Op = CreateOp | DestroyOp


@dataclass(frozen=True, slots=True)
class Alternative:
    start: int
    score: float
    reachability: int
    destroys: tuple[str, ...] = ()
    cost_s: float = 0.0


@dataclass(frozen=True)
class Decision:
    """Where a request goes and how to get there."""

    action: Literal["reuse", "create", "repartition"]
    gpu: int
    model: str
    profile: Profile
    start: int
    ops: tuple[Op, ...]
    cost_s: float
    before_key: StateKey
    result_key: StateKey
    reachability_after: int
    score_after: float
    utilisation_after: float
    busy_utilisation_after: float  # counting only instances with work (and the new one)
    wasted_after: int
    alternatives: tuple[Alternative, ...] = ()
    other_gpus: tuple[dict[str, Any], ...] = ()
    rule: str = ""
    space: StateSpace | None = field(default=None, compare=False, repr=False)

    # Described on demand: a node plan builds a candidate per GPU, only one is shown.
    @property
    def state_before(self) -> str:
        return describe(self.space, self.before_key) if self.space is not None else ""

    @property
    def state_after(self) -> str:
        return describe(self.space, self.result_key) if self.space is not None else ""

    @property
    def reason(self) -> str:
        verb = {
            "reuse": "reuse idle",
            "create": "create",
            "repartition": "repartition to create",
        }[self.action]
        text = (
            f"GPU {self.gpu} ({self.model}): {verb} {self.profile.name}@{self.start}; "
            f"reachability after {self.reachability_after}"
        )
        if self.action == "repartition":
            text += f"; ops: {', '.join(map(str, self.ops))} ({self.cost_s:.2f}s)"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "gpu": self.gpu,
            "model": self.model,
            "profile": self.profile.name,
            "profile_id": self.profile.profile_id,
            "start": self.start,
            "ops": [str(op) for op in self.ops],
            "cost_s": round(self.cost_s, 3),
            "state_before": self.state_before,
            "state_after": self.state_after,
            "reachability_after": self.reachability_after,
            "score_after": round(self.score_after, 4),
            "utilisation_after": round(self.utilisation_after, 4),
            "busy_utilisation_after": round(self.busy_utilisation_after, 4),
            "wasted_slices_after": self.wasted_after,
            "rule": self.rule,
            "alternatives": [
                {
                    "start": a.start,
                    "score": round(a.score, 4),
                    "reachability": a.reachability,
                    "destroys": list(a.destroys),
                    "cost_s": round(a.cost_s, 3),
                }
                for a in self.alternatives
            ],
            "other_gpus": list(self.other_gpus),
            "reason": self.reason,
        }


# -- right-sizing ---------------------------------------------------------------------------


def right_size(
    profiles: Sequence[Profile], memory_mib: int, min_compute: int = 0
) -> Profile | None:
    """The tightest profile with at least ``memory_mib`` and ``min_compute`` slices.

    Tightest means least memory, then least compute, then fewest placement units: a
    10 GB request on A100-40GB gets ``1g.10gb`` rather than ``2g.10gb`` unless it
    asks for two compute slices. ``None`` when no profile is big enough.
    """
    fitting = [
        p for p in profiles if p.memory_mib >= memory_mib and p.compute_slices >= min_compute
    ]
    if not fitting:
        return None
    return min(fitting, key=lambda p: (p.memory_mib, p.compute_slices, p.memory_slices, p.name))


def next_larger(
    profiles: Sequence[Profile],
    current: Profile,
    *,
    peak_mib: int = 0,
    growth_factor: float = 0.0,
) -> Profile | None:
    """The profile to retry an out-of-memory job on, or ``None`` at the top.

    The next profile with strictly more memory than ``current`` and at least
    ``max(peak_mib, growth_factor * current memory)``, never with less compute.
    """
    need = max(current.memory_mib + 1, peak_mib, int(growth_factor * current.memory_mib))
    return right_size(
        [p for p in profiles if p.compute_slices >= current.compute_slices],
        need,
    ) or right_size(profiles, need)


# -- scoring --------------------------------------------------------------------------------


Scorer = Callable[[StateSpace, StateKey], float]


def scorer_for(policy: PlannerPolicy) -> Scorer:
    rule = policy.placement
    if rule is PlacementRule.WEIGHTED and policy.demand:
        mixes = {model: dict(mix) for model, mix in policy.demand.items() if mix}

        def weighted(space: StateSpace, key: StateKey) -> float:
            mix = mixes.get(space.geometry.model)
            if not mix:  # nothing known about this model's demand: plain reachability
                return float(space.reachability(key))
            return space.weighted_reachability(key, mix)

        return weighted
    if rule is PlacementRule.DRIVER:
        return lambda space, key: 0.0
    if rule is PlacementRule.MAX_CC:
        return lambda space, key: float(space.configuration_capability(key))
    return lambda space, key: float(space.reachability(key))


def _order_index(profile: Profile, start: int) -> int:
    try:
        return profile.default_order.index(start)
    except ValueError:
        return len(profile.default_order) + start


def utilisation(space: StateSpace, key: StateKey) -> float:
    """[Turkkan]'s joint slice utilisation (used memory + compute) / (total memory + compute)."""
    geo = space.geometry
    return space.info(key).used_slices / (geo.units + geo.compute_slices)


def _costs(policy: PlannerPolicy, model: str) -> CostModel:
    return (policy.costs or {}).get(model) or CostModel.for_model(model)


def satisfies(have: Profile, want: Profile, *, have_variant: Profile | None = None) -> bool:
    """Whether an instance of ``have`` can serve a request right-sized to ``want``.

    At least the memory and compute, on no more memory slices (so it strands nothing
    the right-sized instance would not), and the media engines a ``+me`` request
    needs. ``have_variant`` is the instance's own profile when ``have`` is its
    stand-in in a smaller profile set (a ``+me`` instance under ``standard``).
    """
    variant = (have_variant or have).variant
    return (
        have.memory_slices <= want.memory_slices
        and have.memory_mib >= want.memory_mib
        and have.compute_slices >= want.compute_slices
        and (want.variant is Variant.BASE or variant is want.variant)
    )


# -- one GPU --------------------------------------------------------------------------------


def plan_on_gpu(
    view: GpuView, profile: Profile, policy: PlannerPolicy = PlannerPolicy()
) -> Decision | None:
    """The best way to get ``profile`` on this GPU, or ``None`` if it cannot be done now."""
    return _memo.plan(view, view.space.member(profile), policy, scorer_for(policy))


class _PlanMemo:
    """One GPU's plan, memoised by what decides it.

    A plan is a pure function of the GPU's state space, its instances as the planner
    sees them (profile, start, busy; in order), the profile asked for and the planner
    policy: not of the GPU's index, which the decision only names. A node plans every
    GPU for every request, and a pool of thousands of GPUs has a few hundred distinct
    layouts, so most plans were made before (the pool simulator, issue 26 §6). The memo
    is bounded (free-form layouts cannot grow it without end) and holds only policies
    that hash (a demand-weighted policy carries a mapping, and is planned afresh).
    """

    LIMIT = 20_000

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], tuple[StateSpace, Decision | None]] = {}

    def plan(
        self, view: GpuView, prof: Profile, policy: PlannerPolicy, score: Scorer
    ) -> Decision | None:
        try:
            key = (
                id(view.space),
                view.layout,
                prof.profile_id,
                policy,
            )
            hit = self._plans.get(key)
        except TypeError:  # an unhashable policy (a demand mix): no memo
            return _plan_on_gpu(view, prof, policy, score)
        if hit is not None and hit[0] is view.space:
            decision = hit[1]
            if decision is None or decision.gpu == view.index:
                return decision
            # the same plan for another GPU: made once per GPU index, then kept too
            mine = self._plans.get((*key, view.index))
            if mine is not None and mine[0] is view.space:
                return mine[1]
            decision = replace(decision, gpu=view.index)
            self._keep((*key, view.index), view.space, decision)
            return decision
        decision = _plan_on_gpu(view, prof, policy, score)
        self._keep(key, view.space, decision)
        return decision

    def _keep(self, key: tuple[Any, ...], space: StateSpace, decision: Decision | None) -> None:
        if len(self._plans) >= self.LIMIT:
            self._plans.clear()
        # the space is kept with the plan: its id is only this space's while it lives
        self._plans[key] = (space, decision)


_memo = _PlanMemo()


def _plan_on_gpu(
    view: GpuView, prof: Profile, policy: PlannerPolicy, score: Scorer
) -> Decision | None:
    space = view.space
    key = view.key
    costs = _costs(policy, view.geometry.model)

    if policy.reuse_idle:
        fitting = [
            (p, i)
            for i in view.instances
            if not i.busy and satisfies(p := space.member(i.profile), prof, have_variant=i.profile)
        ]
        if fitting:
            # the tightest instance first (the exact profile), then the driver's order
            have, chosen = min(
                fitting,
                key=lambda pair: (
                    pair[0].compute_slices,
                    pair[0].memory_mib,
                    pair[1].profile.variant is not prof.variant,
                    _order_index(pair[0], pair[1].start),
                    pair[1].start,
                ),
            )
            return _decision(
                view, "reuse", have, chosen.start, (), 0.0, key, key, score, (), policy
            )

    if not policy.allow_create:
        return None
    starts = space.legal_starts(key, prof)
    if starts:
        alternatives = []
        for start in starts:
            after = space.allocate(key, prof, start)
            alternatives.append(
                (Alternative(start, score(space, after), space.reachability(after)), after)
            )
        best, after = min(
            alternatives, key=lambda pair: (-pair[0].score, _order_index(prof, pair[0].start))
        )
        created = _upsized(space, key, prof, best.start, score) if policy.upsize_compute else prof
        if created is not prof:
            after = space.allocate(key, created, best.start)
        ops: tuple[Op, ...] = (CreateOp(created, best.start),)
        return _decision(
            view,
            "create",
            created,
            best.start,
            ops,
            costs.create_s(created.compute_slices),
            key,
            after,
            score,
            tuple(a for a, _ in alternatives),
            policy,
        )

    if policy.reuse_larger_idle:
        bigger = [
            i
            for i in view.instances
            if not i.busy
            and space.member(i.profile).memory_mib >= prof.memory_mib
            and space.member(i.profile).compute_slices >= prof.compute_slices
        ]
        if bigger:
            chosen = min(
                bigger, key=lambda i: (i.profile.memory_mib, i.profile.compute_slices, i.start)
            )
            bigger_prof = space.member(chosen.profile)
            return _decision(
                view, "reuse", bigger_prof, chosen.start, (), 0.0, key, key, score, (), policy
            )
    if policy.fission_fusion:
        return _plan_repartition(view, prof, key, score, costs, policy)
    return None


def _upsized(space: StateSpace, key: StateKey, prof: Profile, start: int, score: Scorer) -> Profile:
    """A profile with the same memory and more compute at the same start, if it is free.

    3g.20gb at start 0 strands the fourth compute slice of units 0-3 ([Turkkan]'s compute
    wastage); 4g.20gb there uses it and keeps every future open. Taken only when the
    bigger profile is legal there, loses no reachability (or weighted score) and wastes
    fewer compute slices. Reuse accepts the bigger instance for the smaller profile
    (:func:`satisfies`), so it is not torn down when the next such request comes.
    """
    base_after = space.allocate(key, prof, start)
    base_waste = space.wasted_slices(base_after)[0]
    base_score = score(space, base_after)
    best = prof
    for other in space.profiles:
        if (
            other.memory_slices != prof.memory_slices
            or other.memory_mib < prof.memory_mib
            or other.compute_slices <= best.compute_slices
            or other.variant is not prof.variant
            or start not in other.starts
        ):
            continue
        atom = space.atom(other, start)
        if not space.can_allocate(key, atom):
            continue
        after = key | (1 << atom.index)
        if space.wasted_slices(after)[0] < base_waste and score(space, after) >= base_score:
            best = other
    return best


def _plan_repartition(
    view: GpuView,
    prof: Profile,
    key: StateKey,
    score: Scorer,
    costs: CostModel,
    policy: PlannerPolicy,
) -> Decision | None:
    space = view.space
    placed = view.placed
    options: list[tuple[float, float, int, Alternative, tuple[Instance, ...], StateKey]] = []
    for atom in space.atoms_of(prof):
        blockers = [(a, i) for a, i in placed if a.units & atom.units]
        if any(i.busy for _, i in blockers):
            continue
        destroyed = _minimal_destroy_set(space, key, atom, blockers, placed, costs, score)
        if destroyed is None:
            continue
        remaining = key
        for a, _ in destroyed:
            remaining &= ~(1 << a.index)
        after = remaining | (1 << atom.index)
        cost = sum(costs.destroy_s(i.profile.compute_slices) for _, i in destroyed)
        cost += costs.create_s(prof.compute_slices)
        alt = Alternative(
            atom.start,
            score(space, after),
            space.reachability(after),
            tuple(str(i) for _, i in destroyed),
            cost,
        )
        options.append(
            (
                round(cost, 6),
                -alt.score,
                _order_index(prof, atom.start),
                alt,
                tuple(i for _, i in destroyed),
                after,
            )
        )
    if not options:
        return None
    options.sort(key=lambda o: (o[0], o[1], o[2]))
    _, _, _, best, destroyed_instances, after = options[0]
    created = prof
    if policy.upsize_compute:
        remaining = after & ~(1 << space.atom(prof, best.start).index)
        created = _upsized(space, remaining, prof, best.start, score)
        if created is not prof:
            after = space.allocate(remaining, created, best.start)
    destroys = [
        DestroyOp(space.member(i.profile), i.start)
        for i in sorted(destroyed_instances, key=lambda i: i.start)
    ]
    ops: tuple[Op, ...] = (*destroys, CreateOp(created, best.start))
    # priced as executed: what is destroyed, and what is really created
    cost = sum(costs.destroy_s(op.profile.compute_slices) for op in destroys)
    cost += costs.create_s(created.compute_slices)
    return _decision(
        view,
        "repartition",
        created,
        best.start,
        ops,
        cost,
        key,
        after,
        score,
        tuple(o[3] for o in options),
        policy,
    )


def _minimal_destroy_set(
    space: StateSpace,
    key: StateKey,
    atom: Atom,
    blockers: list[tuple[Atom, Instance]],
    placed: Sequence[tuple[Atom, Instance]],
    costs: CostModel,
    score: Scorer,
) -> list[tuple[Atom, Instance]] | None:
    """The cheapest idle instances to destroy so ``atom`` can be created, or ``None``.

    Overlapping instances must go. Usually that is enough; when a shared cap still
    blocks (a second ``+me``: one OFA; an engine budget; an instance limit) the
    cheapest set of further idle instances that lifts it goes too (ties: the result
    with the best score). A GPU has at most a handful of instances, so the subsets
    are tried exhaustively, and only in that rare case.
    """
    remaining = key
    for a, _ in blockers:
        remaining &= ~(1 << a.index)
    if space.can_allocate(remaining, atom):
        return blockers
    taken = {a.index for a, _ in blockers}
    others = [(a, i) for a, i in placed if not i.busy and a.index not in taken]
    best: tuple[float, float, list[tuple[Atom, Instance]]] | None = None
    for size in range(1, len(others) + 1):
        for extra in combinations(others, size):
            trial = remaining
            for a, _ in extra:
                trial &= ~(1 << a.index)
            if not space.can_allocate(trial, atom):
                continue
            cost = round(sum(costs.destroy_s(i.profile.compute_slices) for _, i in extra), 6)
            rank = (cost, -score(space, trial | (1 << atom.index)))
            if best is None or rank < best[:2]:
                best = (*rank, [*blockers, *extra])
    return best[2] if best is not None else None


def _decision(
    view: GpuView,
    action: Literal["reuse", "create", "repartition"],
    prof: Profile,
    start: int,
    ops: tuple[Op, ...],
    cost: float,
    before: StateKey,
    after: StateKey,
    score: Scorer,
    alternatives: tuple[Alternative, ...],
    policy: PlannerPolicy,
) -> Decision:
    space = view.space
    compute_waste, unit_waste = space.wasted_slices(after)
    geo = space.geometry
    busy = [i.profile for i in view.instances if i.busy] + [prof]
    busy_util = sum(p.memory_slices + p.compute_slices for p in busy) / (
        geo.units + geo.compute_slices
    )
    return Decision(
        action=action,
        gpu=view.index,
        model=view.geometry.model,
        profile=prof,
        start=start,
        ops=ops,
        cost_s=cost,
        before_key=before,
        result_key=after,
        reachability_after=space.reachability(after),
        score_after=score(space, after),
        utilisation_after=utilisation(space, after),
        busy_utilisation_after=busy_util,
        wasted_after=compute_waste + unit_waste,
        alternatives=alternatives,
        rule=policy.placement.value,
        space=space,
    )


# -- a node ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionRequest:
    """What a job asks for: GPU memory, optionally minimum compute or an exact profile."""

    memory_mib: int
    min_compute: int = 0
    profile: str | None = None
    gpus: tuple[int, ...] | None = None  # restrict to these GPU indices (e.g. the slot's GPU)

    def __post_init__(self) -> None:
        if self.memory_mib < 0 or self.min_compute < 0:
            raise InvalidRequest("memory and compute must not be negative")


_ACTION_RANK = {"reuse": 0, "create": 1, "repartition": 2}


def _rules_rank(decision: Decision, empty_score: float, reuse_first: bool) -> tuple[Any, ...]:
    """[Turkkan]'s order, lower is better.

    Reuse first (issue: prefer an idle instance of the right profile over creating
    one): it changes no layout, so it costs no free slices anywhere and no NVML time.
    Then busy utilisation: packing running work keeps whole GPUs free for full-GPU
    jobs. Counting idle instances here would steer jobs toward GPUs full of idle
    fragments and spread the busy ones (measured: more refusals). NVML work comes
    next: a repartition costs well under a second ([Villarrubia] Table 1), a refused job
    waits for a whole job's runtime.
    """
    return (
        reuse_first and decision.action != "reuse",
        -round(decision.busy_utilisation_after, 9),
        _ACTION_RANK[decision.action],
        round(decision.cost_s, 6),
        decision.wasted_after,
        -round(decision.score_after / empty_score, 9),
        decision.gpu,
    )


@dataclass(frozen=True, slots=True)
class Sizing:
    """The profile a request gets on one model, or why it gets none."""

    profile: Profile | None
    why: str = ""  # when there is no profile
    unknown_profile: bool = False  # the request names a profile this model lacks


def size_request(space: StateSpace, request: PartitionRequest) -> Sizing:
    """Right-size ``request`` for a GPU of this space, with the reason when it cannot fit."""
    model = space.geometry.model
    if request.profile:
        try:
            named = space.member(request.profile)
        except UnknownProfile:
            return Sizing(None, f"{model} has no profile {request.profile!r}", True)
        return _check_named(named, request, model)
    prof = right_size(space.profiles, request.memory_mib, request.min_compute)
    if prof is not None:
        return Sizing(prof)
    most_compute = max(p.compute_slices for p in space.profiles)
    largest = max(space.profiles, key=lambda p: (p.memory_mib, p.compute_slices))
    if request.min_compute > most_compute:
        why = (
            f"no {model} profile has {request.min_compute} compute slices "
            f"(the most is {most_compute})"
        )
    elif request.memory_mib > largest.memory_mib:
        why = (
            f"{request.memory_mib} MiB is more than the largest {model} profile "
            f"({largest.name}, {largest.memory_mib} MiB)"
        )
    else:
        why = (
            f"no {model} profile has both {request.memory_mib} MiB and "
            f"{request.min_compute} compute slices"
        )
    return Sizing(None, why)


def _check_named(prof: Profile, request: PartitionRequest, model: str) -> Sizing:
    if prof.memory_mib < request.memory_mib:
        return Sizing(
            None,
            f"{prof.name} on {model} has {prof.memory_mib} MiB, less than the "
            f"{request.memory_mib} MiB asked for",
        )
    if prof.compute_slices < request.min_compute:
        return Sizing(
            None,
            f"{prof.name} on {model} has {prof.compute_slices} compute slice(s), fewer "
            f"than the {request.min_compute} asked for",
        )
    return Sizing(prof)


def never_fits_error(
    request: PartitionRequest,
    sizings: Sequence[tuple[StateSpace, Sizing]],
    other_reasons: Sequence[str] = (),
    other_largest_mib: int = 0,
) -> MigdError:
    """The error for a request that no GPU could hold even empty.

    ``UnknownProfile`` when the request names a profile that no GPU's model has (and
    nothing else could serve it), else ``RequestTooLarge`` with every distinct reason.
    """
    if (
        request.profile
        and sizings
        and not other_reasons
        and all(s.unknown_profile for _, s in sizings)
    ):
        by_model = {
            space.geometry.model: ", ".join(p.name for p in space.profiles) for space, _ in sizings
        }
        return UnknownProfile(
            f"no GPU on this node has MIG profile {request.profile!r}",
            hint="profiles here: " + "; ".join(f"{m}: {names}" for m, names in by_model.items()),
            profile=request.profile,
        )
    reasons = [r for r in dict.fromkeys([*(s.why for _, s in sizings), *other_reasons]) if r]
    if not reasons:  # never an empty reason: say at least what was asked for
        reasons = [f"no GPU here can serve {request.memory_mib} MiB (`migctl status` shows why)"]
    largest = max(
        [other_largest_mib, *(p.memory_mib for space, _ in sizings for p in space.profiles)]
    )
    return RequestTooLarge(
        "no partition on this node can ever hold the request: " + "; ".join(reasons),
        requested_mib=request.memory_mib,
        largest_mib=largest,
    )


def plan_on_node(
    views: Sequence[GpuView], request: PartitionRequest, policy: PlannerPolicy = PlannerPolicy()
) -> Decision:
    """Choose the GPU, instance and operations for ``request`` on a node.

    Raises:
        InvalidRequest: ``request.gpus`` names no GPU of this node.
        UnknownProfile: the request names a profile no GPU here has.
        RequestTooLarge: no GPU of this node could ever hold the request, even empty.
        NoCapacity: it could fit, but not now (busy instances, drained GPUs); the
            details list each GPU's reason. Callers queue such requests.
    """
    if request.gpus is not None:
        indices = [v.index for v in views]
        views = [v for v in views if v.index in request.gpus]
        if not views:
            raise InvalidRequest(
                f"no MIG GPU with index {', '.join(map(str, request.gpus))} on this node",
                hint=f"GPU indices here: {', '.join(map(str, indices)) or 'none'}",
            )
    considered: list[dict[str, Any]] = []
    sizings: list[tuple[StateSpace, Sizing]] = []
    fits_somewhere = False
    best: tuple[tuple[Any, ...], Decision] | None = None
    score = scorer_for(policy)
    # GPUs of one model share a space: size the request and score the empty GPU once
    sized: dict[int, Sizing] = {}
    empty: dict[int, float] = {}
    for view in views:
        sizing = sized.get(id(view.space))
        if sizing is None:
            sizing = sized[id(view.space)] = size_request(view.space, request)
        prof = sizing.profile
        if prof is None:
            sizings.append((view.space, sizing))
            considered.append({"gpu": view.index, "model": view.geometry.model, "why": sizing.why})
            continue
        fits_somewhere = True
        if not view.available:
            considered.append({"gpu": view.index, "why": view.unavailable_reason or "unavailable"})
            continue
        decision = _memo.plan(view, prof, policy, score)
        if decision is None:
            considered.append(
                {
                    "gpu": view.index,
                    "profile": prof.name,
                    "why": "no free or idle slices for it (busy instances in the way)",
                    "state": describe(view.space, view.key),
                }
            )
            continue
        if policy.gpu_choice is GpuChoice.FIRST_FIT:
            rank: tuple[Any, ...] = (view.index,)
        else:
            if id(view.space) not in empty:
                empty[id(view.space)] = score(view.space, EMPTY) or 1.0
            rank = _rules_rank(decision, empty[id(view.space)], policy.reuse_first)
        considered.append(
            {
                "gpu": view.index,
                "profile": prof.name,
                "action": decision.action,
                "start": decision.start,
                "cost_s": round(decision.cost_s, 3),
                "utilisation_after": round(decision.utilisation_after, 4),
                "wasted_after": decision.wasted_after,
                "reachability_after": decision.reachability_after,
            }
        )
        if best is None or rank < best[0]:
            best = (rank, decision)
    if best is None:
        if not fits_somewhere:
            raise never_fits_error(request, sizings)
        raise NoCapacity(
            f"no GPU can hold {request.memory_mib} MiB now",
            considered=considered,
        )
    decision = best[1]
    others = tuple(c for c in considered if c.get("gpu") != decision.gpu)
    return Decision(**{**decision.__dict__, "other_gpus": others})
