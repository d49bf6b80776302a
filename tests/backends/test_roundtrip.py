"""Every valid state of every built-in model survives a trip through NVML and back.

For each state of ``state_space(geometry, "all")`` (2319 on A100): create its
instances from an empty GPU through ``NvmlBackend.create_instance`` (in a shuffled
order: any order of a valid state is valid), read them back with
``list_instances``, compare, and destroy everything again. mig-parted runs the
same check against its mock.
"""

from __future__ import annotations

import random

import pytest
from sim_support import Sim

from migd.core import catalog
from migd.core.states import state_space

# One model per grid size (4, 8 and 12 units) runs in the fast subset; the other 8-unit
# models repeat A100-40GB's 2319 states (several seconds each), so they are marked slow.
FAST_MODELS = ("A30-24GB", "A100-40GB", "RTX-PRO-6000-96GB")


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(m, marks=() if m in FAST_MODELS else pytest.mark.slow)
        for m in catalog.builtin_models()
    ],
)
def test_every_state_round_trips_through_nvml(sim: Sim, model: str) -> None:
    backend, node = sim(f"1x{model}")
    geometry = catalog.geometry(model)
    space = state_space(geometry, "all")
    assert backend.geometry(0).source == "nvml"
    shuffle = random.Random(model).shuffle
    every_state = space.keys()  # StateSpace is not itself iterable
    for key in every_state:
        wanted = [(a.profile.profile_id, a.start) for a in space.placements(key)]
        shuffle(wanted)
        created = [backend.create_instance(0, profile_id, start) for profile_id, start in wanted]
        listed = backend.list_instances(0)
        assert sorted((m.profile_id, m.start) for m in listed) == sorted(wanted), key
        assert sorted(listed, key=lambda m: m.gi_id) == sorted(created, key=lambda m: m.gi_id)
        assert len({m.uuid for m in listed}) == len(listed)
        for instance in listed:
            backend.destroy_instance(0, instance.gi_id)
        assert node.placements(0) == frozenset(), key
    assert backend.list_instances(0) == []
