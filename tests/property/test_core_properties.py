"""Property-based tests (hypothesis) of the state machine and the planner on every model."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migd.core import catalog
from migd.core.planner import (
    CreateOp,
    DestroyOp,
    GpuChoice,
    GpuView,
    Instance,
    PartitionRequest,
    PlacementRule,
    PlannerPolicy,
    next_larger,
    plan_on_gpu,
    plan_on_node,
    right_size,
)
from migd.core.states import EMPTY, StateSpace, state_space
from migd.errors import IllegalTransition, NoCapacity, RequestTooLarge

MODELS = sorted(catalog.builtin_models())
OPTIONS = ["classic", "standard", "media", "all"]


def full_supersets(space: StateSpace, key: int) -> int:
    return sum(1 for f in space.full_states if f & key == key)


@st.composite
def walks(draw: st.DrawFn) -> tuple[StateSpace, list[int]]:
    """A random allocate/release walk; returns the space and the visited keys."""
    geo = catalog.geometry(draw(st.sampled_from(MODELS)))
    space = state_space(geo, draw(st.sampled_from(OPTIONS)))
    key = EMPTY
    visited = [key]
    for _ in range(draw(st.integers(1, 25))):
        placed = space.placements(key)
        if placed and draw(st.booleans()):
            atom = draw(st.sampled_from(placed))
            key = space.release(key, atom.profile, atom.start)
        else:
            atom = draw(st.sampled_from(space.atoms))
            try:
                key = space.allocate(key, atom.profile, atom.start)
            except IllegalTransition:
                assert not space.can_allocate(key, atom)
                continue
        visited.append(key)
    return space, visited


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(walks())
def test_random_walks_stay_in_the_table(walk: tuple[StateSpace, list[int]]) -> None:
    space, keys = walk
    for key in keys:
        assert key in space
        placed = space.placements(key)
        units = 0
        for atom in placed:
            assert units & atom.units == 0, "overlap in a reachable state"
            units |= atom.units
        assert sum(a.profile.compute_slices for a in placed) <= space.geometry.compute_slices
        assert space.reachability(key) == full_supersets(space, key)


@settings(max_examples=150, deadline=None)
@given(walks(), st.data())
def test_adding_an_instance_never_increases_reachability(
    walk: tuple[StateSpace, list[int]], data: st.DataObject
) -> None:
    space, keys = walk
    key = data.draw(st.sampled_from(keys))
    for atom in space.atoms:
        if space.can_allocate(key, atom):
            assert space.reachability(key | 1 << atom.index) <= space.reachability(key)


@st.composite
def gpu_views(draw: st.DrawFn, index: int = 0) -> GpuView:
    """A random reachable layout of a random model, each instance busy or idle."""
    space, keys = draw(walks())
    key = keys[-1]
    instances = tuple(
        Instance(a.profile, a.start, draw(st.booleans())) for a in space.placements(key)
    )
    return GpuView(index, space, instances)


def apply_ops(view: GpuView, decision_ops: tuple[CreateOp | DestroyOp, ...]) -> int:
    key = view.key
    for op in decision_ops:
        if isinstance(op, DestroyOp):
            key = view.space.release(key, op.profile, op.start)
        else:
            key = view.space.allocate(key, op.profile, op.start)
    return key


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpu_views(), st.data())
def test_plans_never_touch_busy_instances_and_deliver_their_state(
    view: GpuView, data: st.DataObject
) -> None:
    profile = data.draw(st.sampled_from(view.space.profiles))
    policy = PlannerPolicy(placement=data.draw(st.sampled_from(list(PlacementRule))))
    decision = plan_on_gpu(view, profile, policy)
    busy = {(i.profile.profile_id, i.start) for i in view.instances if i.busy}
    if decision is None:
        # Nothing possible: then no legal start exists even with every idle instance gone.
        key = view.key
        for inst in view.instances:
            if not inst.busy:
                key = view.space.release(key, inst.profile, inst.start)
        assert view.space.legal_starts(key, profile) == []
        return
    for op in decision.ops:
        if isinstance(op, DestroyOp):
            assert (op.profile.profile_id, op.start) not in busy
    assert apply_ops(view, decision.ops) == decision.result_key
    # the profile asked for, or the same memory with compute that would be stranded anyway
    assert decision.profile.memory_slices == profile.memory_slices
    assert decision.profile.memory_mib >= profile.memory_mib
    assert decision.profile.compute_slices >= profile.compute_slices
    if decision.profile != profile:
        plain = view.space.allocate(apply_ops(view, decision.ops[:-1]), profile, decision.start)
        assert view.space.wasted_slices(decision.result_key)[0] < view.space.wasted_slices(plain)[0]
        assert view.space.reachability(decision.result_key) >= view.space.reachability(plain)
    profile = decision.profile
    placed = {(a.profile.profile_id, a.start) for a in view.space.placements(decision.result_key)}
    assert (profile.profile_id, decision.start) in placed
    if decision.action == "reuse":
        assert decision.ops == ()
        assert any(
            i.start == decision.start and not i.busy and i.profile == profile
            for i in view.instances
        )
    if decision.action == "create":
        assert [type(op) for op in decision.ops] == [CreateOp]
        # reachability placement picks a best successor among the legal starts
        if policy.placement is PlacementRule.REACHABILITY:
            best = max(a.reachability for a in decision.alternatives)
            assert decision.reachability_after == best


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpu_views(), st.data())
def test_repartition_is_the_cheapest_plan(view: GpuView, data: st.DataObject) -> None:
    """No cheaper set of idle instances would have freed a legal start."""
    profile = data.draw(st.sampled_from(view.space.profiles))
    decision = plan_on_gpu(view, profile)
    if decision is None or decision.action != "repartition":
        return
    destroyed = sum(isinstance(op, DestroyOp) for op in decision.ops)
    idle = [i for i in view.instances if not i.busy]
    space = view.space
    for n, inst in enumerate(idle):
        # any single idle instance whose removal alone frees a start would be cheaper
        if destroyed > 1:
            key = space.release(view.key, inst.profile, inst.start)
            if space.legal_starts(key, profile):
                alone = space.release(view.key, inst.profile, inst.start)
                assert not space.legal_starts(alone, profile) or any(
                    a.cost_s <= decision.cost_s for a in decision.alternatives
                ), n


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(MODELS), st.integers(1, 200_000), st.integers(0, 8))
def test_right_size_is_tightest(model: str, memory_mib: int, min_compute: int) -> None:
    space = state_space(catalog.geometry(model), "standard")
    chosen = right_size(space.profiles, memory_mib, min_compute)
    fitting = [
        p for p in space.profiles if p.memory_mib >= memory_mib and p.compute_slices >= min_compute
    ]
    if not fitting:
        assert chosen is None
        return
    assert chosen is not None
    assert chosen.memory_mib == min(p.memory_mib for p in fitting)
    bigger = next_larger(space.profiles, chosen)
    if bigger is not None:
        assert bigger.memory_mib > chosen.memory_mib
        assert bigger.compute_slices >= chosen.compute_slices


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(gpu_views(), min_size=1, max_size=8), st.integers(1, 250_000))
def test_node_plan_refuses_only_what_never_fits(views: list[GpuView], memory_mib: int) -> None:
    views = [GpuView(n, v.space, v.instances) for n, v in enumerate(views)]
    request = PartitionRequest(memory_mib)
    try:
        decision = plan_on_node(views, request)
    except RequestTooLarge:
        assert all(right_size(v.space.profiles, memory_mib) is None for v in views)
        return
    except NoCapacity:
        assert any(right_size(v.space.profiles, memory_mib) is not None for v in views)
        return
    assert decision.profile.memory_mib >= memory_mib
    chosen = views[decision.gpu]
    assert apply_ops(chosen, decision.ops) == decision.result_key


def test_rules_keep_a_whole_gpu_free_where_first_fit_does_not() -> None:
    """Seed 000: pack small jobs onto the busy GPU so a full-GPU job still fits."""
    space = state_space(catalog.geometry("A100-40GB"))
    one = space.member("1g.5gb")
    first_fit = PlannerPolicy(placement=PlacementRule.DRIVER, gpu_choice=GpuChoice.FIRST_FIT)
    for policy, whole_gpu_fits in ((PlannerPolicy(), True), (first_fit, False)):
        layouts: list[list[Instance]] = [[], [Instance(one, 6, True)]]
        d = plan_on_node(
            [GpuView(n, space, tuple(lay)) for n, lay in enumerate(layouts)],
            PartitionRequest(4000),
            policy,
        )
        layouts[d.gpu].append(Instance(d.profile, d.start, True))
        views = [GpuView(n, space, tuple(lay)) for n, lay in enumerate(layouts)]
        try:
            plan_on_node(views, PartitionRequest(40000), policy)
            fits = True
        except NoCapacity:
            fits = False
        assert fits is whole_gpu_fits


def _stream(policy: PlannerPolicy, seed: int, n_gpus: int = 4, steps: int = 300) -> tuple[int, int]:
    """Accepted requests and destroy operations for a random arrival/departure stream.

    Finished jobs leave idle instances behind (the daemon's ``keep`` idle policy).
    """
    rng = random.Random(seed)
    space = state_space(catalog.geometry("A100-40GB"))
    layouts: list[dict[int, list]] = [{} for _ in range(n_gpus)]
    accepted = destroys = 0
    for t in range(steps):
        for layout in layouts:
            for entry in layout.values():
                if entry[1] is not None and entry[1] <= t:
                    entry[1] = None
        memory = rng.choice([4000] * 5 + [9000] * 3 + [19000] * 2 + [40000])
        views = [
            GpuView(n, space, tuple(Instance(p, s, end is not None) for s, (p, end) in lay.items()))
            for n, lay in enumerate(layouts)
        ]
        try:
            d = plan_on_node(views, PartitionRequest(memory), policy)
        except NoCapacity:
            continue
        accepted += 1
        for op in d.ops:
            if isinstance(op, DestroyOp):
                del layouts[d.gpu][op.start]
                destroys += 1
        layouts[d.gpu][d.start] = [d.profile, t + rng.randint(3, 12)]
    return accepted, destroys


def test_rules_and_first_fit_accept_alike_on_random_streams() -> None:
    """Measured, and reported in the README: over 20 random streams both choices accept
    the same share of requests within 1 % (first-fit over GPUs packs too: onto low
    indices). The rules' gain is where index order spreads work, as in the scenario above.
    """
    first_fit = PlannerPolicy(placement=PlacementRule.DRIVER, gpu_choice=GpuChoice.FIRST_FIT)
    rules = sum(a for a, _ in (_stream(PlannerPolicy(), seed) for seed in range(20)))
    ff = sum(a for a, _ in (_stream(first_fit, seed) for seed in range(20)))
    assert abs(rules - ff) <= 0.01 * 20 * 300, (rules, ff)
