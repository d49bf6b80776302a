"""Exhaustive checks of the partition state machine against an independent oracle.

The oracle below knows nothing of bit masks or subset walks: it grows states
from the empty GPU by legal single allocations (checked naively, unit by unit)
and counts the full states each state can *reach* by forward search. The state
machine must agree with it on every state of every built-in model, for the
``standard`` and ``all`` profile sets (``all`` holds ``+me`` on the 8-unit
models), and of A30 and A100-40GB for every option. ``migctl states --json``
is checked against the same oracle.
"""

from __future__ import annotations

import json
from functools import cache

import pytest

from migd.core import catalog
from migd.core.geometry import Geometry, Profile
from migd.core.states import EMPTY, StateSpace, describe, state_space
from migd.errors import (
    ExclusiveConflict,
    InstanceLimitReached,
    InstanceNotFound,
    InvalidStart,
    PlacementOverlap,
    UnknownProfile,
)

Placement = tuple[int, int]  # (profile_id, start)


class Oracle:
    def __init__(self, geo: Geometry, profile_ids: set[int]) -> None:
        self.geo = geo
        self.profiles = [p for p in geo.profiles if p.profile_id in profile_ids]

    def units(self, pid: int, start: int) -> set[int]:
        return set(range(start, start + self.geo.by_id(pid).memory_slices))

    def legal(self, state: frozenset[Placement], pid: int, start: int) -> bool:
        profile = self.geo.by_id(pid)
        if start not in profile.starts or (pid, start) in state:
            return False
        taken = set().union(*(self.units(p, s) for p, s in state)) if state else set()
        if taken & self.units(pid, start):
            return False
        after = [*state, (pid, start)]
        if sum(1 for p, _ in after if p == pid) > profile.max_instances:
            return False
        for group in self.geo.exclusive_groups:
            if sum(1 for p, _ in after if p in group.profile_ids) > group.max_instances:
                return False
        if self.geo.engine_budget and all(p.engines for p in self.geo.profiles):
            for engine, cap in self.geo.engine_budget.items():
                used = sum((self.geo.by_id(p).engines or {}).get(engine, 0) for p, _ in after)
                if used > cap:
                    return False
        return True

    def successors(self, state: frozenset[Placement]) -> list[frozenset[Placement]]:
        return [
            state | {(p.profile_id, s)}
            for p in self.profiles
            for s in p.starts
            if self.legal(state, p.profile_id, s)
        ]

    def all_states(self) -> set[frozenset[Placement]]:
        seen: set[frozenset[Placement]] = {frozenset()}
        todo = [frozenset[Placement]()]
        while todo:
            for nxt in self.successors(todo.pop()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    def reachable_full(self, state: frozenset[Placement]) -> frozenset[frozenset[Placement]]:
        """Full states reachable by forward search (memoized across calls)."""
        return self._walk(state)

    @cache  # noqa: B019 - one oracle per case, kept for the test session
    def _walk(self, s: frozenset[Placement]) -> frozenset[frozenset[Placement]]:
        nxt = self.successors(s)
        if not nxt:
            return frozenset({s})
        return frozenset().union(*(self._walk(n) for n in nxt))


def placements_of(space: StateSpace, key: int) -> frozenset[Placement]:
    return frozenset((a.profile.profile_id, a.start) for a in space.placements(key))


CASES = [
    ("A30-24GB", "standard"),
    ("A30-24GB", "media"),
    ("A100-40GB", "classic"),
    ("A100-40GB", "standard"),
    ("A100-40GB", "media"),
    ("RTX-PRO-6000-96GB", "all"),
]
ORACLE_CASES = sorted(
    {*CASES, *((m, option) for m in catalog.model_names() for option in ("standard", "all"))}
)


@pytest.mark.parametrize(("model", "profiles"), ORACLE_CASES)
def test_every_state_agrees_with_the_oracle(model: str, profiles: str) -> None:
    geo = catalog.geometry(model)
    space = state_space(geo, profiles)
    oracle = Oracle(geo, {p.profile_id for p in space.profiles})
    oracle_states = oracle.all_states()
    ours = {placements_of(space, k): k for k in space}
    assert set(ours) == oracle_states
    full = set(space.full_states)
    for placements, key in ours.items():
        reachable = oracle.reachable_full(placements)
        assert (key in full) == (reachable == {placements}), describe(space, key)
        assert space.reachability(key) == len(reachable), describe(space, key)


@pytest.mark.parametrize(("model", "profiles"), CASES)
def test_reachability_never_increases_when_allocating(model: str, profiles: str) -> None:
    space = state_space(catalog.geometry(model), profiles)
    for key in space:
        for atom in space.atoms:
            if space.can_allocate(key, atom):
                child = key | (1 << atom.index)
                assert space.reachability(child) <= space.reachability(key)
                assert space.reachability(child) >= 1


@pytest.mark.parametrize(("model", "profiles"), CASES)
def test_hostable_counts_match_reachable_layouts(model: str, profiles: str) -> None:
    space = state_space(catalog.geometry(model), profiles)
    full = [(f, placements_of(space, f)) for f in space.full_states]
    for key in list(space)[:: max(1, len(space) // 150)]:
        mine = placements_of(space, key)
        expected = [0] * len(space.profiles)
        for _, layout in (pair for pair in full if pair[1] >= mine):
            for pid, _start in layout - mine:
                expected[[p.profile_id for p in space.profiles].index(pid)] += 1
        assert list(space.info(key).hostable) == expected


def test_seed_facts_about_a100() -> None:
    """[Siavashi]: 723 configurations, 78 terminal; [Villarrubia]: 19 partitions (5 on A30)."""
    a100 = catalog.geometry("A100-40GB")
    standard = state_space(a100, "standard")
    assert len(standard) == 723
    assert len(standard.full_states) == 78
    assert len(state_space(a100, "classic").full_states) == 19
    assert len(state_space(catalog.geometry("A30-24GB"), "standard").full_states) == 5


def test_seed002_ranking_first_small_instance_goes_last() -> None:
    """[MIG-HT] §4.2: a first 1g.5gb keeps the most futures open on the last slice."""
    a100 = catalog.geometry("A100-40GB")
    for option in ("classic", "standard", "media"):
        space = state_space(a100, option)
        reach = {s: space.reachability(space.allocate(EMPTY, "1g.5gb", s)) for s in range(7)}
        assert max(reach, key=lambda s: reach[s]) == 6
        assert all(reach[6] > reach[s] for s in range(6))


def test_seed001_two_small_instances_pack_together() -> None:
    """[Siavashi] §5.1: two 1g.5gb on an empty A100 belong in blocks 4 and 5, not 4 and 6."""
    space = state_space(catalog.geometry("A100-40GB"), "standard")
    at4 = space.allocate(EMPTY, "1g.5gb", 4)
    assert space.reachability(space.allocate(at4, "1g.5gb", 5)) > space.reachability(
        space.allocate(at4, "1g.5gb", 6)
    )
    assert space.configuration_capability(
        space.allocate(at4, "1g.5gb", 5)
    ) > space.configuration_capability(space.allocate(at4, "1g.5gb", 6))


class TestIllegalTransitions:
    space = state_space(catalog.geometry("A100-40GB"), "media")

    def test_unknown_start(self) -> None:
        with pytest.raises(InvalidStart, match="legal starts: 0, 4"):
            self.space.allocate(EMPTY, "3g.20gb", 2)

    def test_overlap_names_the_blocking_instance(self) -> None:
        key = self.space.allocate(EMPTY, "3g.20gb", 4)
        with pytest.raises(PlacementOverlap, match=r"3g\.20gb@4"):
            self.space.allocate(key, "2g.10gb", 4)

    def test_same_instance_twice(self) -> None:
        key = self.space.allocate(EMPTY, "1g.5gb", 3)
        with pytest.raises(PlacementOverlap):
            self.space.allocate(key, "1g.5gb", 3)

    @pytest.mark.parametrize(
        "model", [m for m in catalog.model_names() if catalog.geometry(m).units == 8]
    )
    def test_second_media_instance_names_the_single_ofa(self, model: str) -> None:
        space = state_space(catalog.geometry(model), "media")
        media = next(p for p in space.profiles if p.name.endswith("+me"))
        key = space.allocate(EMPTY, media, 0)
        with pytest.raises(ExclusiveConflict) as err:
            space.allocate(key, media, 1)
        assert "OFA" in err.value.message and media.name in err.value.message

    def test_second_media_instance_on_rtx_pro_names_the_ofa_engine(self) -> None:
        space = state_space(catalog.geometry("RTX-PRO-6000-96GB"), "all")
        key = space.allocate(EMPTY, "1g.24gb+me", 0)
        with pytest.raises(ExclusiveConflict, match="OFA"):
            space.allocate(key, "1g.24gb+me", 3)

    def test_a30_shared_jpeg_ofa(self) -> None:
        space = state_space(catalog.geometry("A30-24GB"), "media")
        key = space.allocate(EMPTY, "1g.6gb+me", 0)
        with pytest.raises(ExclusiveConflict, match="OFA"):
            space.allocate(key, "2g.12gb+me", 2)

    def test_instance_limit(self) -> None:
        geo = catalog.geometry("A100-40GB")
        space = StateSpace(geo, [geo.profile("1g.5gb")])
        key = EMPTY
        for start in range(7):
            key = space.allocate(key, "1g.5gb", start)
        assert key in space.full_states

    def test_instance_limit_below_the_grid(self) -> None:
        """No built-in table caps a profile below what its starts allow (except +me, an
        OFA matter), so a made-up model checks the limit: 1g with 4 starts, at most 2."""
        one = Profile(1, "1g.6gb", 0, 1, 1, 6000, 2, (0, 1, 2, 3), (0, 1, 2, 3))
        full = Profile(0, "4g.24gb", 3, 4, 4, 24000, 1, (0,), (0,))
        space = StateSpace(Geometry("Made-up", "made up", 4, 4, 24000, (one, full)))
        key = space.allocate(space.allocate(EMPTY, one, 0), one, 1)
        assert key in space.full_states
        with pytest.raises(InstanceLimitReached, match="at most 2"):
            space.allocate(key, one, 2)

    def test_release_unknown(self) -> None:
        with pytest.raises(InstanceNotFound):
            self.space.release(EMPTY, "1g.5gb", 0)

    def test_profile_outside_set(self) -> None:
        space = state_space(catalog.geometry("A100-40GB"), "classic")
        with pytest.raises(UnknownProfile):
            space.allocate(EMPTY, "1g.10gb", 0)


def test_media_instances_map_onto_standard_slots() -> None:
    """An admin's +me instance occupies the same slices as its base profile."""
    space = state_space(catalog.geometry("A100-40GB"), "standard")
    assert space.key_of([("1g.5gb+me", 6)]) == space.allocate(EMPTY, "1g.5gb", 6)


def test_release_undoes_allocate() -> None:
    space = state_space(catalog.geometry("H100-80GB"), "standard")
    for key in space:
        for atom in space.placements(key):
            back = space.release(key, atom.profile, atom.start)
            assert space.allocate(back, atom.profile, atom.start) == key


def test_wasted_slices_follow_seed000() -> None:
    """[Turkkan]: 1g at slice 6 strands memory slice 7; 3g at 0 strands a compute slice."""
    space = state_space(catalog.geometry("A100-80GB"), "standard")
    assert space.wasted_slices(space.allocate(EMPTY, "1g.10gb", 6)) == (0, 1)
    assert space.wasted_slices(space.allocate(EMPTY, "1g.10gb", 0)) == (0, 0)
    three_at_0 = space.allocate(EMPTY, "3g.40gb", 0)
    assert space.wasted_slices(three_at_0)[0] == 1


@pytest.mark.parametrize("profiles", ["classic", "standard", "media", "all"])
@pytest.mark.parametrize("model", ["A30-24GB", "A100-40GB", "H100-80GB", "RTX-PRO-6000-96GB"])
def test_reachability_and_max_cc_choose_alike_on_builtin_tables(model: str, profiles: str) -> None:
    """A finding the README reports: [MIG-HT]'s and [Siavashi]'s placements coincide here
    (in every state with a choice; 2407 choices on an A100 with +me)."""
    from migd.core.planner import _order_index

    space = state_space(catalog.geometry(model), profiles)
    choices = 0
    for key in space:
        for profile in space.profiles:
            starts = space.legal_starts(key, profile)
            if len(starts) < 2:
                continue
            choices += 1
            by_reach = {s: space.reachability(space.allocate(key, profile, s)) for s in starts}
            by_cc = {
                s: space.configuration_capability(space.allocate(key, profile, s)) for s in starts
            }
            order = {s: _order_index(profile, s) for s in starts}
            assert min(starts, key=lambda s: (-by_reach[s], order[s])) == min(
                starts, key=lambda s: (-by_cc[s], order[s])
            )
    assert choices > 10
    if (model, profiles) == ("A100-40GB", "media"):
        assert choices == 2407


@pytest.mark.parametrize("profiles", ["standard", "media"])
def test_migctl_states_json_matches_the_oracle(
    profiles: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`migctl states --json` for A30, checked field by field against the oracle."""
    from migd.cli.migctl import main

    assert main(["states", "--model", "A30-24GB", "--profiles", profiles, "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    geo = catalog.geometry("A30-24GB")
    names = {p["name"] for p in table["profiles"]}
    oracle = Oracle(geo, {geo.profile(n).profile_id for n in names})
    expected = oracle.all_states()
    listed = {
        frozenset((p["id"], p["start"]) for p in entry["placements"]): entry
        for entry in table["states"]
    }
    assert set(listed) == expected
    assert table["state_count"] == len(expected)
    assert table["placement_units"] == 4 and table["compute_slices"] == 4
    full_states = {s for s in expected if not oracle.successors(s)}
    assert table["full_count"] == len(full_states)
    for state, entry in listed.items():
        reachable = oracle.reachable_full(state)
        assert entry["full"] == (state in full_states)
        assert entry["reachability"] == len(reachable)
        hostable: dict[str, int] = {}
        for layout in reachable:
            for pid, _ in layout - state:
                name = geo.by_id(pid).name
                hostable[name] = hostable.get(name, 0) + 1
        assert entry["hostable"] == hostable
        assert entry["configuration_capability"] == len(oracle.successors(state))
        compute = max(sum(geo.by_id(p).compute_slices for p, _ in m) for m in reachable)
        units = max(sum(geo.by_id(p).memory_slices for p, _ in m) for m in reachable)
        assert entry["wasted_slices"] == {"compute": 4 - compute, "memory": 4 - units}
        for placement in entry["placements"]:
            assert placement["size"] == geo.by_id(placement["id"]).memory_slices
            assert placement["profile"] == geo.by_id(placement["id"]).name
