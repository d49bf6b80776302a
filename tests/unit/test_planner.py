"""The placement planner on hand-made cases: right-sizing, reuse, upsizing, explanations,
mixed-model nodes and the errors a request can meet."""

from __future__ import annotations

import json

import pytest

from migd.core import catalog
from migd.core.costs import CostModel
from migd.core.planner import (
    GpuView,
    Instance,
    PartitionRequest,
    PlacementRule,
    PlannerPolicy,
    next_larger,
    plan_on_gpu,
    plan_on_node,
    right_size,
    size_request,
)
from migd.core.states import EMPTY, StateSpace, state_space
from migd.errors import InvalidRequest, NoCapacity, RequestTooLarge, UnknownProfile


def space_of(model: str, profiles: str = "standard") -> StateSpace:
    return state_space(catalog.geometry(model), profiles)


A100 = space_of("A100-40GB")


def inst(space: StateSpace, name: str, start: int, busy: bool) -> Instance:
    return Instance(space.member(name), start, busy)


# -- right-sizing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("memory_mib", "min_compute", "expected"),
    [
        (4000, 0, "1g.5gb"),
        (4864, 0, "1g.5gb"),
        (4865, 0, "1g.10gb"),
        (9984, 0, "1g.10gb"),  # 1g.10gb and 2g.10gb have the same memory: least compute
        (9984, 2, "2g.10gb"),
        (9984, 3, "3g.20gb"),
        (19000, 4, "4g.20gb"),
        (20092, 0, "7g.40gb"),
        (1, 7, "7g.40gb"),
    ],
)
def test_right_size_a100(memory_mib: int, min_compute: int, expected: str) -> None:
    chosen = right_size(A100.profiles, memory_mib, min_compute)
    assert chosen is not None and chosen.name == expected


def test_next_bigger_chain_climbs_to_the_whole_gpu() -> None:
    chain = [A100.member("1g.5gb")]
    while (bigger := next_larger(A100.profiles, chain[-1])) is not None:
        chain.append(bigger)
    assert [p.name for p in chain] == ["1g.5gb", "1g.10gb", "3g.20gb", "7g.40gb"]
    # never less compute than the instance that ran out of memory
    assert next_larger(A100.profiles, A100.member("2g.10gb")).name == "3g.20gb"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (PartitionRequest(1000, min_compute=8), "no A100-40GB profile has 8 compute slices"),
        (PartitionRequest(50_000), "50000 MiB is more than the largest A100-40GB profile"),
        (PartitionRequest(6000, profile="1g.5gb"), "1g.5gb on A100-40GB has 4864 MiB"),
        (PartitionRequest(1000, 2, profile="1g.10gb"), "has 1 compute slice(s), fewer than"),
    ],
)
def test_a_request_that_never_fits_says_why(request_: PartitionRequest, reason: str) -> None:
    assert size_request(A100, request_).profile is None
    with pytest.raises(RequestTooLarge) as err:
        plan_on_node([GpuView(0, A100)], request_)
    assert reason in err.value.message
    assert "more than any partition" not in err.value.message


def test_gpus_that_match_nothing_are_an_invalid_request() -> None:
    with pytest.raises(InvalidRequest) as err:
        plan_on_node([GpuView(0, A100), GpuView(1, A100)], PartitionRequest(4000, gpus=(5,)))
    assert "5" in err.value.message and "0, 1" in err.value.hint


# -- one GPU ------------------------------------------------------------------------------------


def test_idle_reuse_beats_creating_a_better_placed_instance() -> None:
    view = GpuView(0, A100, (inst(A100, "1g.5gb", 0, False),))
    decision = plan_on_gpu(view, A100.member("1g.5gb"))
    assert decision is not None
    assert (decision.action, decision.start, decision.ops) == ("reuse", 0, ())
    # with reuse off, the same request would have been an NVML create
    created = plan_on_gpu(view, A100.member("1g.5gb"), PlannerPolicy(reuse_idle=False))
    assert created is not None and created.action == "create" and created.ops


def test_upsized_instance_is_reused_not_recreated() -> None:
    """3g.20gb at start 0 is created as 4g.20gb; the next 3g.20gb request reuses it."""
    busy = inst(A100, "3g.20gb", 4, True)
    first = plan_on_gpu(GpuView(0, A100, (busy,)), A100.member("3g.20gb"))
    assert first is not None and first.action == "create"
    assert (first.profile.name, first.start) == ("4g.20gb", 0)
    costs = CostModel.for_model("A100-40GB")
    assert first.cost_s == costs.create_s(4) != costs.create_s(3)  # priced as created
    idle = Instance(first.profile, first.start, False)
    second = plan_on_gpu(GpuView(0, A100, (busy, idle)), A100.member("3g.20gb"))
    assert second is not None
    assert (second.action, second.profile.name, second.start, second.ops) == (
        "reuse",
        "4g.20gb",
        0,
        (),
    )


def test_reuse_takes_the_exact_profile_before_a_bigger_one() -> None:
    layout = (inst(A100, "4g.20gb", 0, False), inst(A100, "3g.20gb", 4, False))
    decision = plan_on_gpu(GpuView(0, A100, layout), A100.member("3g.20gb"))
    assert decision is not None and (decision.profile.name, decision.start) == ("3g.20gb", 4)


def test_reuse_never_strands_more_slices_or_lacks_the_media_engine() -> None:
    media = space_of("A100-40GB", "media")
    # an idle 1g.10gb (two slices) does not serve a 1g.5gb request: it would strand one
    layout = (
        inst(A100, "1g.10gb", 0, False),
        *(inst(A100, "1g.5gb", s, True) for s in range(2, 7)),
    )
    view = GpuView(0, A100, layout)
    assert plan_on_gpu(view, A100.member("1g.5gb"), PlannerPolicy(fission_fusion=False)) is None
    split = plan_on_gpu(view, A100.member("1g.5gb"))
    assert split is not None and split.action == "repartition"
    # an idle base 1g.5gb does not serve a 1g.5gb+me request; the +me one serves a base one
    base = GpuView(0, media, (inst(media, "1g.5gb", 6, False),))
    plus = plan_on_gpu(base, media.member("1g.5gb+me"))
    assert plus is not None and plus.action == "create"
    me = GpuView(0, media, (inst(media, "1g.5gb+me", 6, False),))
    served = plan_on_gpu(me, media.member("1g.5gb"))
    assert served is not None and served.action == "reuse"


def test_reachability_ties_go_to_the_driver_default_order() -> None:
    view = GpuView(0, A100, (inst(A100, "1g.5gb", 6, True),))
    profile = A100.member("1g.5gb")
    decision = plan_on_gpu(view, profile)
    assert decision is not None
    best = max(a.score for a in decision.alternatives)
    tied = [a.start for a in decision.alternatives if a.score == best]
    assert len(tied) > 1
    assert decision.start == min(tied, key=profile.default_order.index)


@pytest.mark.parametrize(("name", "start"), [("1g.5gb", 6), ("2g.10gb", 4), ("3g.20gb", 4)])
def test_driver_rule_follows_the_default_order(name: str, start: int) -> None:
    policy = PlannerPolicy(placement=PlacementRule.DRIVER, upsize_compute=False)
    decision = plan_on_gpu(GpuView(0, A100), A100.member(name), policy)
    assert decision is not None and decision.start == start == A100.member(name).default_order[0]


def test_demand_mix_changes_the_start() -> None:
    """With only 3g.20gb wanted, a 2g.10gb goes where it leaves most 3g.20gb futures."""
    profile = A100.member("2g.10gb")
    plain = plan_on_gpu(GpuView(0, A100), profile)
    mix = {"A100-40GB": {A100.member("3g.20gb").profile_id: 1.0}}
    weighted = plan_on_gpu(
        GpuView(0, A100), profile, PlannerPolicy(placement=PlacementRule.WEIGHTED, demand=mix)
    )
    assert plain is not None and weighted is not None
    scores = {
        a.start: A100.weighted_reachability(
            A100.allocate(EMPTY, profile, a.start), mix["A100-40GB"]
        )
        for a in weighted.alternatives
    }
    assert scores[weighted.start] == max(scores.values())
    assert weighted.score_after == scores[weighted.start]
    assert scores[plain.start] < scores[weighted.start]
    # a mix for another model leaves this one on plain reachability
    other = PlannerPolicy(placement=PlacementRule.WEIGHTED, demand={"A30-24GB": {14: 1.0}})
    assert plan_on_gpu(GpuView(0, A100), profile, other).start == plain.start  # type: ignore[union-attr]


def test_the_explanation_lists_every_start_with_its_reachability() -> None:
    view = GpuView(3, A100, (inst(A100, "3g.20gb", 4, True),))
    decision = plan_on_gpu(view, A100.member("1g.5gb"))
    assert decision is not None
    expected = {
        s: A100.reachability(A100.allocate(view.key, "1g.5gb", s))
        for s in A100.legal_starts(view.key, "1g.5gb")
    }
    assert {a.start: a.reachability for a in decision.alternatives} == expected
    assert decision.reachability_after == max(expected.values())
    out = decision.to_dict()
    json.dumps(out)  # serialisable as the API sends it
    assert out["action"] == "create" and out["gpu"] == 3 and out["model"] == "A100-40GB"
    assert out["ops"] == [f"create 1g.5gb@{decision.start}"]
    assert out["state_before"] == "3g.20gb@4"
    assert out["state_after"] == f"1g.5gb@{decision.start} 3g.20gb@4"
    assert [a["start"] for a in out["alternatives"]] == sorted(expected)
    assert out["reason"].startswith(f"GPU 3 (A100-40GB): create 1g.5gb@{decision.start}")


def test_a_repartition_explains_what_it_destroys() -> None:
    layout = tuple(inst(A100, "1g.5gb", s, s >= 4) for s in range(7))
    decision = plan_on_gpu(GpuView(0, A100, layout), A100.member("2g.10gb"))
    assert decision is not None and decision.action == "repartition"
    out = decision.to_dict()
    destroys = [op for op in out["ops"] if op.startswith("destroy")]
    assert len(destroys) == 2 and out["ops"][-1] == f"create 2g.10gb@{decision.start}"
    assert all(len(a["destroys"]) == 2 for a in out["alternatives"])
    assert "ops: destroy 1g.5gb@" in out["reason"]
    costs = CostModel.for_model("A100-40GB")
    assert decision.cost_s == pytest.approx(2 * costs.destroy_s(1) + costs.create_s(2))


# -- a node -------------------------------------------------------------------------------------


def test_idle_reuse_on_another_gpu_beats_creating_on_the_busy_one() -> None:
    views = [
        GpuView(0, A100, (inst(A100, "1g.5gb", 6, False),)),
        GpuView(1, A100, (inst(A100, "3g.20gb", 0, True),)),
    ]
    decision = plan_on_node(views, PartitionRequest(4000))
    assert (decision.gpu, decision.action, decision.start) == (0, "reuse", 6)
    # [Turkkan]'s order alone (busy utilisation first) packs onto the busy GPU instead
    packed = plan_on_node(views, PartitionRequest(4000), PlannerPolicy(reuse_first=False))
    assert (packed.gpu, packed.action) == (1, "create")


def test_idle_reuse_beats_a_repartition_elsewhere() -> None:
    packed = (
        *(inst(A100, "1g.5gb", s, True) for s in (0, 1, 2, 3, 6)),
        inst(A100, "2g.10gb", 4, False),
    )
    views = [GpuView(0, A100, (inst(A100, "1g.5gb", 6, False),)), GpuView(1, A100, packed)]
    decision = plan_on_node(views, PartitionRequest(4000))
    assert (decision.gpu, decision.action) == (0, "reuse")
    busy_first = plan_on_node(views, PartitionRequest(4000), PlannerPolicy(reuse_first=False))
    assert (busy_first.gpu, busy_first.action) == (1, "repartition")


def test_named_profile_on_a_mixed_node_skips_gpus_without_it() -> None:
    h100 = space_of("H100-80GB")
    views = [GpuView(0, h100), GpuView(1, A100)]
    decision = plan_on_node(views, PartitionRequest(4000, profile="1g.5gb"))
    assert (decision.gpu, decision.profile.name) == (1, "1g.5gb")
    skipped = {c["gpu"]: c["why"] for c in decision.other_gpus}
    assert "H100-80GB has no profile '1g.5gb'" in skipped[0]
    # the H100 holds its own names
    assert plan_on_node(views, PartitionRequest(0, profile="1g.10gb")).model in (
        "H100-80GB",
        "A100-40GB",
    )


def test_a_profile_no_gpu_knows_is_unknown_and_lists_the_valid_ones() -> None:
    views = [GpuView(0, space_of("H100-80GB")), GpuView(1, space_of("A30-24GB"))]
    with pytest.raises(UnknownProfile) as err:
        plan_on_node(views, PartitionRequest(0, profile="1g.5gb"))
    assert "1g.5gb" in err.value.message
    assert "H100-80GB: 1g.10gb" in err.value.hint and "A30-24GB: 1g.6gb" in err.value.hint


def test_mixed_node_right_sizes_per_model() -> None:
    a30 = space_of("A30-24GB")
    views = [GpuView(0, a30, (inst(a30, "4g.24gb", 0, True),)), GpuView(1, A100)]
    decision = plan_on_node(views, PartitionRequest(5000))
    assert (decision.gpu, decision.profile.name) == (1, "1g.10gb")
    views = [GpuView(0, a30), GpuView(1, A100, (inst(A100, "7g.40gb", 0, True),))]
    decision = plan_on_node(views, PartitionRequest(5000))
    assert (decision.gpu, decision.profile.name) == (0, "1g.6gb")


def test_busy_everywhere_is_no_capacity_with_each_gpus_reason() -> None:
    views = [
        GpuView(0, A100, (inst(A100, "7g.40gb", 0, True),)),
        GpuView(1, A100, available=False, unavailable_reason="draining"),
    ]
    with pytest.raises(NoCapacity) as err:
        plan_on_node(views, PartitionRequest(4000))
    whys = {c["gpu"]: c["why"] for c in err.value.details["considered"]}
    assert whys[1] == "draining" and "busy instances" in whys[0]
