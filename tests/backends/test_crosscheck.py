"""The simulator and migd's state machine agree on what may be placed — at every step.

The simulator checks placements with its own unit-set rules; ``migd.core.states``
with precomputed bit-mask state spaces. Neither uses the other, so agreement is a
real cross-check of both (and of the NVML error mapping in between).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migd.backends.simulated import SimGpuSpec, SimNode, simulated_backend
from migd.backends.simulated import nvml_api as api
from migd.core import catalog
from migd.core.geometry import Geometry
from migd.core.states import StateSpace, state_space
from migd.errors import (
    IllegalTransition,
    InstanceNotFound,
    InsufficientResources,
    InvalidStart,
)

# One of each grid (4, 8 and 12 units); H100 adds a binding-free engine budget, A30 a
# shared-OFA group, RTX PRO an engine budget that does bind (+me.all vs. the rest).
REPRESENTATIVE = ["A30-24GB", "A100-40GB", "H100-80GB", "RTX-PRO-6000-96GB"]


def _legality_agrees(node: SimNode, space: StateSpace, key: int) -> None:
    for atom in space.atoms:
        assert node.mig.can_create(0, atom.profile.profile_id, atom.start) == (
            space.can_allocate(key, atom)
        ), (atom, key)


@pytest.mark.parametrize("model", list(catalog.builtin_models()))
def test_legality_agrees_on_every_state(model: str) -> None:
    node = SimNode.from_description(f"1x{model}")
    space = state_space(catalog.geometry(model), "all")
    every_state = space.keys()  # StateSpace is not itself iterable
    for key in every_state:
        node.reset()
        for atom in space.placements(key):
            node.mig.create_gpu_instance(
                0, atom.profile.profile_id, atom.start, atom.profile.memory_slices
            )
        _legality_agrees(node, space, key)


def _custom_geometries() -> dict[str, Geometry]:
    """Variants where a rule binds that no built-in table exercises on its own."""
    a30 = catalog.geometry("A30-24GB")
    a100 = catalog.geometry("A100-40GB")
    return {
        # On A30 the engine budget also forbids the two +me profiles together; without it
        # only the exclusive group does.
        "a30-group-only": replace(a30, model="A30-group", engine_budget=None),
        # On built-in tables the slices run out before any per-profile limit binds.
        "a100-1g-limit-2": replace(
            a100,
            model="A100-limit",
            profiles=tuple(
                replace(p, max_instances=2) if p.profile_id in (19, 15) else p
                for p in a100.profiles
            ),
        ),
    }


@pytest.mark.parametrize("name", list(_custom_geometries()))
def test_legality_agrees_where_limits_and_groups_bind_alone(name: str) -> None:
    geometry = _custom_geometries()[name]
    spec = replace(SimGpuSpec.for_model("A100-40GB"), geometry=geometry, model=None)
    node = SimNode([spec])
    space = state_space(geometry, "all")
    every_state = space.keys()
    for key in every_state:
        node.reset()
        for atom in space.placements(key):
            node.mig.create_gpu_instance(
                0, atom.profile.profile_id, atom.start, atom.profile.memory_slices
            )
        _legality_agrees(node, space, key)
    # The rule under test does bind: without limits and groups there are more states.
    unconstrained = replace(
        geometry,
        model=geometry.model + "-free",
        exclusive_groups=(),
        engine_budget=None,
        profiles=tuple(replace(p, max_instances=geometry.units) for p in geometry.profiles),
    )
    assert len(space) < len(state_space(unconstrained, "all"))


@pytest.mark.parametrize("model", REPRESENTATIVE)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_create_destroy_sequences_agree(model: str, data: st.DataObject) -> None:
    backend, node = simulated_backend(f"1x{model}", retry_backoff_s=0.0)
    geometry = catalog.geometry(model)
    space = state_space(geometry, "all")
    key = 0
    for _step in range(data.draw(st.integers(1, 30), label="steps")):
        listed = backend.list_instances(0)
        if listed and data.draw(st.integers(0, 2), label="destroy?") == 0:
            victim = data.draw(st.sampled_from(listed), label="destroy")
            backend.destroy_instance(0, victim.gi_id)
            key = space.release(key, victim.profile_id, victim.start)
        else:
            profile = data.draw(st.sampled_from(geometry.profiles), label="profile")
            start = data.draw(
                st.one_of(st.sampled_from(profile.starts), st.integers(0, geometry.units)),
                label="start",
            )
            expected: type[Exception] | None = None
            try:
                next_key = space.allocate(key, profile.profile_id, start)
            except InvalidStart:
                expected = InvalidStart
            except IllegalTransition:
                expected = InsufficientResources
            if expected is None:
                backend.create_instance(0, profile.profile_id, start)
                key = next_key
            else:
                with pytest.raises(expected):
                    backend.create_instance(0, profile.profile_id, start)
        assert sorted((m.profile_id, m.start) for m in backend.list_instances(0)) == sorted(
            (a.profile.profile_id, a.start) for a in space.placements(key)
        )
        _legality_agrees(node, space, key)
    with pytest.raises(InstanceNotFound):
        backend.destroy_instance(0, 99)


def test_a_foreign_nvml_client_breaks_the_agreement_visibly() -> None:
    # If another client takes slices behind migd's back, the refusal says so instead of
    # blaming a rule migd does not see.
    backend, node = simulated_backend("1xA100-40GB")
    backend.list_instances(0)
    node.fail_next(
        "nvmlDeviceCreateGpuInstanceWithPlacement", api.NVML_ERROR_INSUFFICIENT_RESOURCES
    )
    with pytest.raises(InsufficientResources, match="another NVML client"):
        backend.create_instance(0, 0, 0)
