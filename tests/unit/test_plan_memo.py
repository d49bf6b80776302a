"""The planner's per-GPU memo and a GPU's kept view (issue 26 §6): what they give back is
what planning afresh gives, on every layout tried, for the GPU that asked."""

from __future__ import annotations

import random

import pytest

from migd.core import catalog, planner
from migd.core.gpus import GpuMode, ManagedGpu, ManagedInstance, mode_state
from migd.core.planner import GpuView, Instance, PlacementRule, PlannerPolicy, scorer_for
from migd.core.states import EMPTY, StateSpace, state_space

POLICIES = [
    PlannerPolicy(),
    PlannerPolicy(placement=PlacementRule.DRIVER),
    PlannerPolicy(placement=PlacementRule.MAX_CC, upsize_compute=False),
    PlannerPolicy(fission_fusion=False, reuse_larger_idle=True),
    PlannerPolicy(placement=PlacementRule.WEIGHTED, demand={"A100-SXM4-40GB": {19: 3.0}}),
]


def random_layout(space: StateSpace, rng: random.Random) -> tuple[Instance, ...]:
    key, placed = EMPTY, []
    for _ in range(rng.randrange(8)):
        prof = rng.choice(space.profiles)
        starts = space.legal_starts(key, prof)
        if not starts:
            continue
        start = rng.choice(starts)
        key = space.allocate(key, prof, start)
        placed.append(Instance(prof, start, rng.random() < 0.5, f"gi:{len(placed)}"))
    rng.shuffle(placed)  # the order NVML lists them in is not the start order
    return tuple(placed)


@pytest.mark.parametrize("seed", range(4))
def test_a_memoised_plan_is_the_fresh_plan_for_the_gpu_that_asks(seed: int) -> None:
    rng = random.Random(seed)
    space = state_space(catalog.geometry("A100-40GB"))
    for _ in range(150):
        layout = random_layout(space, rng)
        policy = rng.choice(POLICIES)
        prof = rng.choice(space.profiles)
        # the same layout on two GPUs: the second is answered from the memo
        for index in rng.sample(range(8), 2):
            view = GpuView(index, space, layout)
            fresh = planner._plan_on_gpu(view, prof, policy, scorer_for(policy))
            memo = planner._memo.plan(view, prof, policy, scorer_for(policy))
            assert memo == fresh
            assert memo is None or memo.gpu == index


def test_a_gpus_view_follows_every_change_of_its_instances() -> None:
    geo = catalog.geometry("A100-40GB")
    gpu = ManagedGpu(3, "GPU-3", geo.model, geo.model, geo.memory_mib, mode_state(GpuMode.MIG))
    mig = gpu.mig
    assert mig is not None
    mig.space = state_space(geo)
    prof = mig.space.profiles[0]
    first = gpu.view()
    assert gpu.view() is first  # nothing changed: the same view
    inst = ManagedInstance(prof, prof.starts[0], prof.memory_mib, gi_id=1)
    mig.instances.append(inst)
    idle = gpu.view()
    assert [(i.start, i.busy) for i in idle.instances] == [(prof.starts[0], False)]
    inst.lease_id = "L1"
    assert gpu.view().instances[0].busy
    inst.lease_id = None
    assert not gpu.view().instances[0].busy
    gpu.draining = True
    assert not gpu.view().available and gpu.view().unavailable_reason == "draining"
